"""Validation and test of the EMA network: with a :class:`~ddp_recipes.optim.ema.ModelEMA` callback attached,
every evaluation batch also runs through the averaged weights, and each metric is logged again with an
``_ema`` suffix (``val_acc_ema``, ``val_loss_ema``)."""

from __future__ import annotations

from itertools import chain

import torch
from lightning.pytorch import LightningModule
from torch import nn

from ddp_recipes.modules.logging import SyncFreeMean
from ddp_recipes.optim.ema import ModelEMA


class EMAEvaluation(LightningModule):
    """The EMA part of :class:`~ddp_recipes.modules.classifier.ImageClassifier`: the classifier's evaluation
    step calls :meth:`_evaluate_ema` after its own metrics. Expects ``self.model``, ``loss`` and ``build_metrics``
    from the classifier."""

    def _ema_network(self) -> nn.Module | None:
        """The averaged copy of ``self.model`` held by an attached ``ModelEMA`` callback, or None."""
        trainer = self._trainer
        for callback in trainer.callbacks if trainer is not None else ():
            if isinstance(callback, ModelEMA) and callback.network is not None:
                return callback.network
        return None

    def forward_ema(self, network: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``self(x)`` with ``self.model``'s weights and buffers replaced by ``network``'s (an EMA copy of it).

        Runs this module's own ``forward`` (channels-last, any override), nothing swapped for good.
        """
        tensors = {f"model.{name}": t for name, t in chain(network.named_parameters(), network.named_buffers())}
        return torch.func.functional_call(self, tensors, (x,), strict=False)

    def _evaluate_ema(self, network: nn.Module, x: torch.Tensor, y: torch.Tensor, stage: str) -> None:
        """Update and log the ``_ema`` metrics of ``stage`` with ``network``'s logits of the batch."""
        self._log_ema(self.forward_ema(network, x), y, stage)

    def _ema_metrics(self, stage: str, device: torch.device) -> tuple[SyncFreeMean, nn.ModuleDict]:
        """The ``_ema`` twins of the stage's metrics, made on first use: a module or checkpoint of a run
        without EMA never has them, and their states stay out of checkpoints (non-persistent)."""
        name = f"{stage}_metrics_ema"
        if not hasattr(self, name):
            loss, metrics = SyncFreeMean(), nn.ModuleDict(self.build_metrics())
            for metric in (loss, *metrics.values()):
                metric.persistent(False)
            setattr(self, f"{stage}_loss_ema", loss.to(device))
            setattr(self, name, metrics.to(device))
        return getattr(self, f"{stage}_loss_ema"), getattr(self, name)

    # Eager under --compile: dynamo would otherwise specialise self.log on every metric name, and the EMA's
    # names push it past its recompile limit (a warning per run). Updating a few metrics costs nothing.
    @torch.compiler.disable
    def _log_ema(self, logits: torch.Tensor, y: torch.Tensor, stage: str) -> None:
        loss_metric, metrics = self._ema_metrics(stage, logits.device)
        loss_metric.update(self.loss(logits, y, stage), weight=y.shape[0])
        # metric_attribute: made after Lightning indexed the module's metrics, so name them.
        self.log(f"{stage}_loss_ema", loss_metric, on_step=False, on_epoch=True, metric_attribute=f"{stage}_loss_ema")
        for name, metric in metrics.items():
            metric.update(logits, y)
            self.log(f"{stage}_{name}_ema", metric, on_step=False, on_epoch=True,
                     metric_attribute=f"{stage}_metrics_ema.{name}")
