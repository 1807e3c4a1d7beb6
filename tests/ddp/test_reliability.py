"""Reliability: a killed or silent rank ends the run within --timeout-s with a clear message and the rerun
resumes exactly; torchrun restarts a crashed rank and the run resumes on its own; a save killed midway keeps
the previous checkpoint; two one-process "nodes" train exactly like --devices 2; and >= 20 kinds of bad input
fail with one line naming the flag, without touching existing files.

Faults are injected by tests/scenarios/reliability_scenarios.py (environment variables, so every rank sees them).
Multi-process runs use ResNet-18 on 16 px synthetic images (or the shared mini-MNIST), 1 thread per rank.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ddp_recipes.bench import __main__ as bench
from ddp_recipes.checkpointing import checkpoint as ckpt_io
from ddp_recipes.ddp.failures import (
    CHILD_GRACE_S,
    PEER_FAILURE_PREFIX,
    init_failure_hint,
    is_peer_failure,
    restarts_share_store,
    stop_processes,
)
from ddp_recipes.ddp.strategy import TunedDDPStrategy
from recipes import mnist, resnet
from tests.helpers import SHARED_DATA, assert_same_weights, free_port, write_mnist_subset
from tests.launch import run, start
from tests.marks import HAVE_MNIST, needs_mnist

ROOT = Path(__file__).resolve().parents[2]
SCENARIO = ROOT / "tests" / "scenarios" / "reliability_scenarios.py"

TIMEOUT_S = 20  # --timeout-s of the multi-process runs: short, yet above a loaded machine's start-up skew
# 64 images, 2 ranks x batch 16: 2 steps per epoch, a checkpoint at every epoch end (steps 2 and 4).
# Constant LR (--no-cosine) so the schedule does not depend on the run length.
RESNET = ["--accelerator", "cpu", "--data", "synthetic", "--image-size", "16", "--synthetic-samples", "64",
          "--synthetic-val-samples", "0", "--batch-size", "16", "--lr", "0.05", "--no-cosine",
          "--max-steps", "4", "--checkpoint-every-n-steps", "2", "--timeout-s", str(TIMEOUT_S)]
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR",
               "MASTER_PORT")


# This environment minus launcher and fault variables (MASTER_PORT only where a test asks for a free one),
# one thread per rank (identical math everywhere); stdout+stderr go to one log file.
CLEAN = dict(drop=LAUNCH_VARS, drop_prefixes=("TORCHELASTIC_", "REL_", "SLURM_"), threads=1, port=False)


def run_logged(args: list[str], log: Path, timeout: float = 300, port: bool = False, **env: str) -> tuple[int, str]:
    """``python <args>`` to the end, output in ``log``: (exit code, the log's text)."""
    done = run(args, log=log, timeout=timeout, env=env, **{**CLEAN, "port": port})
    return done.returncode, done.stdout


def gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"  # a zombie counts as gone
    except (FileNotFoundError, ProcessLookupError):
        return True


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory) -> Path:
    """The uninterrupted 4-step run on 2 Lightning-launched ranks: what every interrupted run must end at."""
    out = tmp_path_factory.mktemp("straight")
    code, log = run_logged(["-m", "recipes.resnet", *RESNET, "--devices", "2", "--output-dir", str(out)],
                           out / "log.txt", port=True)
    assert code == 0, log[-3000:]
    return out / "checkpoints" / "last.ckpt"


# ---- a rank dies -------------------------------------------------------------------------------------


@pytest.mark.slow  # over 30 s: the fast suite keeps its 10-minute budget
def test_killed_rank_ends_the_run_and_resume_auto_matches(straight_run, tmp_path):
    """SIGKILL rank 1 during step 3 (last checkpoint: step 2): rank 0 exits non-zero within the timeout
    saying a peer was lost; the rerun with --resume auto ends with the uninterrupted run's weights."""
    out = tmp_path / "out"
    cmd = [SCENARIO, "resnet", *RESNET, "--devices", "2", "--output-dir", str(out)]
    log = tmp_path / "killed.txt"
    proc = start(cmd, log=log, env=dict(REL_FAULT="stop", REL_STEP="3", REL_DIR=str(tmp_path)),
                 **{**CLEAN, "port": True})
    pid = int(proc.wait_for_file(tmp_path / "rank1.pid").split()[0])
    assert "LOCAL_RANK=1" in Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
    assert pid != proc.pid  # Lightning's child process, not the launcher (rank 0)

    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    code = proc.wait(TIMEOUT_S + 30, stalled=f"rank 0 still running {TIMEOUT_S + 30} s after rank 1 was killed")
    elapsed = time.monotonic() - killed
    text = log.read_text()
    assert code != 0 and elapsed < TIMEOUT_S, (code, elapsed)
    # Either rank 0 saw the closed connection first (our line), or Lightning's child watcher did (its line).
    assert PEER_FAILURE_PREFIX in text or "terminated with code -9" in text, text[-3000:]
    last = out / "checkpoints" / "last.ckpt"
    assert torch.load(last, map_location="cpu", weights_only=False)["global_step"] == 2

    code, text = run_logged(["-m", "recipes.resnet", *RESNET, "--devices", "2", "--resume", "auto",
                             "--output-dir", str(out)], tmp_path / "resumed.txt", port=True)
    assert code == 0, text[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["resumed_from"] == str(last)
    assert_same_weights(last, straight_run)


@pytest.mark.slow  # waits out a collective timeout; the fast set kills a rank instead
@needs_mnist
def test_silent_rank_fails_the_run_within_the_timeout(tmp_path):
    """Rank 1 stops calling collectives (sleeps): rank 0's all-reduce times out after --timeout-s, it exits
    with the explanation, and the launcher does not leave the silent rank behind."""
    timeout = 15
    cmd = [SCENARIO, "mnist", "--accelerator", "cpu", "--data-dir", str(SHARED_DATA),
           "--no-download", "--devices", "2", "--max-steps", "6", "--timeout-s", str(timeout),
           "--output-dir", str(tmp_path / "out")]
    log = tmp_path / "log.txt"
    proc = start(cmd, log=log, env=dict(REL_FAULT="stop", REL_STEP="2", REL_WAIT_S="300", REL_DIR=str(tmp_path)),
                 **{**CLEAN, "port": True})
    pid, stopped_at = proc.wait_for_file(tmp_path / "rank1.pid").split()
    # past the limit the whole tree goes, the silent rank with it
    code = proc.wait(timeout + 60, stalled=f"rank 0 still waiting {timeout + 60} s after rank 1 went silent")
    elapsed = time.time() - float(stopped_at)
    text = log.read_text()
    assert code != 0, text[-3000:]
    assert timeout - 2 < elapsed < timeout + CHILD_GRACE_S + 25, elapsed  # the timeout fired, nothing else
    # The hang report came first (the automatic bound is under half the timeout) and the timeout's line points at it.
    assert "DDP hang: " in text and "rank 1 is in " in text, text[-3000:]
    assert (f"{PEER_FAILURE_PREFIX} (process-group timeout {timeout} s, --timeout-s; the hang report's stacks: "
            f"{tmp_path / 'out' / 'stall-reports'})") in text
    assert "Timed out waiting" in text  # gloo's own error stays attached
    assert f"local rank 1 (pid {pid}) still running" in text
    assert gone(int(pid))
    assert not (tmp_path / "out" / "summary.json").exists()


# ---- torchrun restarts ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_torchrun_restarts_a_crashed_rank_and_the_run_resumes(straight_run, tmp_path):
    """Rank 1 exits 1 once at step 3; torchrun --max-restarts 1 restarts both ranks, which take last.ckpt
    (step 2) through --resume auto, and the run ends with the uninterrupted run's weights."""
    out, marker = tmp_path / "out", tmp_path / "crashed"
    cmd = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "1", SCENARIO, "resnet", *RESNET, "--resume", "auto", "--output-dir", str(out)]
    # The shared rendezvous store keeps the dead attempt's addresses (pytorch/pytorch#135712): opt out of it.
    code, text = run_logged(cmd, tmp_path / "log.txt", timeout=400, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
                            REL_FAULT="crash", REL_STEP="3", REL_MARKER=str(marker))
    assert code == 0, text[-4000:]
    assert marker.exists() and "rank 1 crashes at step 3" in text
    assert text.count("Restored all states from the checkpoint") == 1  # rank 0 of the second attempt says it
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["resumed_from"] == str(out / "checkpoints" / "last.ckpt")
    assert_same_weights(out / "checkpoints" / "last.ckpt", straight_run)


def test_restart_on_a_shared_store_is_named_with_its_fix(monkeypatch):
    agent = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "1"}
    assert restarts_share_store(agent)
    assert not restarts_share_store({**agent, "TORCHELASTIC_MAX_RESTARTS": "0"})
    assert not restarts_share_store({**agent, "TORCHELASTIC_USE_AGENT_STORE": "False"})  # the opt-out above
    assert not restarts_share_store({})

    refused = RuntimeError("Gloo connectFullMesh failed with [pair.cc:152] timed out connecting: Connection refused")
    for name, value in {**agent, "TORCHELASTIC_RESTART_COUNT": "1"}.items():
        monkeypatch.setenv(name, value)
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in init_failure_hint(refused)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")  # the first attempt: nothing stale yet
    assert init_failure_hint(refused) is None
    late = torch.distributed.DistStoreError("Timed out after 6 seconds waiting for clients. 1/2 clients joined.")
    assert "NODE_RANK" in init_failure_hint(late)


@needs_mnist
@pytest.mark.slow
def test_missing_node_fails_the_rendezvous_within_the_timeout(tmp_path):
    """Node 0 of --num-nodes 2 started alone: it fails after --timeout-s, saying what to check."""
    started = time.monotonic()
    code, text = run_logged(["-m", "recipes.mnist", "--accelerator", "cpu", "--data-dir", str(SHARED_DATA),
                             "--no-download", "--num-nodes", "2", "--max-steps", "2", "--timeout-s", "5",
                             "--output-dir", str(tmp_path / "out")], tmp_path / "log.txt", timeout=120, port=True,
                            MASTER_ADDR="127.0.0.1", NODE_RANK="0")
    assert code != 0 and time.monotonic() - started < 60, text[-3000:]
    assert "DDP: not every rank reached the rendezvous" in text and "1/2 clients joined" in text


# ---- hangs become errors: the pieces -------------------------------------------------------------------


NCCL_VARS = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING", "NCCL_DEBUG", "TORCH_FR_BUFFER_SIZE",
             "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT")


def test_nccl_async_error_handling_is_left_to_torch(monkeypatch):
    """torch's default (3) stays: the pack exports no TORCH_NCCL_ASYNC_ERROR_HANDLING (issue #20, item 6)."""
    monkeypatch.setattr("lightning.pytorch.strategies.DDPStrategy.setup_environment", lambda self: None)
    monkeypatch.setattr("lightning.pytorch.strategies.DDPStrategy.teardown", lambda self: None)
    for name in NCCL_VARS:
        monkeypatch.delenv(name, raising=False)
    strategy = TunedDDPStrategy(nccl_debug="WARN", process_group_backend="nccl")
    strategy.setup_environment()
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in os.environ and os.environ["NCCL_DEBUG"] == "WARN"
    assert os.environ["TORCH_FR_BUFFER_SIZE"] == "2000" and os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    strategy.teardown()  # the process leaves as it came: nothing of ours is left in its environment
    assert not [name for name in NCCL_VARS if name in os.environ]

    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "50")  # the flight recorder's old name
    strategy = TunedDDPStrategy(process_group_backend="nccl")
    strategy.setup_environment()
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3" and "TORCH_FR_BUFFER_SIZE" not in os.environ
    strategy.teardown()
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"  # the user's own value stays

    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING")
    monkeypatch.setenv("NCCL_ASYNC_ERROR_HANDLING", "0")  # the old name: also the user's, and left alone
    TunedDDPStrategy(process_group_backend="nccl").setup_environment()
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in os.environ and os.environ["NCCL_ASYNC_ERROR_HANDLING"] == "0"


def test_gloo_exports_no_nccl_variables(monkeypatch):
    monkeypatch.setattr("lightning.pytorch.strategies.DDPStrategy.setup_environment", lambda self: None)
    for name in NCCL_VARS:
        monkeypatch.delenv(name, raising=False)
    before = dict(os.environ)
    TunedDDPStrategy(nccl_debug="INFO", process_group_backend="gloo").setup_environment()
    assert dict(os.environ) == before


def test_timeout_reaches_the_process_group():
    assert TunedDDPStrategy(timeout=7.5)._timeout.total_seconds() == 7.5
    from ddp_recipes import build_trainer

    trainer = build_trainer(devices=2, accelerator="cpu", timeout_s=12, logger=False)
    assert trainer.strategy._timeout.total_seconds() == 12


@pytest.mark.parametrize(("message", "peer"), [
    ("[pair.cc:561] Connection closed by peer [127.0.0.1]:39829. This is typically caused by a remote worker", True),
    ("[pair.cc:545] Read error [127.0.0.1]:33441: Connection reset by peer", True),
    ("[unbound_buffer.cc:78] Timed out waiting 10000ms for recv operation to complete", True),
    ("[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5, OpType=ALLREDUCE)", True),
    ("DataLoader timed out after 10 seconds", False),
    ("CUDA out of memory. Tried to allocate 2.00 GiB", False),
])
def test_peer_failures_get_one_explaining_line(message, peer, capsys):
    strategy = TunedDDPStrategy(timeout=20)
    err = RuntimeError(message)
    assert is_peer_failure(err) is peer
    strategy.on_exception(err)
    assert str(err).startswith(PEER_FAILURE_PREFIX) is peer
    assert str(err).endswith(message)  # the original error stays attached
    printed = capsys.readouterr().err
    if peer:
        assert "process-group timeout 20 s, --timeout-s" in printed and "--resume auto" in printed
    else:
        assert printed == ""


def test_failed_launcher_stops_the_ranks_still_running():
    quick = subprocess.Popen([sys.executable, "-c", "pass"])
    stuck = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    started = time.monotonic()
    stop_processes([quick, stuck], grace_s=1.0)
    assert quick.returncode == 0 and stuck.returncode == -signal.SIGKILL
    assert time.monotonic() - started < 10


# ---- checkpoints survive a kill mid-save ---------------------------------------------------------------


def test_save_killed_midway_keeps_the_previous_checkpoint(tmp_path):
    target = tmp_path / "last.ckpt"
    previous = {"state_dict": {"w": torch.full((4 << 20,), 1.0)}, "step": 1}
    ckpt_io.AtomicCheckpointIO().save_checkpoint(previous, target)
    before = target.read_bytes()

    ready = tmp_path / "ready"
    proc = start([SCENARIO, "slow-save", target, ready], log=tmp_path / "log.txt", **CLEAN)
    written = int(proc.wait_for_file(ready, timeout=120))
    temps = list(tmp_path.glob(".last.ckpt.tmp-*"))
    assert written > 1 << 20 and [t.name for t in temps] == [f".last.ckpt.tmp-{proc.pid}"]
    assert temps[0].stat().st_size >= 1 << 20  # the new checkpoint was half on disk ...
    proc.signal(signal.SIGKILL)
    proc.wait(30)

    assert target.read_bytes() == before  # ... and the old one is untouched and loads
    loaded = ckpt_io.read_checkpoint(str(target))
    assert loaded["step"] == 1 and torch.equal(loaded["state_dict"]["w"], previous["state_dict"]["w"])
    assert temps[0].exists()  # a killed process cannot clean up; the next save does
    ckpt_io.AtomicCheckpointIO().save_checkpoint({"state_dict": {}, "step": 3}, target)
    assert list(tmp_path.glob(".last.ckpt.tmp-*")) == []
    assert ckpt_io.read_checkpoint(str(target))["step"] == 3


def test_failed_save_removes_its_temp_file_and_keeps_the_old_one(tmp_path):
    target = tmp_path / "last.ckpt"
    ckpt_io.AtomicCheckpointIO().save_checkpoint({"state_dict": {}, "step": 1}, target)
    before = target.read_bytes()
    with pytest.raises(Exception, match="pickle|lambda"):
        ckpt_io.AtomicCheckpointIO().save_checkpoint({"state_dict": {}, "bad": lambda: None}, target)
    assert target.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


# ---- two nodes on one machine ----------------------------------------------------------------------------


@pytest.mark.slow  # two torchrun agents; one-node torchrun is in the fast set
@needs_mnist
def test_two_torchrun_nodes_train_exactly_like_two_devices(tmp_path):
    common = ["-m", "recipes.mnist", "--accelerator", "cpu", "--data-dir", str(SHARED_DATA), "--no-download",
              "--max-steps", "20", "--batch-size", "32", "--timeout-s", "60"]
    port = str(free_port())
    nodes = [start(["-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(rank),
                    "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", port, *common,
                    "--output-dir", str(tmp_path / "nodes")], log=tmp_path / f"node{rank}.txt", **CLEAN)
             for rank in (0, 1)]
    code, text = run_logged([*common, "--devices", "2", "--output-dir", str(tmp_path / "devices")],
                            tmp_path / "devices.txt", port=True)
    assert code == 0, text[-3000:]
    for rank, node in enumerate(nodes):
        assert node.wait(300) == 0, (tmp_path / f"node{rank}.txt").read_text()[-3000:]

    by_nodes = json.loads((tmp_path / "nodes" / "summary.json").read_text())
    by_devices = json.loads((tmp_path / "devices" / "summary.json").read_text())
    assert (by_nodes["num_nodes"], by_nodes["devices_per_node"], by_nodes["world_size"]) == (2, 1, 2)
    assert (by_devices["num_nodes"], by_devices["devices_per_node"]) == (1, 2)
    assert by_nodes["steps"] == by_devices["steps"] == 20
    assert by_nodes["test_acc"] == by_devices["test_acc"]
    assert_same_weights(tmp_path / "nodes" / "final.ckpt", tmp_path / "devices" / "final.ckpt")


# ---- bad input: one line naming the flag and the fix, non-zero exit, no file overwritten ----------------

# (id, program, arguments, substrings of the error line). Placeholders are filled by the `bad` fixture.
BAD_INPUT = [
    ("unknown-precision", "mnist", "--precision fp8", ["--precision must be one of", "bf16-mixed", "(got 'fp8')"]),
    ("unknown-flag", "resnet", "--epochs 3", ["unrecognized arguments: --epochs"]),
    ("zero-devices", "mnist", "--devices 0", ["--devices must be >= 1"]),
    ("zero-max-steps", "resnet", "--max-steps 0", ["--max-steps", "-1 for no limit"]),
    ("zero-timeout", "mnist", "--timeout-s 0", ["--timeout-s must be > 0"]),
    ("global-batch-vs-world", "mnist", "--devices 3 --global-batch-size 100",
     ["--global-batch-size 100", "world size x accumulation = 3 x 1", "multiple of 3"]),
    ("global-batch-vs-accumulation", "mnist", "--devices 2 --accumulate-grad-batches 3 --global-batch-size 100",
     ["--global-batch-size 100", "2 x 3", "multiple of 6"]),
    ("global-batch-vs-batch-size", "resnet", "--devices 2 --batch-size 4 --global-batch-size 100",
     ["--global-batch-size 100", "--batch-size x world size = 4 x 2", "multiple of 8"]),
    ("cuda-on-cpu-box", "resnet", "--accelerator cuda --devices 2", ["--accelerator cuda", "use --accelerator cpu"]),
    ("devices-vs-torchrun", "mnist", "--devices 3 [torchrun env: 2 per node]", ["--devices 3", "drop --devices"]),
    ("nodes-without-master", "mnist", "--num-nodes 2 [no MASTER_ADDR]", ["--num-nodes 2", "MASTER_ADDR", "torchrun"]),
    ("node-rank-too-big", "mnist", "--num-nodes 2 [MASTER_ADDR set, NODE_RANK=2]", ["NODE_RANK=2", "0..1"]),
    ("mnist-missing", "mnist", "--data-dir {missing} --no-download", ["--data-dir", "MNIST not found"]),
    ("mnist-empty", "mnist", "--data-dir {empty} --no-download", ["--data-dir", "MNIST not found"]),
    ("mnist-corrupt", "mnist", "--data-dir {corrupt_mnist} --no-download", ["--data-dir", "corrupt", "truncated"]),
    ("val-size-too-big", "mnist", "--data-dir {small_mnist} --no-download --val-size 500",
     ["--val-size 500", "no training data"]),
    ("output-dir-not-writable", "mnist", "--output-dir {file}/sub", ["--output-dir", "not writable"]),
    ("resnet-output-dir-not-writable", "resnet", "--output-dir {file}/sub", ["--output-dir", "not writable"]),
    ("imagefolder-missing", "resnet", "--data imagefolder --data-dir {missing}", ["--data-dir", "train", "val"]),
    ("imagefolder-no-classes", "resnet", "--data imagefolder --data-dir {no_classes}",
     ["--data-dir", "class folder"]),
    ("imagefolder-class-mismatch", "resnet", "--data imagefolder --data-dir {val_mismatch}",
     ["--data-dir", "val/ class folders differ", "missing in val: ['b']"]),
    ("imagefolder-one-class", "resnet", "--data imagefolder --data-dir {one_class}",
     ["--data-dir", "holds 1 class (a)", "a classifier needs 2 or more", "add a folder of images per class"]),
    ("imagefolder-empty-class", "resnet", "--data imagefolder --data-dir {empty_class}",
     ["--data-dir", "the class folder train/c holds no image file", "add images to it"]),
    ("imagefolder-too-small-for-ranks", "resnet", "--devices 5 --data imagefolder --data-dir {tree}",
     ["the validation set has 4 sample(s) for 5 ranks", "put at least 5 images in", "or use fewer --devices"]),
    ("imagefolder-corrupt-image", "resnet", "--data imagefolder --data-dir {corrupt_images} --max-steps 2",
     ["--data-dir", "cannot be decoded", "bad.png", "remove or replace"]),
    ("resume-missing", "resnet", "--resume {missing}/last.ckpt", ["--resume", "no such checkpoint file"]),
    ("resume-directory", "resnet", "--resume {empty}", ["--resume", "no such checkpoint file"]),
    ("resume-corrupt", "resnet", "--resume {corrupt_ckpt}", ["--resume", "cut or damaged checkpoint"]),
    ("resume-text-file", "resnet", "--resume {notes}", ["--resume", "is not a checkpoint file"]),
    ("resume-not-lightning", "resnet", "--resume {plain_ckpt}", ["--resume", "no state_dict"]),
    ("resume-another-model", "resnet", "--resume {lightning_ckpt}",
     ["--resume", "does not hold the network this run builds", "'net.'", "'model.'", "--resume none"]),
    ("resume-other-arch", "resnet", "--resume auto --arch resnet34", ["--arch resnet18", "--arch resnet34"]),
    ("resume-other-classes", "resnet", "--resume auto --num-classes 5", ["--num-classes 10", "--num-classes 5"]),
    ("stem-too-small", "resnet", "--image-size 8 --no-cifar-stem", ["--image-size", "--cifar-stem"]),
    ("bench-fp16-on-cpu", "bench", "--accelerator cpu --precision 16-mixed", ["--precision 16-mixed needs CUDA"]),
    ("bench-devices-without-1", "bench", "--devices 2,4", ["--devices must include 1"]),
    ("bench-devices-not-numbers", "bench", "--devices one,two", ["--devices", "comma list"]),
    ("bench-cuda-on-cpu-box", "bench", "--accelerator cuda", ["--accelerator cuda", "use --accelerator cpu"]),
    ("bench-out-not-writable", "bench", "--accelerator cpu --out {file}/sub", ["--out", "not writable"]),
    ("bench-mnist-missing", "bench", "--recipe mnist --accelerator cpu --data-dir {missing}",
     ["--data-dir", "no MNIST/raw"]),
    ("doctor-port-in-use", "doctor", "--devices 2 --accelerator cpu --master-port {busy_port}",
     ["FAIL: port", "is in use", "--master-port <free port>"]),
    ("doctor-nccl-on-cpu", "doctor", "--backend nccl --accelerator cpu", ["--backend nccl", "--backend gloo"]),
    ("doctor-bad-port", "doctor", "--master-port 70000", ["--master-port", "1..65535"]),
    ("doctor-cuda-on-cpu-box", "doctor", "--accelerator cuda", ["--accelerator cuda", "use --accelerator cpu"]),
]
NEEDS_NO_CUDA = {"cuda-on-cpu-box", "bench-cuda-on-cpu-box", "doctor-cuda-on-cpu-box"}
NEEDS_MNIST = {"mnist-corrupt", "val-size-too-big"}
MNIST_BASE = ["--accelerator", "cpu", "--max-steps", "2", "--data-dir", str(SHARED_DATA), "--no-download"]
RESNET_BASE = ["--accelerator", "cpu", "--data", "synthetic", "--image-size", "16", "--synthetic-samples", "8",
               "--synthetic-val-samples", "0", "--batch-size", "4", "--max-steps", "1", "--num-workers", "0"]
SENTINEL_SUMMARY = b'{"sentinel": "an earlier run\'s summary"}\n'


def _image_tree(root: Path, classes_val: tuple[str, ...] | None = None, corrupt: bool = False,
                classes: tuple[str, ...] = ("a", "b"), empty: str | None = None) -> Path:
    from PIL import Image

    for split, names in (("train", classes), ("val", classes_val or classes)):
        if empty:  # a class folder without a single image
            (root / split / empty).mkdir(parents=True)
        for i, name in enumerate(names):
            (root / split / name).mkdir(parents=True)
            for j in range(2):
                Image.new("RGB", (20, 20), (40 * i + 10 * j, 0, 0)).save(root / split / name / f"{j}.png")
    if corrupt:
        (root / "train" / "a" / "bad.png").write_bytes(b"not a png")
    return root


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, str]:
    """The files and folders the table's placeholders name (built once)."""
    base = tmp_path_factory.mktemp("inputs")
    (base / "empty").mkdir()
    (base / "file.txt").write_text("a regular file, so nothing can be created below it\n")
    (base / "no_classes" / "train").mkdir(parents=True)
    (base / "no_classes" / "val").mkdir()
    paths = {"missing": base / "missing", "empty": base / "empty", "file": base / "file.txt",
             "no_classes": base / "no_classes", "val_mismatch": _image_tree(base / "mismatch", classes_val=("a",)),
             "corrupt_images": _image_tree(base / "corrupt_images", corrupt=True),
             "one_class": _image_tree(base / "one_class", classes=("a",)),
             "empty_class": _image_tree(base / "empty_class", empty="c"),
             "tree": _image_tree(base / "tree")}  # 4 validation images
    if HAVE_MNIST:
        paths["small_mnist"] = write_mnist_subset(base / "small_mnist", n_train=300, n_test=100)
        corrupt = write_mnist_subset(base / "corrupt_mnist", n_train=300, n_test=100)
        images = corrupt / "MNIST" / "raw" / "train-images-idx3-ubyte"
        images.write_bytes(images.read_bytes()[:5000])
        paths["corrupt_mnist"] = corrupt
    real = {"state_dict": {"w": torch.zeros(3)}, "epoch": 0, "global_step": 1,
            "hyper_parameters": {"arch": "resnet18", "num_classes": 10, "cifar_stem": True}}
    torch.save(real, base / "resnet18.ckpt")
    (base / "corrupt.ckpt").write_bytes((base / "resnet18.ckpt").read_bytes()[:300])
    torch.save({"w": torch.zeros(3)}, base / "plain.ckpt")
    # what trainer.save_checkpoint writes for a user's own LightningModule: another network's names
    torch.save({"state_dict": {"net.1.weight": torch.zeros(8, 768), "net.1.bias": torch.zeros(8)}, "epoch": 0,
                "global_step": 1, "pytorch-lightning_version": "2.6.0"}, base / "lightning.ckpt")
    (base / "notes.txt").write_text("what I tried today\n" * 20)
    paths.update(resnet18_ckpt=base / "resnet18.ckpt", corrupt_ckpt=base / "corrupt.ckpt",
                 plain_ckpt=base / "plain.ckpt", notes=base / "notes.txt", lightning_ckpt=base / "lightning.ckpt")
    return {k: str(v) for k, v in paths.items()}


def _output_dir(tmp_path: Path, inputs: dict[str, str], checkpoint: bool) -> tuple[Path, dict[Path, bytes]]:
    """An output folder holding an earlier run's files; returns it and their bytes. With its ``checkpoint``
    only for a case that resumes: a new run into a folder that holds a checkpoint is refused before any other
    check that needs the run to start (tests/checkpointing/test_second_run.py), which would hide the input
    error tested."""
    out = tmp_path / "out"
    (out / "checkpoints").mkdir(parents=True)
    (out / "summary.json").write_bytes(SENTINEL_SUMMARY)
    (out / "final.ckpt").write_bytes(b"an earlier run's final weights")
    (out / "results.json").write_bytes(b'{"sentinel": "an earlier benchmark"}\n')
    if checkpoint:
        (out / "checkpoints" / "last.ckpt").write_bytes(Path(inputs["resnet18_ckpt"]).read_bytes())
    return out, {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}


def _table_row(program: str, template: str, line: str, names: dict[str, str]) -> None:
    # RELIABILITY_TABLE=path pytest ... writes docs/multi-node-and-failures.md's bad-input table from what the
    # CLIs really print.
    table = os.environ.get("RELIABILITY_TABLE")
    if table:
        command = {"doctor": "python -m ddp_recipes.doctor", "bench": "python -m ddp_recipes.bench"}.get(
            program, f"python -m recipes.{program}")
        for name, value in sorted(names.items(), key=lambda kv: -len(kv[1])):
            line = line.replace(value, "{" + name + "}")
        with open(table, "a") as fh:
            fh.write(f"| `{command} {template}` | `{line}` |\n")


@pytest.mark.parametrize(("case", "program", "template", "expected"), BAD_INPUT, ids=[c[0] for c in BAD_INPUT])
def test_bad_input_fails_in_one_line(case, program, template, expected, inputs, tmp_path, monkeypatch, capsys):
    if case in NEEDS_NO_CUDA and torch.cuda.is_available():
        pytest.skip("a CUDA device is visible")
    if (case in NEEDS_MNIST or program == "mnist") and not HAVE_MNIST:
        pytest.skip("shared mini-MNIST missing")
    for name in (*LAUNCH_VARS, "TORCHELASTIC_RUN_ID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    out, before = _output_dir(tmp_path, inputs, checkpoint="--resume" in template)
    shown = template.split(" [")[0]  # "[...]" notes describe the environment of the case
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        args = shown.format(busy_port=port, **inputs).split() if shown else []
        if "torchrun env" in template:
            monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
            monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
            monkeypatch.setenv("WORLD_SIZE", "2")
        if "MASTER_ADDR set" in template:
            monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
            monkeypatch.setenv("NODE_RANK", "2")

        if program == "doctor":  # a fresh process, as users run it (it spawns ranks when flags pass)
            proc = run(["-m", "ddp_recipes.doctor", *args], timeout=120, **CLEAN)
            code, output = proc.returncode, (proc.stdout + proc.stderr).strip()
        else:
            main, base = {"mnist": (mnist.main, MNIST_BASE), "resnet": (resnet.main, RESNET_BASE),
                          "bench": (bench.main, [])}[program]
            out_flag = "--out" if program == "bench" else "--output-dir"
            full = [*base, *([] if out_flag in args else [out_flag, str(out)]), *args]
            with pytest.raises(SystemExit) as exc:
                main(full)
            code, output = exc.value.code, capsys.readouterr().err.strip()
    line = output.splitlines()[-1]
    _table_row(program, template, line, {**inputs, "out": str(out), "busy_port": port})
    assert code == (1 if case == "doctor-port-in-use" else 2), output[-2000:]
    for part in expected:
        assert part in line, (part, line)
    assert "Traceback" not in output
    after = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert {p: after.get(p) for p in before} == before, "an earlier run's file was changed"


def test_remote_checkpoint_paths_go_to_the_object_store(tmp_path, monkeypatch):
    """s3://bucket/x.ckpt must not become a local folder named 's3:'; memory:// stands in for an object store
    (an object, then the manifest naming it: see tests/storage/test_cloud_storage.py for a real S3 API)."""
    from ddp_recipes.checkpointing.files import fetch

    monkeypatch.chdir(tmp_path)
    ckpt_io.AtomicCheckpointIO().save_checkpoint({"state_dict": {"w": torch.ones(2)}, "step": 5},
                                                 "memory://runs/x.ckpt")
    assert list(tmp_path.iterdir()) == []  # nothing written locally
    assert torch.load(fetch("memory://runs/x.ckpt"), weights_only=True)["step"] == 5
    ckpt_io.AtomicCheckpointIO().save_checkpoint({"state_dict": {}, "step": 6}, f"file://{tmp_path}/local.ckpt")
    assert torch.load(tmp_path / "local.ckpt", weights_only=True)["step"] == 6


def test_json_writes_go_through_the_same_atomic_path(tmp_path):
    """summary.json and the doctor's JSON use the checkpoints' writer: no temp left, a dead writer's temp removed."""
    from ddp_recipes.storage.store import write_json_atomic

    target = tmp_path / "summary.json"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / f".summary.json.tmp-{dead.pid}").write_text("{half")  # a writer killed mid-write
    write_json_atomic(target, {"b": 1, "a": Path("x")})
    assert json.loads(target.read_text()) == {"a": "x", "b": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]
