"""The run folder in one sentence, at 2 ranks: a folder whose runs left no checkpoint is free for any command; a
folder holding a run's checkpoints continues only with ``--resume auto``; a folder a live run holds is refused.

* a run held before its first save refuses a second launch into its folder while it lives; SIGKILLed, its
  folder is free for the next command with other flags, which keeps the dead run's record and attempt record;
* a run that stopped on an unreadable image (``--decode gpu``) leaves its folder to the next command with other
  flags once the image is replaced;
* a folder holding checkpoints, without ``--resume auto``, is refused in one line and nothing in it changes.
Locally and on a bucket (the tests' own S3 server)."""

from __future__ import annotations

import json

import pytest

from tests.helpers import MNIST_CPU, files_of, write_jpeg_tree
from tests.launch import run, start
from tests.marks import needs_mnist

HOLD = """
import sys
import time

from lightning.pytorch.callbacks import Callback

from tests.helpers import run_recipe_with


class Hold(Callback):
    def on_train_start(self, trainer, pl_module):
        time.sleep(600)  # held before the first step: SIGKILLed here, the run left no checkpoint


if __name__ == "__main__":
    run_recipe_with(Hold(), sys.argv[1:])
"""


def _folder(out: str, s3) -> dict[str, bytes]:
    """Every file of the run folder and its bytes (a bucket's objects under it)."""
    if s3 is None:
        from pathlib import Path

        return files_of(Path(out))
    bucket, prefix = out.removeprefix("s3://").split("/", 1)
    client = s3.client()
    found = {}
    for key in s3.keys(bucket, prefix):
        try:
            found[key] = client.get_object(Bucket=bucket, Key=key)["Body"].read()
        except client.exceptions.NoSuchKey:
            continue  # a live run's object removed between the listing and the read (CI saw one): not in the folder now
    return found


def _refused(result) -> str:
    lines = [line for line in result.stderr.strip().splitlines() if line]
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-3000:]
    return lines[0]


@needs_mnist
@pytest.mark.slow
@pytest.mark.parametrize("where", ["local", "bucket"])
def test_a_run_killed_before_its_first_save_leaves_its_folder_free(tmp_path, request, where):
    s3 = request.getfixturevalue("s3") if where == "bucket" else None
    out = s3.bucket("free") + "/run" if s3 else str(tmp_path / "out")
    record = "run/checkpoints/run.json" if s3 else "checkpoints/run.json"
    script = tmp_path / "hold.py"
    script.write_text(HOLD)
    env = {"DDP_RECIPES_CACHE_DIR": str(tmp_path / "cache")}  # the script finds tests/ on the repo's PYTHONPATH
    mnist = ["-m", "recipes.mnist", *MNIST_CPU, "--devices", "2", "--output-dir", out]
    held = start([script, "mnist", *MNIST_CPU, "--devices", "2", "--output-dir", out, "--max-steps", "50"],
                 cwd=tmp_path, env=env)
    try:
        attempt = record.replace("checkpoints/run.json", "attempts/1.json")
        held.wait_until(lambda: b"train_started_at" in _folder(out, s3).get(attempt, b""), timeout=300,
                        what="the held run at its training's start")  # it writes nothing more until killed
        first = json.loads(_folder(out, s3)[record])
        # A live run holds the folder: a second launch, any flags, is refused in one line and changes nothing.
        before = _folder(out, s3)
        line = _refused(run([*mnist, "--max-steps", "2", "--batch-size", "32"], cwd=tmp_path, env=env))
        assert f"is held by run {first['run_id']}, running now (pid {held.pid} on " in line, line
        assert _folder(out, s3) == before
    finally:
        held.kill()
    assert not any(k.endswith(".ckpt") or k.endswith(".manifest.json") for k in _folder(out, s3))
    kept = {k: v for k, v in _folder(out, s3).items() if "attempts/" in k}
    # Dead, it left no checkpoint: the next command runs there, with other flags, and keeps what it wrote.
    second = run([*mnist, "--max-steps", "2", "--batch-size", "32"], cwd=tmp_path, env=env)
    assert second.returncode == 0, second.stderr[-3000:]
    files = _folder(out, s3)
    now = json.loads(files[record])
    assert now["run_id"] != first["run_id"]
    assert json.loads(files[record.replace("run.json", f"run-{first['run_id']}.json")]) == first
    assert all(files[k] == v for k, v in kept.items())  # the dead run's attempt record, byte for byte
    # Now it holds checkpoints: without --resume auto, refused in one line naming the run; nothing changes.
    before = _folder(out, s3)
    line = _refused(run([*mnist, "--max-steps", "4"], cwd=tmp_path, env=env))
    assert f"holds run {now['run_id']} (last.ckpt at step 2" in line and "continue it with --resume auto" in line
    assert _folder(out, s3) == before


FAIL = HOLD.replace("class Hold", "class Fail").replace("Hold()", "Fail()").replace(
    """    def on_train_start(self, trainer, pl_module):
        time.sleep(600)  # held before the first step: SIGKILLed here, the run left no checkpoint""",
    """    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step >= 1:  # a bug after its first step, before any save
            raise RuntimeError("stopped before its first save")""")


@pytest.mark.slow
def test_two_rank_runs_stopped_before_their_first_save_leave_the_folder_to_other_flags(tmp_path):
    """A run that trained a step and failed, then one stopped by an unreadable image with ``--decode gpu``:
    neither saved, so the next command, with other flags, runs there."""
    root = write_jpeg_tree(tmp_path / "imgs", per_class=8, val_per_class=2, side=40)
    good = (root / "train" / "c1" / "0.jpg").read_bytes()
    out = tmp_path / "out"
    flags = ["--accelerator", "cpu", "--devices", "2", "--data", "imagefolder", "--data-dir", root, "--image-size",
             "32", "--num-workers", "0", "--max-steps", "3", "--logger", "none", "--output-dir", out]
    script = tmp_path / "fail.py"
    script.write_text(FAIL)
    failed = run([script, "resnet", *flags, "--batch-size", "2"], cwd=tmp_path)
    assert failed.returncode != 0 and "stopped before its first save" in failed.stderr, failed.stderr[-3000:]
    assert (out / "checkpoints" / "run.json").exists() and not list(out.rglob("*.ckpt"))
    (root / "train" / "c1" / "bad.jpg").write_bytes(b"notes, not an image\n" * 20)
    stopped = run(["-m", "recipes.resnet", *flags, "--batch-size", "9", "--decode", "gpu"], cwd=tmp_path)
    assert stopped.returncode == 2 and "holds an image that cannot be decoded: train/c1/bad.jpg" in stopped.stderr, \
        stopped.stderr[-3000:]
    assert not list(out.rglob("*.ckpt"))
    (root / "train" / "c1" / "bad.jpg").write_bytes(good)
    again = run(["-m", "recipes.resnet", *flags, "--batch-size", "4"], cwd=tmp_path)  # the CPU decoder, other batch
    assert again.returncode == 0, again.stderr[-3000:]
    assert (out / "checkpoints" / "last.ckpt").exists() and len(list((out / "checkpoints").glob("run-*.json"))) == 2
