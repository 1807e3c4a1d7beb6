"""Training-loss logging that costs next to nothing per step, shared by the recipe modules."""

from __future__ import annotations

import torch
from lightning import LightningModule
from torchmetrics import MeanMetric
from typing_extensions import override


class TrainLossLogging(LightningModule):
    """Logs ``train_loss`` (this rank's step value) and ``train_loss_epoch`` (mean over all ranks' samples).

    ``self.log`` costs about a millisecond of Python per call, as much as a whole MNIST-MLP step, so the
    step value is logged every ``log_every_n_steps`` steps only (when the logger would write it anyway);
    the epoch value is a MeanMetric updated every step and computed once at epoch end, which is one
    all-reduce over every rank's samples instead of a collective per step.
    """

    def __init__(self) -> None:
        super().__init__()
        self.train_loss_epoch = MeanMetric()

    def log_train_loss(self, loss: torch.Tensor, batch_size: int) -> None:
        """Call from ``training_step`` with the step's loss and its batch size."""
        loss = loss.detach()
        self.train_loss_epoch.update(loss, weight=batch_size)
        trainer = self._trainer
        # Lightning's own test for "the logger writes this step" (log_every_n_steps, counted in optimizer
        # steps); logging on other steps would only be overwritten.
        connector = getattr(trainer, "_logger_connector", None)
        if connector is None or getattr(connector, "should_update_logs", True):
            self.log("train_loss", loss, on_step=True, on_epoch=False, prog_bar=True, batch_size=batch_size)

    @override
    def on_train_epoch_end(self) -> None:
        if self.train_loss_epoch.update_count:
            self.log("train_loss_epoch", self.train_loss_epoch.compute(), on_step=False, on_epoch=True)
        self.train_loss_epoch.reset()
