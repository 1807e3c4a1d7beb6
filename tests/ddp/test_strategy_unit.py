"""TunedDDPStrategy as a drop-in DDPStrategy: registry names, arguments, defaults, SyncBN plugin swap."""

from __future__ import annotations

from datetime import timedelta

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.plugins.layer_sync import TorchSyncBatchNorm
from lightning.pytorch.strategies import DDPStrategy

from ddp_recipes import TunedDDPStrategy, build_trainer
from ddp_recipes.ddp.strategy import bucket_view_default
from ddp_recipes.ddp.syncbn import SyncBatchNormPlugin
from tests.helpers import raises_cli


def test_registry_names_work_like_lightnings():
    trainer = L.Trainer(strategy="tuned_ddp", accelerator="cpu", devices=2, logger=False)
    assert type(trainer.strategy) is TunedDDPStrategy and isinstance(trainer.strategy, DDPStrategy)
    assert "gradient_as_bucket_view" not in trainer.strategy._ddp_kwargs  # chosen per device at the DDP wrap
    trainer = L.Trainer(strategy="tuned_ddp_find_unused_parameters_true", accelerator="cpu", devices=2, logger=False)
    assert trainer.strategy._ddp_kwargs["find_unused_parameters"] is True


def test_ddp_arguments_lightning_sets_are_taken_at_their_default_only():
    """LightningCLI spells out DistributedDataParallel's defaults through **kwargs: those Lightning sets itself
    (device_mesh, process_group, output_device, device_ids) are dropped at None, refused at any other value."""
    strategy = TunedDDPStrategy(device_mesh=None, process_group=None, output_device=None, device_ids=None, dim=0)
    assert not {"device_mesh", "process_group", "output_device", "device_ids"} & set(strategy._ddp_kwargs)
    with raises_cli(ValueError, match="--process-group of DistributedDataParallel is set by Lightning's DDP wrap"):
        TunedDDPStrategy(process_group=object())


def test_ddpstrategy_arguments_pass_through():
    strategy = TunedDDPStrategy(process_group_backend="gloo", start_method="spawn", timeout=timedelta(seconds=7),
                                bucket_cap_mb=10, static_graph=True, broadcast_buffers=False)
    assert strategy.process_group_backend == "gloo" and strategy._start_method == "spawn"
    assert strategy._timeout == timedelta(seconds=7)
    assert strategy._ddp_kwargs == {"find_unused_parameters": False, "static_graph": True,
                                    "bucket_cap_mb": 10, "broadcast_buffers": False}
    assert TunedDDPStrategy(timeout=12)._timeout == timedelta(seconds=12)


def test_the_ddp_wrap_takes_bucket_views_on_cuda_only_unless_told(tmp_path):
    """Unset, ``gradient_as_bucket_view`` is True on CUDA and False on CPU (gloo, where it slows the step);
    a value the user gives reaches DistributedDataParallel on every device."""
    assert bucket_view_default(torch.device("cuda", 0)) is True and bucket_view_default(torch.device("cpu")) is False
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        for given, expected in ((None, False), (True, True), (False, False)):
            strategy = TunedDDPStrategy(gradient_as_bucket_view=given, parallel_devices=[torch.device("cpu")])
            assert strategy._setup_model(torch.nn.Linear(2, 2)).gradient_as_bucket_view is expected, given
    finally:
        dist.destroy_process_group()


def test_bad_arguments():
    with raises_cli(ValueError, match="--comm-hook"):
        TunedDDPStrategy(comm_hook="int8")
    with pytest.raises(ValueError, match="not both"):
        TunedDDPStrategy(comm_hook="fp16", ddp_comm_hook=lambda state, bucket: None)


def test_sync_batchnorm_flag_gets_the_cpu_capable_plugin():
    trainer = build_trainer(devices=2, accelerator="cpu", sync_batchnorm=True, logger=False)
    plugin = trainer.strategy._layer_sync
    assert isinstance(plugin, SyncBatchNormPlugin) and isinstance(plugin, TorchSyncBatchNorm)
    assert plugin.device_type == "cpu"


def test_one_device_has_no_ddp_wrap():
    trainer = build_trainer(devices=1, accelerator="cpu", logger=False)
    assert not isinstance(trainer.strategy, DDPStrategy)


def test_only_ranks_our_launcher_started_follow_it(monkeypatch):
    """Ranks 1..N-1 started by Lightning's launcher die with rank 0 during the fit; others never do."""
    import os

    from ddp_recipes.checkpointing import preemption

    monkeypatch.delenv(preemption.LAUNCHER_PID_VAR, raising=False)
    assert preemption.die_with_launcher() is False  # a shell's or torchrun's child: left alone
    monkeypatch.setenv(preemption.LAUNCHER_PID_VAR, str(os.getpid()))
    assert preemption.die_with_launcher() is False  # rank 0 itself
    monkeypatch.setenv(preemption.LAUNCHER_PID_VAR, str(os.getppid()))
    try:
        assert preemption.die_with_launcher() is True
    finally:
        assert preemption.die_with_launcher(enable=False) is True
    monkeypatch.setenv(preemption.LAUNCHER_PID_VAR, "1")  # a launcher that already exited: stop now
    try:
        with pytest.raises(SystemExit):
            preemption.die_with_launcher()
    finally:
        preemption.die_with_launcher(enable=False)


def test_launcher_pid_reaches_children_only(monkeypatch):
    import os

    from ddp_recipes.checkpointing import preemption

    seen = {}

    class Launcher:
        def _call_children_scripts(self):
            seen["pid"] = os.environ.get(preemption.LAUNCHER_PID_VAR)

    launcher = Launcher()
    preemption.tag_children_with_launcher(launcher)
    launcher._call_children_scripts()
    assert seen["pid"] == str(os.getpid()) and preemption.LAUNCHER_PID_VAR not in os.environ


GROUP_AT_EXIT_SCRIPT = """
import atexit
import sys

import torch.distributed as dist
from lightning.fabric.utilities.distributed import _destroy_dist_connection

from ddp_recipes.ddp.group_exit import destroy_group_at_exit, keep_group_at_exit

steps = sys.argv[1].split(",")
# Registered first, so it runs last: whether the group outlived every other exit handler.
atexit.register(lambda: print("group", "alive" if dist.is_initialized() else "destroyed", flush=True))
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=0, world_size=1)
if "lightning_nccl" in steps:
    atexit.register(_destroy_dist_connection)  # what Lightning registers when the backend is NCCL
for step in steps:
    if step == "run":
        destroy_group_at_exit()  # TunedDDPStrategy.setup_environment, each fit/test
    elif step == "fail":
        keep_group_at_exit()  # TunedDDPStrategy.on_exception
"""


@pytest.mark.parametrize(("steps", "expected"), [
    ("run", "destroyed"),
    pytest.param("run,fail", "alive", marks=pytest.mark.slow),
    # Lightning's own NCCL exit handler must not tear the group down after a failure either.
    ("lightning_nccl,run,fail", "alive"),
    # A failed run, then one that succeeds in the same process (a script retrying): destroyed again.
    pytest.param("run,fail,run", "destroyed", marks=pytest.mark.slow),
])
def test_the_group_is_destroyed_at_exit_unless_the_last_run_failed(tmp_path, steps, expected):
    from tests.helpers import free_port
    from tests.launch import run

    script = tmp_path / "group.py"
    script.write_text(GROUP_AT_EXIT_SCRIPT)
    proc = run([script, steps, free_port()], timeout=120, port=False, threads=None, quiet=None)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["group", expected], proc.stdout + proc.stderr
