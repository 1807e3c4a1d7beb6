"""A pack training step reads the device from the host only when the logger writes (issue #39.1, #39.3).

Counted, not timed: a ``TorchDispatchMode`` counts ``aten._local_scalar_dense`` (``.item()``, ``float(t)``)
and ``aten.is_nonzero`` (``bool(t)``, ``if t:``) over whole loop iterations, from one training batch's start
to the next one's: every hook of every callback, Lightning's own batch-end work (its logger connector, the
progress bar), the optimizer step and the next batch's fetch and transfer. Each iteration is counted on its
own, for the MNIST recipe's path (``run_fit_test`` with the recipe's callbacks, ``build_trainer``, resumable
loader, diagnostics), by the bench's own counter (``benchmarks/account/step_counts.py`` ``StepCounts``, what
``benchmarks overhead`` and ``benchmarks account`` report). On CPU these reads cost little, but each is a stream
stall on CUDA. The same count at 2 ranks is tests/cross_cutting/test_step_collectives.py's.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback

from benchmarks.account.step_counts import HOST_READS, OpCounts, StepCounts
from ddp_recipes.config.run_config import RunConfig
from ddp_recipes.data.samplers import TensorBatchDataset
from ddp_recipes.modules.logging import SyncFreeMean
from ddp_recipes.modules.mnist import MNISTClassifier
from ddp_recipes.train.checkpoints import checkpoint_callbacks
from ddp_recipes.train.run import make_trainer, run_fit_test
from tests.tiny_modules import TensorDataModule

BATCH, START, WINDOW = 16, 12, 24  # steps 13..36 of a 200-step epoch: no epoch end, no first-step work


def _data() -> tuple[TensorBatchDataset, TensorBatchDataset]:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(3264, 1, 28, 28, generator=g), torch.randint(0, 10, (3264,), generator=g)
    return TensorBatchDataset(x[:3200], y[:3200]), TensorBatchDataset(x[3200:], y[3200:])


def _pack(tmp_path, extra: list[Callback] = (), module: type[L.LightningModule] = MNISTClassifier,
          log_every_n_steps: int = 10) -> StepCounts:
    train, val = _data()
    cfg = RunConfig(devices=1, accelerator="cpu", max_steps=START + WINDOW + 2, batch_size=BATCH,
                    output_dir=str(tmp_path / "pack"), num_workers=0, log_every_n_steps=log_every_n_steps)
    counter = StepCounts(after=START, count=WINDOW)  # the bench's count (bench/harness/step_counts.py)
    # The recipe's own callbacks and logging (recipes.mnist.main, without its flag parsing and test pass).
    run_fit_test(cfg, lambda: module(lr=cfg.plan.lr), TensorDataModule(train, val, BATCH, cfg.seed),
                 callbacks=[*checkpoint_callbacks(cfg, True, module), counter, *extra], test=False,
                 save_final=False)
    return counter


def reads_outside_log_steps(counter: StepCounts) -> list[dict[str, Any]]:
    return [row for row in counter.rows if not row["logs"] and row["reads"]]


class _ReadsLoss(Callback):
    """The mistake the test must catch: a pack-style callback that reads the loss on the host every step."""

    def __init__(self) -> None:
        self.seen = 0.0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.seen += outputs["loss"].item()


@pytest.mark.parametrize("log_every_n_steps", [10, 7])
def test_a_pack_step_that_does_not_log_reads_nothing_and_a_log_step_only_what_the_logger_writes(
        tmp_path, log_every_n_steps):
    counter = _pack(tmp_path, log_every_n_steps=log_every_n_steps)
    assert len(counter.rows) == WINDOW and {row["spans"] for row in counter.rows} == {"step"}
    assert [row["step"] for row in counter.rows] == list(range(START + 1, START + WINDOW + 1))
    # The window really saw whole iterations: forward, backward, the optimizer and the next fetch.
    ops = counter.iterations.ops()
    assert ops["aten::addmm"] >= WINDOW
    assert ops["aten::_foreach_add_"] + ops["aten::add_"] > 0
    logged = [row for row in counter.rows if row["logs"]]
    assert len(logged) == len([s for s in range(START + 1, START + WINDOW + 1) if s % log_every_n_steps == 0])
    assert not reads_outside_log_steps(counter), counter.rows
    assert all(0 < row["written"] and row["reads"] <= row["written"] for row in logged), logged


@pytest.mark.slow
def test_the_count_sees_one_item_per_step_in_a_callback(tmp_path):
    added = _pack(tmp_path / "added", extra=[_ReadsLoss()])
    assert [row["reads"] for row in added.rows if not row["logs"]] == [1] * (WINDOW - 2)


class _BarLoss(MNISTClassifier):
    """A user's module that shows its loss the way Lightning's docs do: ``prog_bar=True`` at every step."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("my_loss", loss.detach(), prog_bar=True)
        return loss


def test_a_users_per_step_bar_metric_is_named_once_with_its_cost(tmp_path):
    with pytest.warns(UserWarning, match=r"\[per-step-read\] 'my_loss' logged with prog_bar=True") as seen:
        counter = _pack(tmp_path, module=_BarLoss)
    assert sum("per-step-read" in str(w.message) for w in seen) == 1
    # ... and the count shows why: Lightning reads it at every batch end.
    assert [row["reads"] for row in counter.rows if not row["logs"]] == [1] * (WINDOW - 2)


class _LateBarLoss(MNISTClassifier):
    """A user's per-step progress-bar metric logged only from step 15 on."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.global_step >= 15:
            self.log("late_loss", loss.detach(), prog_bar=True)
        return loss


class _WarnedAt(Callback):
    """The optimizer step at which the [per-step-read] warning came."""

    def __init__(self) -> None:
        self.step: int | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.step is None and trainer.progress_bar_callback._named:
            self.step = trainer.global_step


@pytest.mark.parametrize("logger", [True, False])
def test_a_per_step_bar_metric_first_logged_later_is_named_at_the_next_log_step(tmp_path, logger):
    cfg = RunConfig(devices=1, accelerator="cpu", max_steps=60, batch_size=BATCH, output_dir=str(tmp_path),
                    num_workers=0, log_every_n_steps=10)
    train, val = _data()
    warned = _WarnedAt()
    kwargs = {} if logger else {"logger": False}
    trainer = make_trainer(cfg, callbacks=[warned], enable_checkpointing=False, limit_train_batches=50, **kwargs)
    with pytest.warns(UserWarning, match=r"\[per-step-read\] 'late_loss'"):
        trainer.fit(_LateBarLoss(), TensorDataModule(train, val, BATCH, cfg.seed))
    # first logged at step 16's batch (global_step 15 during it): named by step 20's log step (the logger's
    # write is seen at the batch end after it), not at the epoch end (step 50)
    assert warned.step is not None and warned.step <= 21, warned.step


def test_the_recipes_bar_shows_the_loss_the_logger_wrote(tmp_path):
    from ddp_recipes.train.progress import LoggedMetricsBar

    cfg = RunConfig(devices=1, accelerator="cpu", max_steps=25, batch_size=BATCH, output_dir=str(tmp_path),
                    num_workers=0)
    train, val = _data()
    trainer = make_trainer(cfg, enable_checkpointing=False)
    trainer.fit(MNISTClassifier(), TensorDataModule(train, val, BATCH, cfg.seed))
    bar = trainer.progress_bar_callback
    assert isinstance(bar, LoggedMetricsBar)
    shown = bar.get_metrics(trainer, trainer.lightning_module)
    assert isinstance(shown["train_loss"], float)
    assert shown["train_loss"] == pytest.approx(float(trainer.logged_metrics["train_loss"]))  # step 20's
    assert "train_loss" not in trainer.progress_bar_metrics  # not Lightning's per-step read
    assert "log_metrics" not in vars(trainer.loggers[0])  # the logger is given back after fit


def test_sync_free_mean_is_the_weighted_mean_and_keeps_nan():
    metric = SyncFreeMean()
    metric.update(torch.tensor(2.0), weight=3)
    metric.update(torch.tensor(4.0), weight=1)
    metric.update(torch.tensor([1.0, 3.0]))  # a vector: each element weight 1
    assert torch.isclose(metric.compute(), torch.tensor((6 + 4 + 4) / 6))
    metric.update(torch.tensor([1.0, 2.0]), weight=torch.tensor([0.0, 2.0]))
    assert torch.isclose(metric.compute(), torch.tensor((14 + 4) / 8))
    metric.update(torch.tensor(float("nan")), weight=2)
    assert torch.isnan(metric.compute())  # not silently dropped


def test_sync_free_mean_update_makes_no_host_read():
    metric = SyncFreeMean()
    with OpCounts() as mode:
        metric.update(torch.tensor(0.5), weight=64)
    assert not any(mode.ops[name] for name in HOST_READS), dict(mode.ops)


@pytest.mark.parametrize("make", ["make_trainer"])
def test_the_recipe_trainer_keeps_its_log_cadence(tmp_path, make):
    # The window above compares at make_trainer's cadence; if it changes, the plain side must follow.
    cfg = RunConfig(devices=1, accelerator="cpu", max_steps=2, output_dir=str(tmp_path))
    assert make_trainer(cfg).log_every_n_steps == 10


def test_the_modules_training_step_makes_no_host_read():
    # Shared by both sides above, so counted here on its own: MeanMetric's default NaN check would be one
    # aten.is_nonzero per step (``if nans.any()``).
    module = MNISTClassifier()
    batch = (torch.randn(BATCH, 1, 28, 28), torch.randint(0, 10, (BATCH,)))
    with OpCounts() as mode:
        module.training_step(batch, 0)
    assert mode.ops["aten::addmm"] == 2  # the step ran inside the mode
    assert not any(mode.ops[name] for name in HOST_READS), {k: mode.ops[k] for k in HOST_READS}


# ---- --decode gpu: the decode and the device augmentation in the step --------------------------------------

DECODE_START, DECODE_WINDOW = 2, 3


class _DecodeCounter(StepCounts):
    """Also the images the DataModule's device decoder decoded inside the window (torchvision 0.26's CPU
    decode_jpeg does not go through the dispatcher, so the op count cannot show it on every version)."""

    def __init__(self, dm, start: int, window: int) -> None:
        super().__init__(after=start, count=window)
        self.dm, self.marks = dm, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step in (self.iterations.after, self.iterations.after + self.iterations.count):
            self.marks.append(self.dm.decoder.images)
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)

    def decoded(self) -> int:
        return self.marks[1] - self.marks[0]

    def host_reads(self) -> dict[str, int]:
        ops = self.iterations.ops()
        return {name: ops[name] for name in HOST_READS}


def _resnet_steps(tmp_path, root, decode: str) -> _DecodeCounter:
    """The ResNet recipe's path (run_fit_test, its callbacks) on a JPEG folder, one loader worker, 11 steps."""
    from ddp_recipes.data.images import ImageFolderDataModule
    from ddp_recipes.modules.resnet import ResNetClassifier

    cfg = RunConfig(devices=1, accelerator="cpu", max_steps=DECODE_START + DECODE_WINDOW + 2, batch_size=1,
                    output_dir=str(tmp_path / decode), num_workers=1)
    dm = ImageFolderDataModule(root, batch_size=1, image_size=16, num_workers=1, decode=decode,
                               random_erase=0.5, auto_augment="ta_wide")
    counter = _DecodeCounter(dm, DECODE_START, DECODE_WINDOW)
    run_fit_test(cfg, lambda: ResNetClassifier(num_classes=2, cifar_stem=True, lr=cfg.plan.lr), dm,
                 callbacks=[*checkpoint_callbacks(cfg, True, ResNetClassifier), counter], test=False, save_final=False)
    return counter


def test_a_decode_gpu_step_reads_the_device_no_more_than_a_decode_cpu_step(tmp_path):
    from tests.helpers import write_jpeg_tree

    root = write_jpeg_tree(tmp_path / "jpegs", per_class=6, val_per_class=1, side=20)  # 12 steps per epoch
    gpu, cpu = _resnet_steps(tmp_path, root, "gpu"), _resnet_steps(tmp_path, root, "cpu")
    assert len(gpu.rows) == len(cpu.rows) == DECODE_WINDOW
    assert gpu.decoded() == DECODE_WINDOW and cpu.decoded() == 0  # the window's batches were decoded inside it
    assert sum(gpu.host_reads().values()) <= sum(cpu.host_reads().values()), (
        f"decode gpu {gpu.host_reads()} vs cpu {cpu.host_reads()}")


def test_decoding_and_augmenting_a_batch_on_the_device_makes_no_host_read(tmp_path):
    """Every step of the device pipeline, the fallback included: the crops, flips, policy operations and erased
    boxes are host values drawn in the workers, the normalisation constants stay on the device."""
    from PIL import Image

    from ddp_recipes.data.device_decode import DeviceDecoder
    from ddp_recipes.data.encoded import EncodedImageFolder, EvalPipeline, TrainPipeline
    from ddp_recipes.data.seeding import sample_seed, seed_all
    from tests.helpers import write_jpeg_tree

    root = write_jpeg_tree(tmp_path / "jpegs", per_class=6, side=30)
    files = sorted(str(p) for p in root.rglob("*.jpg"))
    Image.new("RGB", (30, 34), (0, 90, 0)).save(root / "png.JPEG", format="PNG")
    files.append(str(root / "png.JPEG"))
    decoder = DeviceDecoder(channels_last=True)
    for pipeline in (TrainPipeline(24, auto_augment="imagenet", random_erase=1.0), EvalPipeline(24)):
        dataset = EncodedImageFolder([(f, 0) for f in files], pipeline)
        samples = []
        for i in range(len(files)):
            seed_all(sample_seed(0, 0, i))
            samples.append(dataset[i])
        batch = dataset.collate(samples).to("cpu")
        decoder(batch)  # the normalisation constants are copied once per device, before the count
        before = decoder.images
        with OpCounts() as mode:
            x, _ = decoder(batch)
        assert x.shape == (len(files), 3, 24, 24) and decoder.images - before == len(files)
        assert mode.ops["aten::div_"] >= 1  # the device augmentation ran inside the mode
        assert not any(mode.ops[name] for name in HOST_READS), {k: mode.ops[k] for k in HOST_READS}
    assert decoder.fallbacks == 4  # the PNG, twice per pipeline
