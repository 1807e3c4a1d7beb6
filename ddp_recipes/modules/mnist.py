"""The write-up's MNIST classifier as a LightningModule, with metrics that stay exact under DDP.

Logged metrics are torchmetrics objects: each rank accumulates sums (correct, count, loss*n) and
Lightning calls ``compute()`` at epoch end, which all-reduces those sums. The result is the metric over
the whole evaluation set, whatever the shard sizes, with no collective per step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy
from typing_extensions import override

from ddp_recipes.modules.logging import TrainLossLogging
from ddp_recipes.schedules import lightning_scheduler

ARCHS = ("mlp", "cnn")


class MNISTClassifier(TrainLossLogging):
    """SGD classifier over ``[N, 1, 28, 28]`` images; override :meth:`build_model` to change the network."""

    def __init__(self, arch: str = "mlp", lr: float = 0.01, momentum: float = 0.9, weight_decay: float = 0.0,
                 warmup_epochs: float = 0.0, cosine: bool = False, num_classes: int = 10) -> None:
        super().__init__()
        self.save_hyperparameters()
        # Built here, not in setup(): DDP then broadcasts rank 0's weights to identical modules.
        self.model = self.build_model()
        self.val_loss, self.test_loss = MeanMetric(), MeanMetric()
        self.val_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")
        self.test_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")

    def build_model(self) -> nn.Module:
        """The network, from ``self.hparams``: the one method to override for another architecture."""
        arch, num_classes = self.hparams.arch, self.hparams.num_classes
        if arch == "mlp":  # the write-up's model
            return nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 128), nn.ReLU(), nn.Linear(128, num_classes))
        if arch == "cnn":
            return nn.Sequential(
                nn.Conv2d(1, 32, 3, bias=False), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),  # 32x13x13
                nn.Conv2d(32, 64, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),  # 64x5x5
                nn.Flatten(), nn.Linear(64 * 5 * 5, 128), nn.ReLU(), nn.Linear(128, num_classes),
            )
        raise ValueError(f"--arch must be one of {', '.join(ARCHS)} (got {arch!r})")

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log_train_loss(loss, x.shape[0])
        return loss

    @override
    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "val", self.val_loss, self.val_acc)

    @override
    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "test", self.test_loss, self.test_acc)

    def _evaluate(self, batch: tuple[torch.Tensor, torch.Tensor], prefix: str, loss_metric: MeanMetric,
                  acc_metric: MulticlassAccuracy) -> None:
        x, y = batch
        logits = self(x)
        # Weighted by batch size so a short last batch counts per sample, as in a 1-device run.
        loss_metric.update(F.cross_entropy(logits, y), weight=x.shape[0])
        acc_metric.update(logits, y)
        # Log the Metric objects, not tensors: a per-step sync_dist would deadlock when shards differ
        # in length (ExactDistributedSampler), while compute() at epoch end is one collective per rank.
        self.log(f"{prefix}_loss", loss_metric, on_step=False, on_epoch=True)
        self.log(f"{prefix}_acc", acc_metric, on_step=False, on_epoch=True, prog_bar=True)

    @override
    def configure_optimizers(self):
        # hparams.lr is already the scaled LR: recipes apply scale_lr for the global batch.
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=self.hparams.momentum,
                                    weight_decay=self.hparams.weight_decay)
        scheduler = lightning_scheduler(optimizer, self.trainer, self.hparams.warmup_epochs,
                                        cosine=self.hparams.cosine)
        if scheduler is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": scheduler}
