"""Training-loss logging that costs no device-to-host read per step, and the mean metric behind it."""

from __future__ import annotations

import torch
from lightning import LightningModule
from torch import Tensor
from torchmetrics import MeanMetric
from typing_extensions import override

from ddp_recipes.lightning_seam.reach import logs_this_step


class SyncFreeMean(MeanMetric):
    """A (weighted) ``MeanMetric`` whose ``update`` never reads the device from the host.

    torchmetrics' default ``nan_strategy="warn"`` tests ``if nans.any()`` on every update: a CUDA stream stall per
    step. Its ``"disable"`` also drops the ``weight`` (torchmetrics 1.9), so a short last batch would count as much
    as a full one. Here NaNs are kept: a NaN loss makes the mean NaN.
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(nan_strategy="disable", **kwargs)

    @override
    def update(self, value: float | Tensor, weight: float | Tensor | None = None) -> None:
        value = torch.as_tensor(value, device=self.device).to(self.dtype)  # a tensor already there: no copy
        if weight is None or isinstance(weight, int | float):
            w = 1.0 if weight is None else float(weight)
            self.mean_value += value.sum() * w
            self.weight += w * value.numel()
            return
        weight = torch.broadcast_to(torch.as_tensor(weight, device=self.device).to(self.dtype), value.shape)
        self.mean_value += (value * weight).sum()
        self.weight += weight.sum()


class TrainLossLogging(LightningModule):
    """Logs ``train_loss`` (this rank's step value) and ``train_loss_epoch`` (mean over all ranks' samples).

    ``self.log`` costs about a millisecond per call, a whole MNIST-MLP step, so the step value is logged only
    when the logger writes it; the epoch value is a :class:`SyncFreeMean` computed once at epoch end.
    """

    def __init__(self) -> None:
        super().__init__()
        self.train_loss_epoch = SyncFreeMean()

    def log_train_loss(self, loss: torch.Tensor, batch_size: int) -> None:
        """Call from ``training_step`` with the step's loss and its batch size."""
        loss = loss.detach()
        self.train_loss_epoch.update(loss, weight=batch_size)
        trainer = self._trainer
        # Lightning's own test for "the logger writes this step". Not prog_bar: Lightning would read a bar value
        # from the device at every batch end; the pack's bar (train.progress) shows the logger's float.
        if logs_this_step(trainer):
            self.log("train_loss", loss, on_step=True, on_epoch=False, prog_bar=False, batch_size=batch_size)

    @override
    def on_train_epoch_end(self) -> None:
        if self.train_loss_epoch.update_count:
            # compute() is the mean over every rank's samples already; sync_dist with "max" (of equal values) keeps
            # Lightning from warning "use sync_dist=True" on every distributed run.
            self.log("train_loss_epoch", self.train_loss_epoch.compute(), on_step=False, on_epoch=True,
                     sync_dist=True, reduce_fx="max")
        self.train_loss_epoch.reset()
