"""A file no decoder reads is named relative to --data-dir, with both decoders, in a loader worker and in the
training process; the run that stopped on it (before its first checkpoint) leaves the folder to the same
command once the file is replaced (issue #40.2, #40.3)."""

from __future__ import annotations

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
    assert (tmp_path / "out" / "checkpoints" / "run.json").exists()
    (root / name).write_bytes((root / "train" / "c1" / "0.jpg").read_bytes())
    summary = _main(root, tmp_path / "out", "cpu", 0)
    assert summary["steps"] == 1 and summary["stops"]["attempts"] == 1  # the failed launch was another run's


def test_only_a_run_that_failed_before_its_first_step_gives_up_the_folder(tmp_path):
    """No record of its end (killed: it may be training yet), a finished or preempted run, or one that trained:
    a new run is still refused there."""
    import json

    from ddp_recipes.checkpointing.run_folder import ownership

    folder = tmp_path / "checkpoints"
    folder.mkdir()
    ownership.claim(folder, "aaaaaaaaaaaa")
    (tmp_path / "attempts").mkdir()
    record = {"attempt": 1, "run_id": "aaaaaaaaaaaa", "started_at": 1.0, "ended": None}
    (tmp_path / "attempts" / "1.json").write_text(json.dumps(record))
    with pytest.raises(ownership.CheckpointError, match="holds run aaaaaaaaaaaa"):
        ownership.refuse_new_run(ownership.output_survey(tmp_path))
    for ended, step in (("finished", 3), ("error: RuntimeError", 3), ("preempted by SIGTERM", 0)):
        # it trained, or stopped cleanly: its checkpoints may have been moved away, its summary is still there
        (tmp_path / "attempts" / "1.json").write_text(json.dumps({**record, "ended": ended, "last_step": step}))
        with pytest.raises(ownership.CheckpointError, match="holds run aaaaaaaaaaaa"):
            ownership.refuse_new_run(ownership.output_survey(tmp_path))
    (tmp_path / "attempts" / "1.json").write_text(json.dumps({**record, "ended": "error: UnreadableImage",
                                                               "last_step": 0}))
    ownership.refuse_new_run(ownership.output_survey(tmp_path))  # failed before a step: the folder is free


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
