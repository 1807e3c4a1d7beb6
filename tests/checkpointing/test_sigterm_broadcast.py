"""The pack takes Lightning's per-step SIGTERM broadcast out of its trainers (issue #39.1), and this file fails the
day a Lightning release renames or moves it.

Lightning 2.6's ``_TrainingEpochLoop.advance`` calls ``self._broadcast_sigterm_tensor()`` before every batch at
2+ ranks: a broadcast from rank 0 and an ``.item()``. Under the pack's ``FlagSignalConnector`` its flag is never
set (the stop is agreed through the store), so ``skip_sigterm_broadcast`` replaces it on the trainer's loop.
The 2-rank count (tests/cross_cutting/test_step_collectives.py) shows plain Lightning's broadcast and its
absence under the pack; this file pins the name, the call site and the Lightning range it was checked on.
"""

from __future__ import annotations

import inspect
import re
import tomllib
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
from packaging.specifiers import SpecifierSet

from ddp_recipes.checkpointing.preemption import SIGTERM_BROADCAST, skip_sigterm_broadcast
from ddp_recipes.config.run_config import RunConfig
from ddp_recipes.train.run import make_trainer

ROOT = Path(__file__).resolve().parents[2]


def _data():
    from ddp_recipes.data.samplers import TensorBatchDataset

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(96, 1, 28, 28, generator=g), torch.randint(0, 10, (96,), generator=g)
    return TensorBatchDataset(x[:64], y[:64]), TensorBatchDataset(x[64:], y[64:])


def test_lightnings_loop_still_broadcasts_the_flag_where_the_pack_takes_it_out():
    method = getattr(_TrainingEpochLoop, SIGTERM_BROADCAST, None)
    assert callable(method), f"Lightning {L.__version__} has no _TrainingEpochLoop.{SIGTERM_BROADCAST}: recheck"
    source = inspect.getsource(method)
    assert "broadcast" in source and "received_sigterm" in source and ".item()" in source, source
    # ... called from advance, before the batch is fetched: the only call site the skip has to cover.
    advance = inspect.getsource(_TrainingEpochLoop.advance)
    assert advance.count(f"self.{SIGTERM_BROADCAST}()") == 1, advance
    assert advance.index(f"self.{SIGTERM_BROADCAST}()") < advance.index("next(data_fetcher)")
    others = [name for name, fn in vars(_TrainingEpochLoop).items()
              if callable(fn) and name not in ("advance", SIGTERM_BROADCAST)
              and SIGTERM_BROADCAST in inspect.getsource(fn)]
    assert not others, f"Lightning {L.__version__} calls the broadcast from {others} too"


def test_the_installed_lightning_is_in_the_range_this_was_checked_on():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pin = next(d for d in deps if re.match(r"lightning\b", d))
    assert pin == "lightning>=2.6.6,<2.7", pin  # widen only after rechecking the broadcast against the new release
    assert L.__version__ in SpecifierSet(pin.removeprefix("lightning"))


def test_a_pack_fit_runs_without_it_and_other_trainers_keep_it(tmp_path):
    from ddp_recipes.modules.mnist import MNISTClassifier
    from tests.tiny_modules import TensorDataModule

    cfg = RunConfig(devices=1, accelerator="cpu", max_steps=2, batch_size=16, output_dir=str(tmp_path), num_workers=0)
    trainer = make_trainer(cfg, logger=False)
    loop = trainer.fit_loop.epoch_loop
    assert SIGTERM_BROADCAST not in vars(loop)  # taken out when fit starts, by the run's LastCheckpoint
    train, val = _data()
    trainer.fit(MNISTClassifier(), TensorDataModule(train, val, 16, cfg.seed))
    assert SIGTERM_BROADCAST in vars(loop) and getattr(loop, SIGTERM_BROADCAST)() is None
    plain = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False)
    assert SIGTERM_BROADCAST not in vars(plain.fit_loop.epoch_loop)


@pytest.mark.parametrize("preemption", [True, False])
def test_build_trainer_takes_it_out_only_with_its_own_stop_vote(tmp_path, preemption):
    from ddp_recipes.modules.mnist import MNISTClassifier
    from ddp_recipes.train.trainer import build_trainer
    from tests.tiny_modules import TensorDataModule

    trainer = build_trainer(devices=1, accelerator="cpu", max_steps=1, preemption=preemption, logger=False,
                            default_root_dir=tmp_path, enable_checkpointing=preemption)
    train, val = _data()
    trainer.fit(MNISTClassifier(), TensorDataModule(train, val, 16, 0))
    # Without the pack's LastCheckpoint, Lightning's own SIGTERM handling (and its broadcast) stays as it is.
    assert (SIGTERM_BROADCAST in vars(trainer.fit_loop.epoch_loop)) is preemption


def test_the_skip_touches_only_the_loop_it_is_given(tmp_path):
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False)
    other = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False)
    skip_sigterm_broadcast(trainer)
    assert SIGTERM_BROADCAST in vars(trainer.fit_loop.epoch_loop)
    assert SIGTERM_BROADCAST not in vars(other.fit_loop.epoch_loop)
    assert callable(getattr(_TrainingEpochLoop, SIGTERM_BROADCAST))  # the class is left alone
