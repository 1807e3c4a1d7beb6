"""The library path: a user's own LightningModule and DataLoader with ``build_trainer`` get the recipes'
guarantees (issue #26). Preemption saves and exits non-zero, ``fit(ckpt_path="last")`` continues exactly
after SIGTERM or SIGKILL (epoch end, mid-epoch), validation is unpadded, and every Lightning spelling of
an argument is accepted while every bad value fails in one line naming it.

The multi-process runs are ``tests/scenarios/library_scenario.py``: 2 gloo ranks, 2 loader workers each with
RandomCrop drawn from the global RNG, BatchNorm and dropout; their end weights are compared bit for bit.
"""

from __future__ import annotations

import json
import os
import signal
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from ddp_recipes import build_trainer
from ddp_recipes.checkpointing.last import LastCheckpoint
from ddp_recipes.data.resumable import ResumableDataLoader
from ddp_recipes.ddp.strategy import TunedDDPStrategy
from ddp_recipes.errors import ConfigError
from tests.helpers import assert_same_weights
from tests.launch import Background, saved_step, start
from tests.tiny_modules import TinyNet

ROOT = Path(__file__).resolve().parents[2]
SCENARIO = ROOT / "tests" / "scenarios" / "library_scenario.py"
EPOCHS, STEPS = 2, 12  # 6 steps per epoch at 2 ranks
WAIT_S = 300


def scenario(out: Path, every_n_steps: int, step_s: float = 0.0) -> Background:
    return start([SCENARIO, out, EPOCHS, every_n_steps], env={"SCENARIO_STEP_S": str(step_s)})


def finish(proc: Background) -> tuple[int, str]:
    done = proc.finish(timeout=WAIT_S)
    return done.returncode, done.stderr


def last_of(out: Path) -> Path:
    return out / "checkpoints" / "last.ckpt"


@pytest.fixture(scope="module")
def library_straight(tmp_path_factory) -> Path:
    """The uninterrupted run's last.ckpt (step 12)."""
    out = tmp_path_factory.mktemp("straight")
    rc, err = finish(scenario(out, every_n_steps=1))
    assert rc == 0, err[-3000:]
    assert saved_step(last_of(out)) == STEPS
    assert json.loads((out / "result.json").read_text())["val_seen"] == 15  # every sample once, not 16
    return last_of(out)


@pytest.mark.slow  # a long multi-process run: make test-slow (keeps make test near 10 min)
def test_sigterm_to_the_launcher_saves_exits_143_and_ckpt_path_last_is_exact(library_straight, tmp_path):
    proc = scenario(tmp_path, every_n_steps=1, step_s=0.3)
    seen = proc.wait_for_step(last_of(tmp_path), 2, timeout=WAIT_S)
    proc.signal(signal.SIGTERM)  # the process Lightning launched the other rank from, as a job controller does
    rc, err = finish(proc)
    assert rc == 128 + signal.SIGTERM, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("preempted by")]
    assert len(lines) == 1 and "SIGTERM" in lines[0] and 'ckpt_path="last"' in lines[0], err[-3000:]
    assert "--resume auto" not in lines[0] and "Traceback" not in err
    step = saved_step(last_of(tmp_path))
    assert seen <= step < STEPS and f"at step {step} " in lines[0]
    rc, err = finish(scenario(tmp_path, every_n_steps=1))  # the same command: fit(ckpt_path="last") continues
    assert rc == 0, err[-3000:]
    assert_same_weights(last_of(tmp_path), library_straight)
    assert json.loads((tmp_path / "result.json").read_text()) == {"val_seen": 15.0, "global_step": STEPS}


@pytest.mark.slow
@pytest.mark.parametrize("where", ["epoch-end", "mid-epoch"])
def test_sigkill_then_ckpt_path_last_is_exact(where, library_straight, tmp_path):
    """Epoch end: only epoch-end checkpoints, killed during epoch 1 (the augmentation-in-workers case);
    mid-epoch: a checkpoint every step, killed in epoch 0."""
    every, at = (0, 6) if where == "epoch-end" else (1, 3)
    proc = scenario(tmp_path, every_n_steps=every, step_s=0.3)
    seen = proc.wait_for_step(last_of(tmp_path), at, timeout=WAIT_S)
    proc.kill()  # the ranks and their loader workers, no grace
    assert seen < STEPS
    rc, err = finish(scenario(tmp_path, every_n_steps=every))
    assert rc == 0, err[-3000:]
    assert_same_weights(last_of(tmp_path), library_straight)


# ---- in-process: arguments ----------------------------------------------------------------------------

QUIET = dict(logger=False, enable_progress_bar=False, enable_model_summary=False)


def _stops(trainer) -> list[str]:
    from ddp_recipes.checkpointing.preemption import AgreedStop

    return [type(c).__name__ for c in trainer.callbacks if isinstance(c, AgreedStop)]


@pytest.mark.parametrize(("kwargs", "check"), [
    (dict(callbacks=ModelCheckpoint()), lambda t: any(isinstance(c, ModelCheckpoint) for c in t.callbacks)),
    (dict(devices="auto"), lambda t: t.num_devices == 1),
    (dict(devices="2"), lambda t: t.num_devices == 2 and isinstance(t.strategy, TunedDDPStrategy)),
    (dict(devices=[0, 1]), lambda t: t.num_devices == 2),
    (dict(devices="0,1"), lambda t: t.num_devices == 2),
    (dict(accelerator=None), lambda t: t.num_devices == 1),
    (dict(devices=2, timeout_s="30"), lambda t: t.strategy._timeout == timedelta(seconds=30)),
    (dict(precision=32), lambda t: t.precision == "32-true"),
    (dict(precision="bf16-true"), lambda t: t.precision == "bf16-true"),
    (dict(devices=2, strategy_kwargs={"timeout": timedelta(seconds=60)}),
     lambda t: t.strategy._timeout == timedelta(seconds=60)),
    (dict(devices=2, strategy_kwargs={"find_unused_parameters": True, "static_graph": True}),
     lambda t: t.strategy._ddp_kwargs["find_unused_parameters"] and t.strategy._ddp_kwargs["static_graph"]),
    (dict(devices=2, strategy_kwargs={"seed": 1}), lambda t: t.strategy.seed == 1),
    (dict(devices=2, strategy_kwargs={"broadcast_buffers": False, "start_method": "popen"}),
     lambda t: t.strategy._ddp_kwargs["broadcast_buffers"] is False),
    (dict(checkpoint_every_n_steps=5, checkpoint_dir="ck"),
     lambda t: [(c.every_n_steps, c.dirpath) for c in t.callbacks if isinstance(c, LastCheckpoint)]
     == [(5, Path("ck"))]),
    (dict(), lambda t: [c.dirpath for c in t.callbacks if isinstance(c, LastCheckpoint)]
     == [Path(t.default_root_dir) / "checkpoints"]),
    (dict(preemption=False), lambda t: not any(isinstance(c, LastCheckpoint) for c in t.callbacks)),
    (dict(enable_checkpointing=False), lambda t: not any(isinstance(c, LastCheckpoint) for c in t.callbacks)),
    # At 2 ranks: no last.ckpt still gets the stop agreement (and no per-step SIGTERM broadcast); preemption=False
    # leaves signals to Lightning's own handlers, with or without checkpointing.
    (dict(devices=2, enable_checkpointing=False), lambda t: _stops(t) == ["AgreedStop"]),
    (dict(devices=2), lambda t: _stops(t) == ["LastCheckpoint"]),
    (dict(devices=2, preemption=False), lambda t: _stops(t) == []),
    (dict(devices=2, preemption=False, enable_checkpointing=False), lambda t: _stops(t) == []),
], ids=lambda v: None if callable(v) else repr(v)[:60])
def test_lightnings_arguments_keep_their_meaning(kwargs, check):
    assert check(build_trainer(accelerator=kwargs.pop("accelerator", "cpu"), **kwargs, **QUIET))


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(devices=0), "devices must be >= 1 (got 0)"),
    (dict(devices="two"), "devices must be a number"),
    (dict(devices=[0, "a"]), "devices must be a number"),
    (dict(accelerator="tpu"), "accelerator must be one of"),
    (dict(timeout_s="soon"), "timeout_s must be > 0 seconds"),
    (dict(timeout_s=-5), "timeout_s must be > 0 seconds"),
    (dict(bucket_cap_mb=-1), "bucket_cap_mb must be > 0"),
    (dict(find_unused_parameters="yes"), "find_unused_parameters must be True or False"),
    (dict(callbacks="ModelCheckpoint"), "callbacks must be one object or a list"),
    (dict(checkpoint_every_n_steps=-1), "checkpoint_every_n_steps must be an integer >= 0"),
    (dict(seed=1, strategy_kwargs={"seed": 2}), "seed is set twice"),
    (dict(devices=2, comm_hook="fp16", strategy_kwargs={"comm_hook": "bf16"}), "comm_hook is set twice"),
    (dict(devices=2, strategy_kwargs={"timeout": -5}), "timeout must be > 0 seconds"),
    (dict(devices=2, strategy_kwargs={"bogus": 1}), "bogus is not an argument of TunedDDPStrategy"),
    (dict(seed="x"), "seed must be an integer in 0..4294967295"),
    (dict(seed=-1), "seed must be an integer in 0..4294967295"),
    (dict(seed=2**32), "seed must be an integer in 0..4294967295"),
    (dict(accumulate_grad_batches=0), "accumulate_grad_batches must be an integer >= 1"),
    (dict(accumulate_grad_batches=2.5), "accumulate_grad_batches must be an integer >= 1"),
    (dict(accumulate_grad_batches=True), "accumulate_grad_batches must be an integer >= 1"),
    (dict(num_nodes=1.5), "num_nodes must be an integer >= 1"),
    (dict(max_steps=-2), "max_steps must be an integer >= -1"),
    (dict(max_steps=2.5), "max_steps must be an integer >= -1"),
    (dict(max_epochs=-2), "max_epochs must be an integer >= -1"),
])
def test_bad_arguments_fail_in_one_line_naming_them(kwargs, message):
    with pytest.raises(ConfigError) as info:
        build_trainer(accelerator=kwargs.pop("accelerator", "cpu"), **kwargs, **QUIET)
    text = str(info.value)
    assert text.startswith(message) and "\n" not in text, text


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(timeout=-5), "timeout must be > 0 seconds"),
    (dict(bucket_cap_mb=-1), "bucket_cap_mb must be > 0"),
    (dict(start_method="bogus"), "start_method must be one of popen, spawn, fork, forkserver"),
    (dict(powersgd_rank=0), "powersgd_rank must be an integer >= 1"),
    (dict(powersgd_start_iter=1), "powersgd_start_iter must be an integer >= 2"),
    (dict(comm_hook="int8"), "comm_hook must be one of"),
    (dict(static_graph=1), "static_graph must be True or False"),
    (dict(bucket_cap_mbs=25), "bucket_cap_mbs is not an argument"),
])
def test_the_strategy_checks_its_own_arguments(kwargs, message):
    with pytest.raises(ConfigError) as info:
        TunedDDPStrategy(**kwargs)
    assert str(info.value).startswith(message) and info.value.param == next(iter(kwargs))


def test_the_strategy_accepts_every_ddpstrategy_argument():
    strategy = TunedDDPStrategy(timeout=timedelta(seconds=5), start_method="spawn", process_group_backend="gloo",
                                broadcast_buffers=False, bucket_cap_mb=10, init_sync=True)
    assert strategy._timeout == timedelta(seconds=5) and strategy._start_method == "spawn"
    assert strategy._ddp_kwargs["broadcast_buffers"] is False and strategy._ddp_kwargs["bucket_cap_mb"] == 10


# ---- in-process, one device: what the adopted loaders are ---------------------------------------------

class Stream(IterableDataset):
    def __iter__(self):
        return iter([(torch.ones(4), torch.tensor(0))] * 4)


def test_a_plain_loader_becomes_resumable_and_an_iterable_one_is_named(tmp_path):
    data = TensorDataset(torch.randn(8, 4), torch.arange(8) % 2)
    trainer = build_trainer(accelerator="cpu", max_steps=2, default_root_dir=str(tmp_path), **QUIET)
    trainer.fit(TinyNet(), DataLoader(data, batch_size=2, shuffle=True))
    assert isinstance(trainer.train_dataloader, ResumableDataLoader)
    assert trainer.train_dataloader.sampler.shuffle and trainer.train_dataloader.dataset.dataset is data
    trainer = build_trainer(accelerator="cpu", max_steps=2, default_root_dir=str(tmp_path / "b"), **QUIET)
    with pytest.warns(UserWarning, match=r"train_dataloader: an IterableDataset \(Stream\): it cannot be repositioned"):
        trainer.fit(TinyNet(), DataLoader(Stream(), batch_size=2))


class HookLoader(TinyNet):
    """A loader made in the module's hook, where Lightning records the arguments it was given."""

    def __init__(self, **kwargs) -> None:
        super().__init__()
        self.kwargs, self.made = kwargs, None

    def train_dataloader(self):
        self.made = DataLoader(TensorDataset(torch.randn(8, 4), torch.arange(8) % 2), batch_size=2, **self.kwargs)
        return self.made


def test_a_rebuilt_loader_pins_memory_on_cuda_unless_its_maker_chose(tmp_path):
    # On CUDA a batch copied from pageable memory blocks the host: the loader the pack rebuilds pins, unless the
    # user passed pin_memory (seen only for a loader made in a *_dataloader hook: elsewhere a default is no choice).
    from ddp_recipes.data.adopt import pin_memory_for

    loose = DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=2)
    assert pin_memory_for(loose, "cuda") and not pin_memory_for(loose, "cpu")
    for i, (kwargs, pinned) in enumerate((({}, True), ({"pin_memory": False}, False))):
        module = HookLoader(**kwargs)
        trainer = build_trainer(accelerator="cpu", max_steps=1, default_root_dir=str(tmp_path / str(i)), **QUIET)
        trainer.fit(module)
        assert pin_memory_for(module.made, "cuda") is pinned, kwargs
        assert trainer.train_dataloader.pin_memory is pin_memory_for(module.made, "cpu")  # what the CPU run used


def test_a_loader_over_samples_already_on_the_device_is_not_pinned():
    # Pinning a CUDA tensor raises ("cannot pin ... only dense CPU tensors can be pinned"): the bench's synthetic
    # RankShard (gpu-check's sync-debug and resnet50-pack runs) and a TensorDataset of CUDA tensors stay unpinned.
    # The meta device stands in for CUDA; pinning one of its tensors raises the same error.
    from torch.utils.data import ConcatDataset, Subset

    from ddp_recipes.bench.harness.synthetic import RankShard
    from ddp_recipes.data.adopt import pin_memory_for

    with pytest.raises(RuntimeError, match="only dense CPU tensors can be pinned"):
        torch.empty(2, device="meta").pin_memory()
    on_device = [RankShard(64, (3, 8, 8), seed=0, device="cuda"), TensorDataset(torch.empty(8, 4, device="meta")),
                 Subset(TensorDataset(torch.empty(8, 4, device="meta")), [0, 1]),
                 ConcatDataset([TensorDataset(torch.randn(8, 4)), TensorDataset(torch.empty(8, 4, device="meta"))])]
    for dataset in on_device:
        assert not pin_memory_for(DataLoader(dataset, batch_size=2), "cuda"), dataset
    on_host = [RankShard(64, (3, 8, 8), seed=0, device="cpu"), Subset(TensorDataset(torch.randn(8, 4)), [0, 1])]
    for dataset in on_host:
        assert pin_memory_for(DataLoader(dataset, batch_size=2), "cuda"), dataset


class DropoutNet(TinyNet):
    """Dropout draws from the global torch RNG every step: any extra draw on resume changes the weights."""

    def __init__(self) -> None:
        super().__init__(4, 2, 16, dropout=0.5)

    def training_step(self, batch, batch_idx):
        if self.global_step == 6 and os.environ.get("_TEST_SIGTERM_AT_6") and self.trainer.training:
            os.environ.pop("_TEST_SIGTERM_AT_6")
            os.kill(os.getpid(), signal.SIGTERM)
        return super().training_step(batch, batch_idx)


def _fit_dropout_net(root: Path) -> dict[str, torch.Tensor]:
    data = TensorDataset(torch.randn(28, 4, generator=torch.Generator().manual_seed(1)), torch.arange(28) % 2)
    trainer = build_trainer(accelerator="cpu", devices=1, seed=0, max_epochs=2, val_check_interval=0.5,
                            default_root_dir=str(root), **QUIET)
    model = DropoutNet()
    trainer.fit(model, DataLoader(data, batch_size=4, shuffle=True), DataLoader(data, batch_size=4),
                ckpt_path="last")
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_resume_after_a_stop_on_the_last_batch_with_mid_epoch_validation_is_exact(tmp_path, monkeypatch):
    # 7 batches, validation after batches 3 and 6; SIGTERM stops on the epoch's last batch (mid-epoch
    # last.ckpt). Lightning's restart fast-forwards a validation the uninterrupted run never ran, and
    # creating that loader's iterator drew its base seed from the global RNG that dropout uses.
    straight = _fit_dropout_net(tmp_path / "straight")
    monkeypatch.setenv("_TEST_SIGTERM_AT_6", "1")
    with pytest.raises(SystemExit) as stopped:
        _fit_dropout_net(tmp_path / "stopped")
    assert stopped.value.code == 128 + signal.SIGTERM
    resumed = _fit_dropout_net(tmp_path / "stopped")
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
