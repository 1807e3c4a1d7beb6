"""A file no decoder reads is named relative to --data-dir, with both decoders, in a loader worker and in the
training process; the run that stopped on it (before its first checkpoint) leaves the folder to any command
once the file is replaced (issue #40.2, #40.3, #53.5)."""

from __future__ import annotations

import json

import pytest

from ddp_recipes.data.pixels import named_loader
from ddp_recipes.data.unreadable import UnreadableImage, describe
from tests.helpers import write_jpeg_tree


def _damage(root, how: str) -> str:
    good = (root / "train" / "c0" / "0.jpg").read_bytes()
    name = "train/c1/bad.jpg"
    (root / name).write_bytes(good[:len(good) // 2] if how == "truncated" else b"notes, not an image\n" * 20)
    return name


def _main(root, out, decode: str, workers: int) -> dict:
    from recipes import resnet

    return resnet.main(["--accelerator", "cpu", "--data", "imagefolder", "--data-dir", str(root), "--image-size", "32",
                 "--batch-size", "9", "--num-workers", str(workers), "--max-steps", "1", "--decode", decode,
                 "--logger", "none", "--output-dir", str(out)])


@pytest.mark.parametrize(("decode", "how", "workers"), [("cpu", "truncated", 1), ("cpu", "text", 0),
                                                        ("gpu", "text", 1), ("gpu", "truncated", 0)])
def test_an_unreadable_image_is_named_relative_to_the_data_dir(tmp_path, capsys, decode, how, workers):
    root = write_jpeg_tree(tmp_path / "imgs", per_class=4, val_per_class=2, side=40)
    name = _damage(root, how)
    with pytest.raises(SystemExit) as stopped:
        _main(root, tmp_path / "out", decode, workers)
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert stopped.value.code == 2
    assert err.startswith(f"python -m recipes.resnet: error: --data-dir {root} holds an image that cannot be "
                          f"decoded: {name} ("), err
    assert err.endswith("); remove or replace it") and "BytesIO" not in err and ".cpp:" not in err


def test_the_same_command_runs_once_the_image_is_replaced(tmp_path, capsys):
    """The stopped run saved no checkpoint: it does not own the folder against the same command."""
    root = write_jpeg_tree(tmp_path / "imgs", per_class=4, val_per_class=2, side=40)
    name = _damage(root, "truncated")
    with pytest.raises(SystemExit):
        _main(root, tmp_path / "out", "cpu", 0)
    assert json.loads((tmp_path / "out" / "checkpoints" / "run.json").read_text())["holder"] is None  # released
    (root / name).write_bytes((root / "train" / "c1" / "0.jpg").read_bytes())
    summary = _main(root, tmp_path / "out", "cpu", 0)
    assert summary["steps"] == 1 and summary["stops"]["attempts"] == 1  # the failed launch was another run's


def test_a_folder_without_checkpoints_is_held_only_while_its_run_runs(tmp_path):
    """The rule: a folder whose runs left no checkpoint is free, whatever they did (failed, finished, killed);
    one a live run holds is refused until that run ends or dies; one holding checkpoints needs --resume auto."""
    import socket
    import subprocess
    import sys

    import torch

    from ddp_recipes.checkpointing.run_folder import ownership

    folder = tmp_path / "checkpoints"
    folder.mkdir()
    ownership.claim(folder, "aaaaaaaaaaaa")  # held by this process, whose earlier fit is over: free
    ownership.refuse_live(ownership.output_survey(tmp_path))
    ownership.refuse_new_run(ownership.output_survey(tmp_path))
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        record = json.loads((folder / "run.json").read_text())
        record["holder"] = {"host": socket.gethostname(), "pid": other.pid, "at": 2.0}
        (folder / "run.json").write_text(json.dumps(record))
        with pytest.raises(ownership.CheckpointError, match="is held by run aaaaaaaaaaaa, running now"):
            ownership.refuse_live(ownership.output_survey(tmp_path))
        with pytest.raises(ownership.CheckpointError, match="is held by run aaaaaaaaaaaa, running now"):
            ownership.claim(folder, "bbbbbbbbbbbb", free=True)
        # its fit ended (an error, Ctrl+C, a finish), which released the record: it holds nothing, though it runs
        (folder / "run.json").write_text(json.dumps({**record, "holder": None}))
        ownership.refuse_live(ownership.output_survey(tmp_path))
        (folder / "run.json").write_text(json.dumps(record))
        with pytest.raises(ownership.CheckpointError, match="running now"):
            ownership.refuse_live(ownership.output_survey(tmp_path))
    finally:
        other.kill()
        other.wait()
    ownership.refuse_live(ownership.output_survey(tmp_path))  # killed: it holds nothing
    ownership.claim(folder, "bbbbbbbbbbbb", free=True)  # taken over; its record kept
    assert json.loads((folder / "run.json").read_text())["run_id"] == "bbbbbbbbbbbb"
    assert json.loads((folder / "run-aaaaaaaaaaaa.json").read_text())["run_id"] == "aaaaaaaaaaaa"
    torch.save({"state_dict": {}, "global_step": 3, "epoch": 0, "ddp_recipes_run": {"run_id": "bbbbbbbbbbbb"}},
               folder / "last.ckpt")
    with pytest.raises(ownership.CheckpointError, match="holds run bbbbbbbbbbbb .last.ckpt at step 3"):
        ownership.refuse_new_run(ownership.output_survey(tmp_path))


def test_named_loader_and_describe(tmp_path):
    bad = tmp_path / "train" / "x.jpg"
    bad.parent.mkdir()
    bad.write_bytes(b"\xff\xd8 cut")
    with pytest.raises(UnreadableImage) as raised:
        named_loader(str(bad), root=str(tmp_path))
    assert describe(raised.value).startswith("train/x.jpg (")
    worker = UnreadableImage("Caught UnreadableImage in DataLoader worker process 0.\nOriginal Traceback ...\n"
                             "ddp_recipes.data.unreadable.UnreadableImage: train/x.jpg (cannot identify image file)")
    assert describe(worker) == "train/x.jpg (cannot identify image file)"
    assert describe(OSError("disk")) is None
