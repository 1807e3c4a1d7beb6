"""What ``--resume auto`` continues: the newest complete checkpoint of the folder's own run, never another
run's whatever its step count, locally and on a bucket; a cut file is skipped with a warning."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from recipes import mnist
from tests.helpers import MNIST_CPU, assert_same_weights, last_ckpt, newest_checkpoint
from tests.marks import needs_mnist


@needs_mnist
def test_resume_auto_never_takes_another_runs_checkpoint(tmp_path):
    """Run A (more steps, a best.ckpt) and run B: A's best.ckpt copied into B's folder is skipped, whatever
    its step count; B continues from its own last.ckpt and ends as B never stopped."""
    a, b, straight = tmp_path / "a", tmp_path / "b", tmp_path / "straight"
    # A: 14 steps and a best.ckpt, more steps than B will have
    mnist.main([*MNIST_CPU, "--val-size", "1000", "--batch-size", "500", "--max-epochs", "1", "--output-dir", str(a)])
    mnist.main([*MNIST_CPU, "--max-steps", "4", "--lr", "0.05", "--output-dir", str(b)])
    mnist.main([*MNIST_CPU, "--max-steps", "8", "--lr", "0.05", "--output-dir", str(straight)])
    shutil.copy(a / "checkpoints" / "best.ckpt", b / "checkpoints" / "best.ckpt")
    with pytest.warns(UserWarning, match=r"--resume auto: skipping .*best\.ckpt \(best\.ckpt at step 14.*\): "
                                         r"it belongs to run [0-9a-f]{12}, not to this folder's run"):
        summary = mnist.main([*MNIST_CPU, "--max-steps", "8", "--lr", "0.05", "--output-dir", str(b), "--resume",
                              "auto"])
    assert summary["resumed_from"] == str(last_ckpt(b)) and summary["steps"] == 8
    assert_same_weights(last_ckpt(b), last_ckpt(straight))


@needs_mnist
def test_resume_auto_on_a_bucket_never_takes_another_runs_checkpoint(s3, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    client = s3.client()
    s3.bucket("mixed")
    a, b = "s3://mixed/a", "s3://mixed/b"
    mnist.main([*MNIST_CPU, "--val-size", "1000", "--batch-size", "500", "--max-epochs", "1", "--output-dir", a])
    mnist.main([*MNIST_CPU, "--max-steps", "4", "--output-dir", b])
    manifest = json.loads(client.get_object(Bucket="mixed", Key="a/checkpoints/best.ckpt.manifest.json")["Body"].read())
    for key in ("checkpoints/best.ckpt.manifest.json", f"checkpoints/{manifest['object']}"):
        client.copy_object(Bucket="mixed", Key=f"b/{key}", CopySource={"Bucket": "mixed", "Key": f"a/{key}"})
    with pytest.warns(UserWarning, match=r"skipping s3://mixed/b/checkpoints/best\.ckpt .*: it belongs to run"):
        summary = mnist.main([*MNIST_CPU, "--max-steps", "6", "--output-dir", b, "--resume", "auto"])
    assert summary["resumed_from"] == f"{b}/checkpoints/last.ckpt" and summary["steps"] == 6


def test_resume_auto_takes_the_newest_complete_checkpoint(tmp_path, capsys):
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    assert newest_checkpoint(tmp_path) is None
    for name, step in (("last.ckpt", 8), ("best.ckpt", 4)):
        torch.save({"state_dict": {}, "global_step": step, "epoch": 1}, folder / name)
    torch.save({"state_dict": {}, "global_step": 10, "epoch": 2}, tmp_path / "hpc_ckpt_1.ckpt")
    assert newest_checkpoint(tmp_path) == str(tmp_path / "hpc_ckpt_1.ckpt")
    whole = (tmp_path / "hpc_ckpt_1.ckpt").read_bytes()
    (tmp_path / "hpc_ckpt_2.ckpt").write_bytes(whole[: len(whole) // 2])  # a save cut short (not ours: Lightning's)
    (folder / ".last.ckpt.tmp-1").write_bytes(whole)  # an unfinished atomic save is never a candidate
    with pytest.warns(UserWarning, match=r"--resume auto: .*hpc_ckpt_2\.ckpt is a cut or damaged checkpoint .*; "
                                          r"continuing from hpc_ckpt_1\.ckpt at step 10"):
        assert newest_checkpoint(tmp_path) == str(tmp_path / "hpc_ckpt_1.ckpt")
