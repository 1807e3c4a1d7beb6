"""CUDA code paths reached on CPU with fake devices (issue #20, items 6 and 8); tests/gpu/test_gpu_cuda_paths.py
runs them on real GPUs."""

from __future__ import annotations

import contextlib
import subprocess

import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision

from ddp_recipes.config.world import check_bf16_device, resolve_precision
from ddp_recipes.ddp.failures import PEER_FAILURE_PREFIX, stale_after
from ddp_recipes.ddp.strategy import TunedDDPStrategy
from ddp_recipes.errors import ConfigError
from tests.helpers import free_port
from tests.launch import start


def _fake_gpu(monkeypatch: pytest.MonkeyPatch, name: str, capability: tuple[int, int]) -> None:
    """A CUDA device as torch.cuda reports it, emulation counted as support (what torch does on a V100)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    props = type("Props", (), {"major": capability[0], "minor": capability[1], "name": name})()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    monkeypatch.setattr(torch.cuda, "_check_bf16_tensor_supported", lambda device: True)  # emulation "works"


def _no_cuda_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("the launching process called into CUDA")
    for name in ("is_bf16_supported", "current_device", "get_device_properties", "_lazy_init", "init"):
        monkeypatch.setattr(torch.cuda, name, refuse)


def test_resolving_bf16_in_the_launcher_does_not_touch_cuda(monkeypatch):
    _no_cuda_calls(monkeypatch)
    assert resolve_precision("bf16-mixed", "cuda") == "bf16-mixed"
    assert resolve_precision("16-mixed", "cuda") == "16-mixed"


@pytest.mark.parametrize(("name", "capability"), [("Tesla V100-SXM2-16GB", (7, 0)), ("Tesla T4", (7, 5))])
def test_emulated_bf16_is_refused_in_the_rank(monkeypatch, name, capability):
    _fake_gpu(monkeypatch, name, capability)
    assert torch.cuda.is_bf16_supported()  # torch's default answer: emulation counts
    with pytest.raises(ConfigError) as info:
        check_bf16_device("bf16-mixed", torch.device("cuda", 0))
    message = info.value.cli()
    assert message == (f"--precision bf16-mixed needs a GPU with bf16 (compute capability 8.0+, Ampere or newer); "
                       f"{name} is {capability[0]}.{capability[1]}: use --precision 16-mixed")


def test_real_bf16_and_other_precisions_pass(monkeypatch):
    _fake_gpu(monkeypatch, "NVIDIA A100-SXM4-80GB", (8, 0))
    check_bf16_device("bf16-mixed", torch.device("cuda", 0))
    _fake_gpu(monkeypatch, "Tesla V100-SXM2-16GB", (7, 0))
    check_bf16_device("16-mixed", torch.device("cuda", 0))
    check_bf16_device("32-true", torch.device("cuda", 0))
    check_bf16_device("bf16-mixed", torch.device("cpu"))  # CPU bf16 autocast needs no GPU


def test_strategy_checks_bf16_first_thing_in_the_rank(monkeypatch):
    _fake_gpu(monkeypatch, "Tesla V100-SXM2-16GB", (7, 0))
    strategy = TunedDDPStrategy(parallel_devices=[torch.device("cuda", 0)],
                                precision_plugin=MixedPrecision("bf16-mixed", "cuda"))
    with pytest.raises(ConfigError, match="use precision 16-mixed"):
        strategy.setup_environment()


def test_one_device_checks_bf16_in_its_rank_too(monkeypatch, restore_tf32):
    """One device runs Lightning's own strategy, not TunedDDPStrategy: the check must still run at set-up."""
    import lightning.fabric.accelerators.cuda as lightning_cuda
    from lightning.pytorch.strategies import SingleDeviceStrategy
    from lightning.pytorch.trainer import call

    from ddp_recipes.train.trainer import build_trainer

    _fake_gpu(monkeypatch, "Tesla V100-SXM2-16GB", (7, 0))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(lightning_cuda, "num_cuda_devices", lambda: 1)
    trainer = build_trainer(accelerator="cuda", devices=1, precision="bf16-mixed", logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    assert type(trainer.strategy) is SingleDeviceStrategy and trainer.strategy.root_device.type == "cuda"
    with pytest.raises(ConfigError, match="Tesla V100-SXM2-16GB is 7.0: use precision 16-mixed"):
        call._call_callback_hooks(trainer, "setup", stage="fit")


# ---- item 6: a lost peer on NCCL ends every rank with the pack's line ------------------------------------

def _run_pair(case: str) -> list[subprocess.CompletedProcess]:
    """Rank 0 and rank 1 of tests/scenarios/peerwatch_scenarios.py ``case``, each its own process, on one port."""
    port = free_port()
    procs = [start(["-m", "tests.scenarios.peerwatch_scenarios", case, rank], port=port,
                   env={"MASTER_ADDR": "127.0.0.1"}) for rank in (0, 1)]
    return [p.finish(timeout=120) for p in procs]


@pytest.mark.slow  # two processes importing Lightning: about a minute on a loaded machine
def test_a_dead_peer_ends_the_waiting_rank_with_the_pack_message():
    survivor, dead = _run_pair("die")
    assert dead.returncode == 3, dead.stderr[-2000:]
    assert survivor.returncode == 1, survivor.stderr[-2000:]
    assert "slept to the end" not in survivor.stdout  # ended by the watch, not by its own end
    lines = [line for line in survivor.stderr.splitlines() if PEER_FAILURE_PREFIX in line]
    assert len(lines) == 1 and lines[0].startswith("[rank 0] ") and "rank 1 silent for" in lines[0], survivor.stderr


@pytest.mark.slow
def test_a_peer_that_finishes_is_not_a_lost_one():
    first, finished = _run_pair("finish")
    assert finished.returncode == 0, finished.stderr[-2000:]
    assert first.returncode == 0 and "slept to the end" in first.stdout, first.stderr[-2000:]


@pytest.mark.slow  # a 3-rank run waiting out a heartbeat limit: make test-slow
@pytest.mark.parametrize("world", [3, 4])
def test_at_three_ranks_or_more_every_survivor_blames_the_dead_rank(world):
    """Rank 1 dies; its watcher is rank 0, which hosts the store. Every survivor must name rank 1, none find
    the store gone and blame rank 0 (rank 0 exits only once the others have read the news)."""
    port = free_port()
    procs = [start(["-m", "tests.scenarios.peerwatch_scenarios", "ring", rank, world], port=port, quiet=None,
                   env={"MASTER_ADDR": "127.0.0.1"}) for rank in range(world)]
    done = [p.finish(timeout=120) for p in procs]
    assert done[1].returncode == 3, done[1].stderr[-2000:]
    for rank, proc in enumerate(done):
        if rank == 1:
            continue
        lines = [line for line in proc.stderr.splitlines() if PEER_FAILURE_PREFIX in line]
        assert proc.returncode == 1 and "slept to the end" not in proc.stdout, proc.stderr[-2000:]
        assert len(lines) == 1 and lines[0].startswith(f"[rank {rank}] "), proc.stderr
        assert "rank 1 silent for" in lines[0] and "unreachable" not in lines[0], lines


def test_the_watch_runs_on_nccl_only():
    assert TunedDDPStrategy(process_group_backend="gloo").start_peer_watch() is None
    assert stale_after(None) == 120.0 and stale_after(1800) == 120.0 and stale_after(60) == 30.0
    assert stale_after(4) == 15.0  # never under three heartbeats
