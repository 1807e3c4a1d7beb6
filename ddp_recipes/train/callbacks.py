"""Callbacks every recipe run adds: steady-state throughput, and the check that a user's
DataModule honours the planned batch."""

from __future__ import annotations

import time
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.data import extract_batch_size
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from typing_extensions import override

from ddp_recipes.data.samplers import loader_batch_size
from ddp_recipes.errors import ConfigError
from ddp_recipes.train.perf import (
    input_wait,
)


class ThroughputMeter(Callback):
    """Steady-state training samples/s over all ranks, from rank-local wall time between optimizer steps,
    and the fraction of that time the loop waited for its next batch.

    DDP's gradient all-reduce makes every step a synchronisation point, so one rank's clock measures the
    whole group. The first ``warmup_steps`` intervals (allocator, first all-reduce, bucket rebuild, loader
    workers starting; at most half of a short run) and the time outside training batches (validation,
    epoch ends) are excluded.
    """

    def __init__(self, warmup_steps: int = 5) -> None:
        self.warmup_steps = warmup_steps
        self.intervals: list[tuple[int, float, float | None]] = []  # (samples over all ranks, seconds, wait s)
        self.example: torch.Tensor | None = None  # the first batch's input, for the FLOP count
        self.first_step_s: float | None = None  # the fit's first batch: with --compile, its compilation
        self._last: float | None = None
        self._first_start: float | None = None

    @override
    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._last = None  # do not count the gap across validation and the epoch boundary

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._last = None  # validation inside an epoch (val_check_interval) is not step time either

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self._first_start is None:
            self._first_start = time.perf_counter()
        if self.example is None:
            first = batch[0] if isinstance(batch, list | tuple) and batch else batch
            if torch.is_tensor(first):
                self.example = torch.empty(first.shape, dtype=first.dtype, device="meta")

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        now = time.perf_counter()
        if self.first_step_s is None and self._first_start is not None:
            self.first_step_s = now - self._first_start
        if self._last is not None:
            self.intervals.append((_batch_len(batch) * trainer.world_size, now - self._last, input_wait(trainer)))
        self._last = now

    def _steady(self) -> list[tuple[int, float, float | None]]:
        return self.intervals[min(self.warmup_steps, len(self.intervals) // 2):]

    @property
    def samples_per_sec(self) -> float | None:
        steady = self._steady()
        seconds = sum(t for _, t, _ in steady)
        return sum(n for n, _, _ in steady) / seconds if seconds > 0 else None

    @property
    def step_s_median(self) -> float | None:
        steady = sorted(t for _, t, _ in self._steady())
        return steady[len(steady) // 2] if steady else None

    @property
    def input_wait_fraction(self) -> float | None:
        """Share of the steady step time rank 0 spent waiting for the next batch (None: not measured)."""
        steady = self._steady()
        seconds = sum(t for _, t, _ in steady)
        if not steady or seconds <= 0 or any(w is None for _, _, w in steady):
            return None
        return min(1.0, sum(w for _, _, w in steady) / seconds)



def _batch_len(batch: Any) -> int:
    """Samples in a batch, by Lightning's own rule (the first tensor's leading dimension, also inside dicts
    and lists; a dict's keys are not samples); 1 when nothing in it has a length."""
    try:
        return int(extract_batch_size(batch))
    except (MisconfigurationException, RecursionError, TypeError):
        return 1



class PlannedBatch(Callback):
    """Fails every rank before the first step when the training loader's batch is not the run's plan.

    A user's DataModule that ignores the ``batch_size`` it was given would make the printed global batch,
    the LR scaling and the resume arithmetic silently wrong.
    """

    def __init__(self, per_device: int, source: str) -> None:
        self.per_device, self.source = per_device, source

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        batch = loader_batch_size(trainer.train_dataloader)
        if batch is not None and batch != self.per_device:
            raise ConfigError(f"{{datamodule_class}} {self.source}: its training loader has batch_size {batch} but "
                              f"the run plans {self.per_device} per device; build the loader with the batch_size given "
                              "to __init__")
