"""Callbacks every recipe run adds: steady-state throughput, and the check that a user's
DataModule honours the planned batch."""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from ddp_recipes.data.samplers import loader_batch_size
from ddp_recipes.errors import ConfigError
from ddp_recipes.lightning_seam import reach
from ddp_recipes.train.diagnostic_rules import batch_size_of
from ddp_recipes.train.perf import StepClock, input_wait, peak_flops

#: Steps between moves of the intervals the device has passed into ``intervals`` (and at each report).
COLLECT_EVERY = 32


class ThroughputMeter(Callback):
    """Steady-state training samples/s over all ranks, from rank-local time between optimizer steps, and the
    fraction of that time the loop waited for its next batch.

    DDP's all-reduce makes every step a synchronisation point, so one rank's clock measures the group. The first
    ``warmup_steps`` intervals (at most half of a short run) and time outside training batches are excluded. Step
    time is device time (:class:`~ddp_recipes.train.perf.StepClock`: CUDA events read once passed, never a
    synchronize in training; read the figures after ``fit``), the input wait host time; per step a clock mark and
    a few list operations. Live, on rank 0 every ``log_every_n_steps`` steps, the intervals since the last report
    go to the loggers at Lightning's log step, named as ``ThroughputMonitor`` names them
    (``train/samples_per_sec``, ``train/device/samples_per_sec``, ``train/step_time``,
    ``train/input_wait_fraction``, ``train/lr``, and ``train/device/flops_per_sec`` / ``train/device/mfu`` where
    the peak is known); no report reads the device, and Lightning's own log saves the loggers a moment later.
    """

    def __init__(self, warmup_steps: int = 5,
                 flops_per_sample: Callable[[torch.Tensor], int | None] | None = None) -> None:
        self.warmup_steps = warmup_steps
        self.count_flops = flops_per_sample  # FLOPs of one sample, from the first batch's input (for MFU)
        self.flops_per_sample: int | None = None
        self._peak: int | None = None
        self._every = 0
        self._live = False  # live reports: rank 0 with a logger and log_every_n_steps > 0
        self._next_log = sys.maxsize  # the optimizer step of the next live report
        self._reported = 0  # intervals already in a live report
        self.intervals: list[tuple[int, float, float | None]] = []  # (samples over all ranks, seconds, wait s)
        self.example: torch.Tensor | None = None  # the first batch's input, for the FLOP count
        self.clock: StepClock | None = None
        self._first_step: float | None = None
        self._first: tuple[Any, Any] | None = None  # marks around the fit's first batch, until read
        self._pending: deque[tuple[int, Any, Any, float | None]] = deque()  # intervals the device has not reached
        self._last: Any = None
        self._first_start: Any = None
        self._lrs: dict[str, float] | None = None  # the report's learning rates, read at its step's start
        self._unsaved = False  # a report the loggers hold that Lightning's own log may not have saved
        self._world = 1  # samples of a step over all ranks: the batch's times this

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.clock is None:
            self.clock = StepClock(trainer.strategy.root_device)
        self._world = trainer.world_size
        self._collect(wait=False)
        self._reported = len(self.intervals)
        self._every = int(trainer.log_every_n_steps or 0)
        self._live = bool(trainer.is_global_zero and trainer.loggers and self._every > 0)
        if self._live:
            self._next_log = (trainer.global_step // self._every + 1) * self._every
            self._peak = peak_flops(trainer.strategy.root_device, trainer.precision)

    @override
    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._last = None  # do not count the gap across validation and the epoch boundary

    @override
    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._collect(wait=False)
        self._save(trainer)

    @override
    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._collect(wait=False)
        self._save(trainer)

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._collect(wait=False)
        self._save(trainer)

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._save(trainer)

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._last = None  # validation inside an epoch (val_check_interval) is not step time either

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self._unsaved:
            self._save(trainer)
        if self._first_start is None:
            self._first_start = self._clock(trainer).mark()
            first = batch[0] if isinstance(batch, list | tuple) and batch else batch
            if torch.is_tensor(first):
                self.example = torch.empty(first.shape, dtype=first.dtype, device="meta")
        if self._live and trainer.global_step + 1 >= self._next_log:
            # The LR of the step about to be taken (a step schedule moves it on before on_train_batch_end),
            # as Lightning's LearningRateMonitor logs it: the micro-batches of a report's last step only.
            self._lrs = learning_rates(trainer)

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        clock = self._clock(trainer)
        now = clock.mark()
        if self._first is None and self._first_step is None and self._first_start is not None:
            self._first = (self._first_start, now)
        if self._last is not None:
            self._pending.append(((batch_size_of(batch) or 1) * self._world, self._last, now, input_wait(trainer)))
            if len(self._pending) >= COLLECT_EVERY:  # a report collects its own: the other steps only append
                self._collect(wait=False)
        self._last = now
        if self._live and trainer.global_step >= self._next_log:  # one flag elsewhere, one compare on rank 0
            self._report(trainer)

    def _report(self, trainer: L.Trainer) -> None:
        """The live metrics of the intervals since the last report, to every logger (rank 0)."""
        step = trainer.global_step
        self._next_log = (step // self._every + 1) * self._every
        self._collect(wait=False)
        window, self._reported = self.intervals[self._reported:], len(self.intervals)
        metrics: dict[str, float] = dict(self._lrs or {})
        seconds = sum(t for _, t, _ in window)
        if window and seconds > 0:
            rate = sum(n for n, _, _ in window) / seconds
            world = trainer.world_size
            metrics["train/samples_per_sec"] = rate
            metrics["train/device/samples_per_sec"] = rate / world
            metrics["train/step_time"] = seconds / len(window) * trainer.accumulate_grad_batches
            waits = [w for _, _, w in window]
            if all(w is not None for w in waits):
                metrics["train/input_wait_fraction"] = min(1.0, sum(waits) / seconds)
            if self._peak and self.flops_per_sample is None and self.count_flops and self.example is not None:
                self.flops_per_sample = self.count_flops(self.example) or 0
                self._last = None  # the count's own time is no step time
            if self._peak and self.flops_per_sample:
                device_flops = self.flops_per_sample * rate / world
                metrics["train/device/flops_per_sec"] = device_flops
                metrics["train/device/mfu"] = device_flops / self._peak
        if metrics:
            log_unsaved(trainer, metrics)
            self._unsaved = True

    def _save(self, trainer: L.Trainer) -> None:
        """Save every logger once after a report (a no-op for the CSV writers once Lightning has saved them)."""
        if self._unsaved:
            self._unsaved = False
            for logger in trainer.loggers:
                logger.save()

    def _clock(self, trainer: L.Trainer) -> StepClock:
        if self.clock is None:  # a batch hook before on_train_start (a subclass, or a test driving hooks)
            self.clock = StepClock(trainer.strategy.root_device)
            self._world = trainer.world_size
        return self.clock

    def _collect(self, wait: bool) -> None:
        """Move the intervals whose end the device has reached (all of them with ``wait``) to ``intervals``."""
        clock = self.clock
        if clock is None:
            return
        while self._pending:
            samples, start, end, waited = self._pending[0]
            seconds = clock.seconds(start, end, wait=wait)
            if seconds is None:
                break  # later marks are later on the stream: not reached either
            self._pending.popleft()
            self.intervals.append((samples, seconds, waited))
        if self._first is not None:
            seconds = clock.seconds(*self._first, wait=wait)
            if seconds is not None:
                self._first_step, self._first = seconds, None

    @property
    def first_step_s(self) -> float | None:
        """Seconds of the fit's first batch (with --compile, its compilation); device time on CUDA."""
        self._collect(wait=True)
        return self._first_step

    def _steady(self) -> list[tuple[int, float, float | None]]:
        self._collect(wait=True)
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



def log_unsaved(trainer: L.Trainer, metrics: dict[str, float]) -> None:
    """Lightning's ``_LoggerConnector.log_metrics`` (ThroughputMonitor's path: ``trainer.logged_metrics``, every
    logger, at the step of this step's train_loss, with the epoch), less its ``logger.save()`` per call."""
    reach.record_logged_metrics(trainer, metrics)
    scalars: dict[str, float] = {**metrics}
    scalars.setdefault("epoch", trainer.current_epoch)
    step = reach.batches_that_stepped(trainer)
    for logger in trainer.loggers:
        logger.log_metrics(metrics=scalars, step=step)


def learning_rates(trainer: L.Trainer) -> dict[str, float]:
    """The first optimizer's LRs: ``train/lr`` is the first group's, or, in a fine-tuning split (groups named
    ``backbone`` / ``head``), the first head group's (the run's ``--lr``; the backbone's is a multiple of it);
    the other groups as ``train/lr/<name>`` (their ``name``, one metric per name) or ``train/lr/pg<i>``."""
    groups = trainer.optimizers[0].param_groups if trainer.optimizers else []
    # a tensor LR would be a device read
    found = [(i, g.get("name"), float(g["lr"])) for i, g in enumerate(groups) if isinstance(g.get("lr"), int | float)]
    if not found:
        return {}
    main = next((f for f in found if f[1] != "backbone"), found[0])
    lrs = {"train/lr": main[2]}
    for i, name, lr in found:
        if i != main[0] and not (name is not None and name == main[1]):
            lrs.setdefault(f"train/lr/{name}" if isinstance(name, str) and name else f"train/lr/pg{i}", lr)
    return lrs


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


class BatchFitsData(Callback):
    """Fails every rank before the first step when the per-device batch is larger than a rank's share of the
    training data (:meth:`~ddp_recipes.config.plan.BatchPlan.check_fits`): each epoch would be one short batch,
    while the LR and the reported global batch assume the full one. A loader without a length (a stream) or
    with its own batch sampler is not checked. ``flag``: how the message names the batch setting."""

    def __init__(self, flag: str = "the training DataLoader's batch_size") -> None:
        self.flag = flag

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from ddp_recipes.config.plan import BatchPlan

        loader = trainer.train_dataloader
        batch, sampler = loader_batch_size(loader), getattr(loader, "sampler", None)
        try:
            share = len(sampler) if sampler is not None else None
        except TypeError:  # an iterable dataset's sampler has no length
            share = None
        if batch is None or not share:
            return
        world = trainer.world_size
        plan = BatchPlan(batch, trainer.accumulate_grad_batches, batch * world * trainer.accumulate_grad_batches)
        plan.check_fits(share * world, world, self.flag)

