"""The recipe's progress bar: the training loss as the logger wrote it, so no step reads the device for the bar.

A metric logged with ``self.log(..., prog_bar=True)`` at a step is turned into a float by Lightning at every
batch end after its first log (``_LoggerConnector.on_batch_end`` converts the cached progress-bar tensors):
on CUDA one stream stall per step, whatever ``log_every_n_steps`` says. The pack's modules log ``train_loss``
with ``prog_bar=False``; this bar shows the float the first logger was handed at the last log step, which
Lightning had read once already for that logger. A user's own per-step ``prog_bar=True`` metric is named
once, with its cost and the fix.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelSummary, TQDMProgressBar
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from ddp_recipes.lightning_seam import reach

#: The logged values the bar shows (a module may log more; these are the pack's modules' step values).
SHOWN = ("train_loss",)


class LoggedMetricsBar(TQDMProgressBar):
    """``TQDMProgressBar`` that shows ``keys`` from what the trainer's first logger last wrote.

    The values refresh when the logger writes (every ``log_every_n_steps``); with no logger there is nothing
    written, so nothing of these keys is shown. Metrics a module logs with ``prog_bar=True`` are still shown
    as Lightning shows them.
    """

    def __init__(self, refresh_rate: int = 20, keys: tuple[str, ...] = SHOWN, **kwargs: Any) -> None:
        super().__init__(refresh_rate=refresh_rate, **kwargs)
        self.keys = keys
        self.written: dict[str, float] = {}
        self._wrapped: tuple[Any, Any] | None = None
        self._named = False
        self._logged = False  # the logger wrote since the last batch end: look for per-step bar metrics then
        self._next_look = sys.maxsize  # without a logger: the optimizer step to look at next (the log cadence)

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if trainer.loggers and self._wrapped is None:
            logger = trainer.loggers[0]
            original = logger.log_metrics

            def log_metrics(metrics: dict[str, Any], step: int | None = None) -> None:
                # Lightning hands its loggers Python floats (converted once, for every logger): keep ours.
                self.written.update({k: v for k, v in metrics.items() if k in self.keys})
                self._logged = True
                original(metrics, step)

            logger.log_metrics = log_metrics  # an instance attribute: this trainer's logger only
            self._wrapped = (logger, original)

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._wrapped is not None:
            logger, original = self._wrapped
            if logger.__dict__.get("log_metrics") is not original:
                logger.__dict__.pop("log_metrics", None)  # the class's method again
            self._wrapped = None
        super().teardown(trainer, pl_module, stage)

    @override
    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        return {**super().get_metrics(trainer, pl_module), **self.written}

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        # Looked for at each epoch's first batch end, after the logger wrote (Lightning reads a metric from its
        # first log step on; without a logger, at the steps it would have logged) and at epoch ends, until one
        # is named: a dictionary walk, kept off the other steps (one integer compare without a logger).
        if not self._named and (self._logged or batch_idx == 0 or trainer.global_step >= self._next_look):
            self._logged = False
            self._named = name_per_step_bar_metrics(trainer)
            if self._next_look != sys.maxsize:
                self._next_look = self._following_log_step(trainer)
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._next_look = sys.maxsize if self._wrapped is not None else self._following_log_step(trainer)

    @staticmethod
    def _following_log_step(trainer: L.Trainer) -> int:
        every = int(trainer.log_every_n_steps or 0)
        return (trainer.global_step // every + 1) * every if every > 0 else sys.maxsize

    @override
    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self._named:  # a run with no logger: its epochs' metrics
            self._named = name_per_step_bar_metrics(trainer)
        super().on_train_epoch_end(trainer, pl_module)


def per_step_bar_metrics(trainer: L.Trainer) -> list[str]:
    """The training metrics logged with ``on_step=True, prog_bar=True`` so far in this fit (their names)."""
    return sorted({metric.meta.name for metric in reach.epoch_results(trainer)
                   if getattr(metric, "meta", None) is not None and metric.meta.on_step and metric.meta.prog_bar})


def name_per_step_bar_metrics(trainer: L.Trainer) -> bool:
    """Warn (rank 0) naming the per-step progress-bar metrics; whether there were any."""
    names = per_step_bar_metrics(trainer)
    if names:
        listed = ", ".join(f"'{n}'" for n in names)
        rank_zero_warn(f"[per-step-read] {listed} logged with prog_bar=True on every step: Lightning reads it from the "
                       "device at every batch end from its first log on, to draw the bar (on a GPU, a stream stall per "
                       "step). "
                       "Fix: log it with prog_bar=False; the logger still writes it, and "
                       "ddp_recipes.train.progress.LoggedMetricsBar(keys=...) shows what the logger wrote.")
    return bool(names)


class ModelTable(ModelSummary):
    """Lightning's model summary without its "0 Total Flops" line: Lightning counts FLOPs only through a
    module's ``example_input_array``, so for the pack's modules its 0 means "not counted", while the run
    measures ``flops_per_sample`` itself (``summary.json``, and MFU from it)."""

    @staticmethod
    @override
    def summarize(summary_data: list[tuple[str, list[str]]], total_parameters: int, trainable_parameters: int,
                  model_size: float, total_training_modes: dict[str, int], total_flops: int,
                  **summarize_kwargs: Any) -> None:
        if not total_flops:  # the column of zeros too
            summary_data = [(name, values) for name, values in summary_data if name != "FLOPs"]
        table = reach.summary_table(total_parameters, trainable_parameters, model_size, total_training_modes,
                                      total_flops, *summary_data)
        if not total_flops:
            table = table.rsplit("\n", 1)[0]
        logging.getLogger("lightning.pytorch.callbacks.model_summary").info("\n" + table)
