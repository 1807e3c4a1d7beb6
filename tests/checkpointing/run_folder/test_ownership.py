"""An output folder belongs to one run: a new run into a folder holding another run's checkpoints, or another
run's checkpoint given by path, is refused in one line, locally and on a bucket, and nothing there changes; a
folder whose checkpoints name several runs and no record is refused too."""

from __future__ import annotations

import json
import os

import pytest
import torch

from ddp_recipes.checkpointing.checkpoint import RUN_KEY
from ddp_recipes.checkpointing.run_folder import ownership
from ddp_recipes.checkpointing.run_folder.ownership import newest_of_run
from ddp_recipes.errors import ConfigError
from recipes import mnist
from tests.helpers import MNIST_CPU, files_of, last_ckpt, refused_mnist
from tests.marks import needs_mnist


@needs_mnist
def test_a_new_run_into_a_finished_runs_folder_is_refused_and_touches_nothing(tmp_path, capsys):
    out = tmp_path / "out"
    mnist.main([*MNIST_CPU, "--max-steps", "6", "--output-dir", str(out)])
    record = json.loads((out / "checkpoints" / "run.json").read_text())
    assert torch.load(last_ckpt(out), weights_only=True)[RUN_KEY] == {"run_id": record["run_id"]}
    before = files_of(out)
    capsys.readouterr()
    line = refused_mnist([*MNIST_CPU, "--max-steps", "2", "--output-dir", str(out)], capsys)
    assert f"--output-dir {out} holds run {record['run_id']} (last.ckpt at step 6" in line
    assert "continue it with --resume auto, or pass another --output-dir" in line
    assert files_of(out) == before  # last.ckpt, summary.json, run.json: byte for byte


@needs_mnist
def test_a_new_run_into_a_finished_runs_bucket_is_refused_and_touches_nothing(s3, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    out = s3.bucket("owned") + "/run"
    mnist.main([*MNIST_CPU, "--max-steps", "3", "--output-dir", out])
    keys = s3.keys("owned")
    bodies = {k: s3.client().get_object(Bucket="owned", Key=k)["Body"].read() for k in keys}
    manifest = json.loads(bodies["run/checkpoints/last.ckpt.manifest.json"])
    assert manifest["run_id"] == json.loads(bodies["run/checkpoints/run.json"])["run_id"]
    capsys.readouterr()
    line = refused_mnist([*MNIST_CPU, "--max-steps", "2", "--output-dir", out], capsys)
    assert f"holds run {manifest['run_id']} (last.ckpt at step 3" in line and "--resume auto" in line
    assert {k: s3.client().get_object(Bucket="owned", Key=k)["Body"].read() for k in s3.keys("owned")} == bodies


@needs_mnist
def test_another_runs_checkpoint_into_an_owned_folder_is_refused(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    mnist.main([*MNIST_CPU, "--max-steps", "2", "--output-dir", str(a)])
    mnist.main([*MNIST_CPU, "--max-steps", "2", "--output-dir", str(b)])
    before = files_of(b)
    capsys.readouterr()
    line = refused_mnist([*MNIST_CPU, "--max-steps", "4", "--output-dir", str(b), "--resume", str(last_ckpt(a))],
                         capsys)
    assert f"--output-dir {b} holds run" in line and "checkpoint: continuing it there would mix two runs" in line
    assert files_of(b) == before
    # Into a new folder it continues run A there (the same run id, so that folder is A's now).
    summary = mnist.main([*MNIST_CPU, "--max-steps", "4", "--output-dir", str(tmp_path / "c"), "--resume",
                          str(last_ckpt(a))])
    assert summary["steps"] == 4
    run_of = lambda out: json.loads((out / "checkpoints" / "run.json").read_text())["run_id"]  # noqa: E731
    assert run_of(tmp_path / "c") == run_of(a) != run_of(b)


def test_a_folder_with_several_runs_and_no_record_is_refused(tmp_path):
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    for name, step, run_id in (("last.ckpt", 4, "aaaaaaaaaaaa"), ("best.ckpt", 9, "bbbbbbbbbbbb")):
        torch.save({"state_dict": {}, "global_step": step, "epoch": 0, RUN_KEY: {"run_id": run_id}},
                   folder / name)
    found = ownership.survey(folder)
    with pytest.raises(ConfigError) as info:
        newest_of_run(found)
    text = info.value.cli()
    assert "holds the checkpoints of 2 runs (run bbbbbbbbbbbb (best.ckpt at step 9" in text
    assert "pass the one to continue with --resume PATH" in text
    ownership.claim(folder, "aaaaaaaaaaaa")  # a record decides: the recorded run's newest
    with pytest.warns(UserWarning, match="skipping .*best.ckpt"):
        assert newest_of_run(ownership.survey(folder)).name == "last.ckpt"
    with pytest.raises(ConfigError, match="was claimed by run aaaaaaaaaaaa"):
        ownership.claim(folder, "cccccccccccc")


def test_a_pid_reused_by_another_process_does_not_hold_the_folder(tmp_path):
    """run.json names its holder by host and pid; a container restarted on the same host (same hostname) hands
    out the same small pids again, so the pid may be alive as another process: that one does not hold the folder.
    The process that wrote the record does."""
    import socket
    import subprocess
    import sys

    code = ("import sys; from ddp_recipes.checkpointing.run_folder import ownership; "
            "ownership.claim(sys.argv[1], 'aaaaaaaaaaaa'); print('held', flush=True); sys.stdin.read()")
    holder = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    other = None
    try:
        assert holder.stdout.readline().strip() == "held"
        other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # a later process
        record = ownership.read_record(tmp_path)
        assert record["holder"]["pid"] == holder.pid and ownership.live_holder(record)
        # the holder was SIGKILLed; its pid now runs another program (here: another process's pid)
        reused = {**record, "holder": {**record["holder"], "pid": other.pid}}
        assert socket.gethostname() == reused["holder"]["host"] and not ownership.live_holder(reused)
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
        if other is not None:
            other.kill()
            other.wait()


def test_a_bucket_folders_record_is_released_at_the_end_of_its_fit(s3):
    """A bucket's run.json is claimed and released as a local one: held by this process while its fit runs (a
    second claim from a process that still runs is refused), holding nothing once released."""
    folder = s3.bucket("released") + "/run/checkpoints"
    ownership.claim(folder, "aaaaaaaaaaaa")
    record = ownership.read_record(ownership.location(folder))
    assert record["run_id"] == "aaaaaaaaaaaa" and record["holder"]["pid"] == os.getpid()
    ownership.release(folder, "aaaaaaaaaaaa")
    record = ownership.read_record(ownership.location(folder))
    assert record["run_id"] == "aaaaaaaaaaaa" and record["holder"] is None
