"""Spot VMs and Kubernetes: the node and its disk go away; the job comes back elsewhere and finds its
checkpoints only in the bucket. Against a real S3 API (moto's server on 127.0.0.1, s3fs as the client),
with test_resume's hard case (2 gloo ranks, random crops decoded in loader workers, dropout): the resumed
run starts on a "new node" (another working directory, an empty local cache) and must end with the
weights of the uninterrupted local run, bit for bit.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from tests.helpers import SHARED_DATA, assert_same_weights
from tests.launch import run, start
from tests.marks import needs_mnist
from tests.resume_scenario import (
    CAPTURED_STEP_LIMIT_S,
    RESNET,
    args,
)
from tests.s3server import object_upload

pytestmark = pytest.mark.slow


def manifest(s3, bucket: str) -> dict:
    try:
        body = s3.client().get_object(Bucket=bucket, Key="run/checkpoints/last.ckpt.manifest.json")["Body"].read()
    except Exception:  # not written yet
        return {}
    return json.loads(body)


def node(tmp_path: Path, name: str, s3) -> dict:
    """A fresh node's working directory and local cache (its files are checked to stay empty of run output)."""
    work = tmp_path / name
    (work / "cache").mkdir(parents=True)
    return {"cwd": work, "env": {**s3.env, "DDP_RECIPES_CACHE_DIR": str(work / "cache")}}


def final_weights(s3, bucket: str, tmp_path: Path) -> Path:
    """The bucket's last.ckpt, downloaded by the test itself (boto3, not the pack's reader)."""
    entry = manifest(s3, bucket)
    local = tmp_path / f"{bucket}-last.ckpt"
    s3.client().download_file(bucket, f"run/checkpoints/{entry['object']}", str(local))
    return local


def leftovers(work: Path) -> list[Path]:
    return [p for p in work.rglob("*") if p.is_file()]


def test_sigterm_mid_epoch_then_resume_auto_from_the_bucket_on_a_new_node_is_exact(
        s3, images, straight, tmp_path):
    bucket = "spot"
    out = s3.bucket(bucket) + "/run"
    argv = [*RESNET, *args(images, 2, "--max-epochs", "2", "--checkpoint-every-n-steps", "2"), "--output-dir", out]
    first = node(tmp_path, "node-a", s3)
    proc = start(argv, **first)
    proc.wait_until(lambda: manifest(s3, bucket).get("global_step", -1) >= 2, CAPTURED_STEP_LIMIT_S,
                    "a checkpoint at step 2 in the bucket", poll_s=0.2)
    proc.signal(signal.SIGTERM)  # the kubelet signals the container's main process
    done = proc.finish(timeout=180)
    assert done.returncode == 128 + signal.SIGTERM, done.stderr[-3000:]
    said = [line for line in done.stderr.splitlines() if line.startswith("preempted by SIGTERM")]
    assert len(said) == 1 and f"{out}/checkpoints/last.ckpt" in said[0] and "Traceback" not in done.stderr
    step = manifest(s3, bucket)["global_step"]
    assert 2 <= step < 6  # mid-epoch (6 steps per epoch)

    second = node(tmp_path, "node-b", s3)
    resumed = run([*argv, "--resume", "auto"], timeout=600, check=True, **second)
    assert (f"Restoring states from the checkpoint path at {out}/checkpoints/last.ckpt"
            in resumed.stdout + resumed.stderr)
    assert manifest(s3, bucket)["global_step"] == 12
    assert_same_weights(straight(2), final_weights(s3, bucket, tmp_path))
    assert leftovers(first["cwd"]) == [] and leftovers(second["cwd"]) == []  # all of it went to the bucket
    keys = s3.keys(bucket)
    assert "run/summary.json" in keys and "run/checkpoints/best.ckpt.manifest.json" in keys
    assert len([k for k in keys if "/objects/" in k]) == 2  # last and best: replaced objects are deleted


MNIST = ["-m", "recipes.mnist", "--accelerator", "cpu", "--data-dir", str(SHARED_DATA), "--no-download",
         "--devices", "1", "--max-steps", "8", "--checkpoint-every-n-steps", "1", "--no-diagnostics"]


@needs_mnist
def test_an_upload_killed_mid_write_resumes_from_the_previous_complete_checkpoint(s3, tmp_path):
    """The server holds the step-3 upload after half its body and the node goes away (SIGKILL): the bucket
    still says step 2, ``--resume auto`` takes it, and the run ends as the uninterrupted one."""
    from ddp_recipes.checkpointing.checkpoint import read_checkpoint
    from tests.helpers import newest_checkpoint

    run([*MNIST, "--output-dir", str(tmp_path / "straight")], timeout=600, check=True)
    bucket = "cut"
    out = s3.bucket(bucket) + "/run"
    held = s3.stall(lambda method, path: object_upload(method, path) and "/last-00000003-" in path)
    proc = start([*MNIST, "--output-dir", out], **node(tmp_path, "node-a", s3))
    proc.wait_until(held.is_set, CAPTURED_STEP_LIMIT_S, "the step-3 upload half sent", poll_s=0.2)
    proc.kill()  # the node goes away in the middle of the upload
    s3.reset_faults()
    assert manifest(s3, bucket)["global_step"] == 2
    assert not [k for k in s3.keys(bucket) if "/last-00000003-" in k]
    assert read_checkpoint(newest_checkpoint(out))["global_step"] == 2  # what --resume auto takes

    run([*MNIST, "--output-dir", out, "--resume", "auto"], timeout=600, check=True, **node(tmp_path, "node-b", s3))
    assert manifest(s3, bucket)["global_step"] == 8
    assert_same_weights(tmp_path / "straight" / "checkpoints" / "last.ckpt", final_weights(s3, bucket, tmp_path))
