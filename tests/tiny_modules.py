"""The suite's tiny LightningModules and their in-memory data: the only model definitions the tests share.

* ``TinyNet``: a user's own plain LightningModule (no class of the pack's), a linear layer or a
  Linear -> norm -> activation -> dropout -> Linear stack on random rows, SGD. A test that needs a probe
  (a signal, a recorded value) subclasses it and adds only that hook.
* ``TinyClassifier``: the pack's ``ImageClassifier`` at its smallest, for what needs its optimizer,
  schedule and metrics (EMA, the reference schedules).

Scenario scripts import this module in every rank they launch, so it stays cheap to import and its
parameter names stay put: tests and the pack's messages name them (``body.1`` is the norm, ``aux_head``).
"""

from __future__ import annotations

from typing import Literal

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from ddp_recipes.data.base import SplitDataModule
from ddp_recipes.modules.classifier import ImageClassifier

FEATURES, CLASSES = 8, 3  # TinyClassifier's input width and classes, and its data's


def mlp(features: int, classes: int, hidden: int | None = None, *, batchnorm: bool = False,
        activation: Literal["relu", "tanh"] | None = None, dropout: float = 0.0) -> nn.Sequential:
    """One Linear without ``hidden``; else Linear -> BatchNorm or Identity -> activation -> [Dropout] -> Linear.

    The norm's place is kept without BatchNorm so that a parameter's name does not depend on it; layers are
    built in this order so a seed gives the same initial weights as before they were shared.
    """
    if hidden is None:
        return nn.Sequential(nn.Linear(features, classes))
    act = {"relu": nn.ReLU(), "tanh": nn.Tanh(), None: nn.Identity()}[activation]
    norm = nn.BatchNorm1d(hidden) if batchnorm else nn.Identity()
    drop = [nn.Dropout(dropout)] if dropout else []
    return nn.Sequential(nn.Linear(features, hidden), norm, act, *drop, nn.Linear(hidden, classes))


class TinyNet(L.LightningModule):
    """``mlp(...)`` trained with cross-entropy on ``(x, y, ...)`` batches (extra fields, e.g. sample ids, are
    left to a subclass); validation logs ``val_loss`` and ``val_seen`` (samples seen, summed over ranks)."""

    def __init__(self, features: int = 4, classes: int = 2, hidden: int | None = None, *, batchnorm: bool = False,
                 activation: Literal["relu", "tanh"] | None = None, dropout: float = 0.0, aux_head: bool = False,
                 lr: float = 0.1, momentum: float = 0.0) -> None:
        super().__init__()
        self.body = mlp(features, classes, hidden, batchnorm=batchnorm, activation=activation, dropout=dropout)
        # Never in the loss: the parameter DDP finds without a gradient.
        self.aux_head = nn.Linear(hidden or features, 2) if aux_head else None
        self.lr, self.momentum = lr, momentum

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)

    def training_step(self, batch, batch_idx):
        return nn.functional.cross_entropy(self(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        x, y = batch[0], batch[1]
        self.log("val_loss", nn.functional.cross_entropy(self(x), y), sync_dist=True, batch_size=len(y))
        self.log("val_seen", float(len(y)), reduce_fx="sum", sync_dist=True, batch_size=len(y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)


def tiny_module_and_data(samples: int = 32, batch_size: int = 8) -> tuple[TinyNet, DataLoader]:
    """A user's smallest module (one linear layer, SGD) and a loader of ``samples`` random rows."""
    data = TensorDataset(torch.randn(samples, 4), torch.randint(0, 2, (samples,)))
    return TinyNet(), DataLoader(data, batch_size=batch_size)


class TinyClassifier(ImageClassifier):
    """Linear -> BatchNorm -> ReLU -> Linear: parameters, float buffers and an integer buffer to average."""

    def __init__(self, lr: float = 0.2, momentum: float = 0.9, warmup_epochs: float = 0.0, cosine: bool = False,
                 num_classes: int = CLASSES, width: int = 16) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = self.build_model()
        self.init_metrics()

    def build_model(self) -> nn.Module:
        return mlp(FEATURES, self.hparams.num_classes, self.hparams.width, batchnorm=True, activation="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


def classifier_data(n: int, seed: int = 0) -> TensorDataset:
    """``n`` rows of ``FEATURES`` with a learnable label among ``CLASSES``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, FEATURES, generator=g)
    y = (x[:, :CLASSES].argmax(1) + (x[:, CLASSES] > 0.5).long()) % CLASSES
    return TensorDataset(x, y)


def classifier_loader(n: int, batch: int, seed: int = 0) -> DataLoader:
    return DataLoader(classifier_data(n, seed), batch_size=batch, shuffle=False)


class TensorDataModule(SplitDataModule):
    """The pack's data path (resumable loader, exact evaluation) over given in-memory datasets: a run's own
    loop with no files to read, for measuring and testing the loop itself (validation doubles as test)."""

    def __init__(self, train: Dataset, val: Dataset, batch_size: int, seed: int) -> None:
        super().__init__()
        self.train_set, self.val_set, self.test_set = train, val, val
        self.batch_size, self.seed, self.num_workers, self.pin_memory = batch_size, seed, 0, False
