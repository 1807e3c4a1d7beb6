"""The training, evaluation and optimizer code both recipe modules share, as small overridable hooks.

A subclass changes one thing by overriding one method (docs/bring-your-own-model.md's table) and keeps everything
the recipes add (LR scaling and schedule, DDP-exact metrics, checkpoints, resume).
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from torchmetrics import Metric
from torchmetrics.classification import MulticlassAccuracy
from typing_extensions import override

# Registers "tuned_ddp" in Lightning's strategy registry: a LightningCLI run that names one of the pack's
# modules (--model ddp_recipes.MNISTClassifier --trainer.strategy tuned_ddp) imports nothing else of the pack.
import ddp_recipes.ddp.strategy  # noqa: F401
from ddp_recipes.config.schedule import ReferenceSchedule
from ddp_recipes.data.augment import batch_mixer
from ddp_recipes.errors import ConfigError
from ddp_recipes.modules.ema_evaluation import EMAEvaluation
from ddp_recipes.modules.finetuning import BackboneFineTuning
from ddp_recipes.modules.logging import SyncFreeMean, TrainLossLogging
from ddp_recipes.optim.optimizers import build_optimizer
from ddp_recipes.optim.schedules import lightning_reference_scheduler, lightning_scheduler

STAGES = ("val", "test")


class ImageClassifier(BackboneFineTuning, EMAEvaluation, TrainLossLogging):
    """An ``(x, y)`` classifier: cross-entropy, SGD, top-1 (and top-5) accuracy exact under DDP. Concrete classes
    call ``save_hyperparameters()``, build ``self.model = self.build_model()`` and then :meth:`init_metrics`."""

    #: The logged metric ``best.ckpt`` keeps the maximum of (it must be one of ``build_metrics``' names).
    monitor: ClassVar[str] = "val_acc"
    #: Whether :meth:`loss` takes class-probability targets ``[B, classes]`` (what MixUp/CutMix give). None:
    #: yes for the default loss, no for an overridden one until the class says ``soft_targets = True``.
    soft_targets: ClassVar[bool | None] = None

    @classmethod
    def takes_soft_targets(cls) -> bool:
        if cls.soft_targets is not None:
            return bool(cls.soft_targets)
        return cls.loss is ImageClassifier.loss

    def build_model(self) -> nn.Module:
        """The network, from ``self.hparams``: the one method to override for another architecture."""
        raise NotImplementedError(f"{type(self).__name__} must implement build_model()")

    # ---- hooks ---------------------------------------------------------------------------------------

    def loss(self, logits: torch.Tensor, target: torch.Tensor, stage: str) -> torch.Tensor:
        """Mean loss of a batch. Label smoothing applies in training only, so ``val_loss`` stays plain
        cross-entropy and compares across ``--label-smoothing`` values."""
        smoothing = float(self.hparams.get("label_smoothing", 0.0)) if stage == "train" else 0.0
        return F.cross_entropy(logits, target, label_smoothing=smoothing)

    def param_groups(self) -> list[dict]:
        """The optimizer's parameter groups; by default one group of every trainable parameter."""
        return [{"params": [p for p in self.parameters() if p.requires_grad]}]

    def build_optimizer(self, param_groups: list[dict]) -> torch.optim.Optimizer:
        """``hparams.optimizer`` (torchvision's ``--opt`` choices; SGD, Nesterov with ``nesterov``, by default)
        at ``self.hparams.lr`` (the LR already scaled for the global batch)."""
        hp = self.hparams
        name = hp.get("optimizer") or ("sgd_nesterov" if hp.get("nesterov", False) else "sgd")
        return build_optimizer(name, param_groups, hp.lr, float(hp.get("momentum", 0.0)),
                               float(hp.get("weight_decay", 0.0)))

    def build_scheduler(self, optimizer: torch.optim.Optimizer) -> dict | None:
        """The ``lr_scheduler`` entry of ``configure_optimizers`` (None: a constant LR). Per optimizer step and
        sized from the trainer, so it is right at any world size, accumulation and run length."""
        hp = self.hparams
        if hp.get("lr_scheduler"):
            return lightning_reference_scheduler(optimizer, self.trainer, ReferenceSchedule.of(hp, hp.warmup_epochs))
        return lightning_scheduler(optimizer, self.trainer, hp.warmup_epochs, cosine=hp.cosine)

    def mix_batch(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """MixUp / CutMix of a training batch (``mixup_alpha``, ``cutmix_alpha``): on each rank, from its own
        random stream. Returns class-probability targets, which :meth:`loss` (``F.cross_entropy``) takes."""
        mixer = self.__dict__.get("_mixer", False)
        if mixer is False:  # built once; kept out of the module tree (no state, nothing for DDP)
            hp = self.hparams
            mixer = batch_mixer(int(hp.num_classes), hp.get("mixup_alpha", 0.0), hp.get("cutmix_alpha", 0.0))
            self.__dict__["_mixer"] = mixer
        return (x, y) if mixer is None else mixer(x, y)

    def build_metrics(self) -> dict[str, Metric]:
        """Evaluation metrics by name, each updated with ``(logits, y)``; by default top-1 accuracy, ``micro``:
        the fraction of samples right, as papers report it (torchmetrics' default averages classes)."""
        return {"acc": MulticlassAccuracy(num_classes=int(self.hparams.num_classes), average="micro")}

    # ---- the shared steps --------------------------------------------------------------------------

    def init_metrics(self) -> None:
        """One fresh set of :meth:`build_metrics` per evaluation stage, plus the loss means."""
        metrics = self.build_metrics()
        if "loss" in metrics:
            raise ConfigError(f"{type(self).__name__}.build_metrics() returns a metric named 'loss', which would be "
                              "logged as val_loss twice (the loss is logged already); rename it")
        self.val_loss, self.test_loss = SyncFreeMean(), SyncFreeMean()  # no host read per batch
        self.val_metrics = nn.ModuleDict(metrics)
        self.test_metrics = nn.ModuleDict(self.build_metrics())
        names = [f"val_{name}" for name in self.val_metrics] + ["val_loss"]
        if self.monitor not in names:
            # A class-level mistake, caught at construction even without validation: best.ckpt would fail later.
            raise ConfigError(f"{type(self).__name__}.monitor is {self.monitor!r} but its validation metrics are "
                              f"{', '.join(names)}; set monitor = one of them on the class")

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = self.mix_batch(*batch)
        loss = self.loss(self(x), y, "train")
        self.log_train_loss(loss, x.shape[0])
        return loss

    @override
    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "val")

    @override
    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def _evaluate(self, batch: tuple[torch.Tensor, torch.Tensor], stage: str) -> None:
        x, y = batch
        logits = self(x)
        loss_metric: SyncFreeMean = getattr(self, f"{stage}_loss")
        # Weighted by batch size so a short last batch counts per sample, as in a 1-device run.
        loss_metric.update(self.loss(logits, y, stage), weight=x.shape[0])
        self.log(f"{stage}_loss", loss_metric, on_step=False, on_epoch=True)
        # Metric objects, not tensors: compute() all-reduces the sums once at epoch end, which stays exact
        # (and deadlock-free) with the unequal shards of ExactDistributedSampler; a per-step sync_dist would not.
        for name, metric in getattr(self, f"{stage}_metrics").items():
            metric.update(logits, y)
            self.log(f"{stage}_{name}", metric, on_step=False, on_epoch=True, prog_bar=name == "acc")
        ema = self._ema_network()
        if ema is not None:
            self._evaluate_ema(ema, x, y, stage)

    @override
    def configure_optimizers(self):
        optimizer = self.build_optimizer(self.optimizer_groups())
        lrs = [group["lr"] for group in optimizer.param_groups]
        if self.hparams.lr not in lrs:
            # Legitimate for a fixed-LR optimizer, but then --lr and --lr-scaling are silently ignored.
            rank_zero_warn(f"{type(self).__name__}.build_optimizer() put no parameter group at self.hparams.lr "
                           f"({self.hparams.lr:g}, the LR scaled for the global batch; groups have {lrs}): --lr and "
                           "--lr-scaling have no effect on it")
        scheduler = self.build_scheduler(optimizer)
        if scheduler is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": scheduler}
