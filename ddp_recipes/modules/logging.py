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

    torchmetrics' default ``nan_strategy="warn"`` tests ``if nans.any()`` on every update: on CUDA a stream
    stall per training step, before backward is queued. Its ``"disable"`` skips the test but also drops
    the ``weight`` (torchmetrics 1.9 replaces it by ones), which would make a short last batch count as
    much as a full one. Here NaNs are simply kept: a NaN loss makes the mean NaN, which is what it is.
    A Python-number weight stays a kernel argument (no host-to-device copy either).
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

    ``self.log`` costs about a millisecond of Python per call, as much as a whole MNIST-MLP step, so the
    step value is logged every ``log_every_n_steps`` steps only (when the logger would write it anyway);
    the epoch value is a :class:`SyncFreeMean` updated every step (on the device, no host read) and
    computed once at epoch end, which is one all-reduce over every rank's samples instead of a collective
    per step.
    """

    def __init__(self) -> None:
        super().__init__()
        self.train_loss_epoch = SyncFreeMean()

    def log_train_loss(self, loss: torch.Tensor, batch_size: int) -> None:
        """Call from ``training_step`` with the step's loss and its batch size."""
        loss = loss.detach()
        self.train_loss_epoch.update(loss, weight=batch_size)
        trainer = self._trainer
        # Lightning's own test for "the logger writes this step" (log_every_n_steps, counted in optimizer
        # steps); logging on other steps would only be overwritten. Not prog_bar: Lightning would read a bar
        # value from the device at every batch end; the pack's bar (train.progress) shows the logger's float.
        if logs_this_step(trainer):
            self.log("train_loss", loss, on_step=True, on_epoch=False, prog_bar=False, batch_size=batch_size)

    @override
    def on_train_epoch_end(self) -> None:
        if self.train_loss_epoch.update_count:
            # compute() is the mean over every rank's samples already. sync_dist with "max" (of equal values:
            # exact) is one small all-reduce per epoch, and tells Lightning the value is synced: logged as
            # unsynced it would warn "use sync_dist=True" on every distributed run.
            self.log("train_loss_epoch", self.train_loss_epoch.compute(), on_step=False, on_epoch=True,
                     sync_dist=True, reduce_fx="max")
        self.train_loss_epoch.reset()
