"""The write-up's MNIST classifier as a LightningModule, with metrics that stay exact under DDP (torchmetrics
sums all-reduced once at epoch end, whatever the shard sizes); the rest is
:class:`~ddp_recipes.modules.classifier.ImageClassifier`'s."""

from __future__ import annotations

import torch
from torch import nn
from typing_extensions import override

from ddp_recipes.config.choices import MNIST_ARCHS
from ddp_recipes.errors import ConfigError
from ddp_recipes.modules.classifier import ImageClassifier

ARCHS = MNIST_ARCHS  # the choice list lives in ddp_recipes.config.choices


class MNISTClassifier(ImageClassifier):
    """SGD classifier over ``[N, 1, 28, 28]`` images; override :meth:`build_model` to change the network
    (and ``loss``, ``param_groups``, ``build_optimizer`` or ``build_metrics`` to change one more thing)."""

    def __init__(self, arch: str = "mlp", lr: float = 0.01, momentum: float = 0.9, weight_decay: float = 0.0,
                 warmup_epochs: float = 0.0, cosine: bool = False, num_classes: int = 10) -> None:
        super().__init__()
        self.save_hyperparameters()
        # Built here, not in setup(): DDP then broadcasts rank 0's weights to identical modules.
        self.model = self.build_model()
        self.init_metrics()

    @override
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
        raise ConfigError(f"{{arch}} must be one of {', '.join(ARCHS)} (got {arch!r})")

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)
