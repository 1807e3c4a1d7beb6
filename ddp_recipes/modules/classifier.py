"""The training, evaluation and optimizer code both recipe modules share, as small overridable hooks.

A subclass changes one thing by overriding one method, and keeps everything the recipes add (LR scaling
and schedule, DDP-exact metrics, checkpoints, resume):

==========================  ==========================================================================
``build_model()``           the network (called once in ``__init__``; read ``self.hparams``)
``loss(logits, y, stage)``  the loss of a batch; ``stage`` is ``"train"``, ``"val"`` or ``"test"``; with
                            MixUp/CutMix ``y`` is class probabilities in training (set ``soft_targets = True``)
``param_groups()``          the optimizer's parameter groups (e.g. no weight decay on norms and biases)
``build_optimizer(groups)`` the optimizer; use ``self.hparams.lr``, which is already scaled for the
                            global batch (default: ``hparams.optimizer``, SGD unless set)
``build_scheduler(opt)``    the LR schedule's ``configure_optimizers`` entry (default: warm-up + cosine, or
                            torchvision's ``lr_scheduler`` when the hparams name one)
``mix_batch(x, y)``         the training batch's mixing (default: MixUp/CutMix when ``mixup_alpha`` /
                            ``cutmix_alpha`` are set; targets become class probabilities)
``build_metrics()``         evaluation metrics by name: ``{"acc": ...}`` is logged as ``val_acc``/``test_acc``
``backbone_modules()``      what ``freeze_backbone`` freezes and ``backbone_lr_mult`` scales (default: every
                            child of ``self.model`` but its classifier, the last one with parameters)
==========================  ==========================================================================

Fine-tuning, from the hyper-parameters ``freeze_backbone``, ``backbone_lr_mult`` and ``unfreeze_at_epoch``
(all optional): a frozen backbone has ``requires_grad=False`` before DDP wraps the model (so it is in none of
DDP's gradient buckets, and ``find_unused_parameters`` is not needed), its BatchNorm layers stay in eval mode
(running statistics untouched, left out of SyncBatchNorm conversion), and at ``unfreeze_at_epoch`` it becomes
trainable and the model is wrapped in DDP again (:func:`~ddp_recipes.ddp.rewrap.rewrap_ddp`).

With a :class:`~ddp_recipes.optim.ema.ModelEMA` callback attached, validation and test also evaluate the averaged
network on every batch and log each metric again with an ``_ema`` suffix (``val_acc_ema``, ``val_loss_ema``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from itertools import chain
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torchmetrics import Metric
from torchmetrics.classification import MulticlassAccuracy
from typing_extensions import override

# Registers "tuned_ddp" in Lightning's strategy registry: a LightningCLI run that names one of the pack's
# modules (--model ddp_recipes.MNISTClassifier --trainer.strategy tuned_ddp) imports nothing else of the pack.
import ddp_recipes.ddp.strategy  # noqa: F401
from ddp_recipes.config.schedule import ReferenceSchedule
from ddp_recipes.data.augment import batch_mixer
from ddp_recipes.ddp.rewrap import rewrap_ddp
from ddp_recipes.errors import ConfigError
from ddp_recipes.modules.logging import SyncFreeMean, TrainLossLogging
from ddp_recipes.optim.ema import ModelEMA
from ddp_recipes.optim.optimizers import build_optimizer, split_backbone
from ddp_recipes.optim.schedules import lightning_reference_scheduler, lightning_scheduler

STAGES = ("val", "test")


def default_backbone(network: nn.Module) -> list[nn.Module]:
    """Every child of ``network`` but the last one with parameters (its classifier)."""
    children = list(network.children())
    with_params = [i for i, child in enumerate(children) if next(child.parameters(), None) is not None]
    return [child for i, child in enumerate(children) if not with_params or i != with_params[-1]]


class ImageClassifier(TrainLossLogging):
    """An ``(x, y)`` classifier: cross-entropy, SGD, top-1 (and top-5) accuracy exact under DDP.

    Concrete classes call ``save_hyperparameters()``, build ``self.model = self.build_model()`` and then
    :meth:`init_metrics`. Hyper-parameters read here: ``lr``, ``momentum``, ``warmup_epochs``, ``cosine``,
    ``num_classes`` and, when present, ``nesterov``, ``weight_decay``, ``label_smoothing``.
    """

    #: The logged metric ``best.ckpt`` keeps the maximum of (it must be one of ``build_metrics``' names).
    monitor: ClassVar[str] = "val_acc"
    #: Whether :meth:`loss` takes class-probability targets ``[B, classes]`` (what MixUp/CutMix give). None:
    #: yes for the default loss, no for an overridden one until the class says ``soft_targets = True``.
    soft_targets: ClassVar[bool | None] = None

    #: Whether the backbone is frozen now (``freeze_backbone``, until ``unfreeze_at_epoch``); saved in checkpoints.
    backbone_frozen: bool = False

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
        """Evaluation metrics by name, each updated with ``(logits, y)``; by default top-1 accuracy.

        ``micro``: the fraction of samples right, as papers report it (torchmetrics' default averages classes).
        """
        return {"acc": MulticlassAccuracy(num_classes=int(self.hparams.num_classes), average="micro")}

    def backbone_modules(self) -> list[nn.Module]:
        """The modules ``freeze_backbone`` freezes and ``backbone_lr_mult`` scales: the one hook for what to
        freeze. By default every child of ``self.model`` but the last one with parameters, its classifier
        (``fc`` of a ResNet, ``classifier`` of EfficientNet/ConvNeXt/VGG, ``heads`` of ViT, ``head`` of Swin).
        Override it to keep more trainable (e.g. ``[m.conv1, m.bn1, m.layer1, m.layer2]``)."""
        return default_backbone(self.model)

    # ---- fine-tuning: freezing, the unfreeze epoch, the LR of the backbone -------------------------------

    def _backbone_tensors(self) -> set[int]:
        return {id(t) for m in self.backbone_modules() for t in chain(m.parameters(), m.buffers())}

    def _backbone_norms(self) -> list[_BatchNorm]:
        return [n for m in self.backbone_modules() for n in m.modules() if isinstance(n, _BatchNorm)]

    def set_backbone_frozen(self, frozen: bool) -> None:
        """Freeze (``requires_grad=False``, BatchNorm in eval mode) or unfreeze the backbone. Under DDP,
        only before the model is wrapped, or followed by :func:`~ddp_recipes.ddp.rewrap.rewrap_ddp`."""
        for module in self.backbone_modules():
            module.requires_grad_(not frozen)
        self.backbone_frozen = frozen
        for norm in self._backbone_norms():
            norm.train(self.training and not frozen)

    @override
    def train(self, mode: bool = True) -> ImageClassifier:
        # Lightning puts the module in training mode at every epoch start and after each validation: a frozen
        # backbone's BatchNorm must keep normalising with (and never update) the pretrained statistics.
        super().train(mode)
        if mode and self.backbone_frozen:
            for norm in self._backbone_norms():
                norm.eval()
        return self

    @override
    def setup(self, stage: str) -> None:
        # Before the checkpoint restore (which may say the backbone was unfrozen already) and before the DDP
        # wrap, on every rank: the frozen parameters never enter DDP's buckets.
        if self.hparams.get("freeze_backbone") and not getattr(self, "_freeze_applied", False):
            self._freeze_applied = True
            self.set_backbone_frozen(True)

    def _unfreeze_epoch(self) -> int | None:
        epoch = self.hparams.get("unfreeze_at_epoch")
        return None if epoch is None or not self.hparams.get("freeze_backbone") else int(epoch)

    @override
    def on_train_epoch_start(self) -> None:
        self._unfreeze_if_due()

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # Resumed from a checkpoint saved at the last batch of the epoch before the switch (on_train_batch_end:
        # a preemption, or the --checkpoint-every-n-steps cadence), Lightning starts the next epoch as a
        # restart and calls no on_train_epoch_start for it: the switch is also checked before each batch.
        # Every rank restored the same checkpoint, so all of them re-wrap at the same batch. One compare.
        if self.backbone_frozen:
            self._unfreeze_if_due()

    def _unfreeze_if_due(self) -> None:
        epoch = self._unfreeze_epoch()
        if self.backbone_frozen and epoch is not None and self.current_epoch >= epoch:
            # Re-wrapping, not "trainable with LR 0 while frozen": a zero LR would keep the frozen part in
            # DDP's buckets (its gradients computed and all-reduced every step) and let momentum and Adam's
            # moments collect its gradients, to be applied at the switch. Wrapped anew, every rank buckets
            # the same parameters, and a run resumed after the switch wraps identically once.
            self.set_backbone_frozen(False)
            rewrapped = rewrap_ddp(self.trainer.strategy)
            if self.trainer.is_global_zero:
                n = sum(p.numel() for m in self.backbone_modules() for p in m.parameters())
                print(f"epoch {self.current_epoch}: backbone unfrozen ({n:,} parameters now trained"
                      f"{', DDP wrapped again' if rewrapped else ''})", flush=True)

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.hparams.get("freeze_backbone"):
            checkpoint["backbone_frozen"] = self.backbone_frozen

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Lightning calls this after setup() and before the DDP wrap: a checkpoint saved after the switch
        # resumes with the backbone trainable from the first step, wrapped once.
        if self.hparams.get("freeze_backbone") and "backbone_frozen" in checkpoint:
            self.set_backbone_frozen(bool(checkpoint["backbone_frozen"]))

    @contextlib.contextmanager
    def _with_backbone_trainable(self, trainable: bool) -> Iterator[None]:
        frozen = [p for m in self.backbone_modules() for p in m.parameters() if not p.requires_grad]
        if trainable:
            for p in frozen:
                p.requires_grad_(True)
        try:
            yield
        finally:
            for p in frozen if trainable else ():
                p.requires_grad_(False)

    def optimizer_groups(self) -> list[dict]:
        """:meth:`param_groups`, split into backbone and head groups when fine-tuning (``freeze_backbone`` or
        ``backbone_lr_mult``); otherwise exactly :meth:`param_groups`, the group layout that the optimizer state
        of a run without fine-tuning is saved and loaded in.

        A backbone frozen until ``unfreeze_at_epoch`` joins the optimizer from the start, so the groups (and the LR
        schedule's per-group state) never change mid-run: while frozen its parameters have no gradient, and
        torch's optimizers skip a parameter whose ``grad`` is None (no step, no weight decay, no state).
        """
        hp = self.hparams
        mult = float(hp.get("backbone_lr_mult", 1.0))
        if not hp.get("freeze_backbone") and mult == 1.0:
            return self.param_groups()
        with self._with_backbone_trainable(self._unfreeze_epoch() is not None):
            groups = self.param_groups()
        return split_backbone(groups, self._backbone_tensors(), float(hp.lr), mult)

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

    # ---- the EMA network's evaluation (a ModelEMA callback attached) --------------------------------------

    def _ema_network(self) -> nn.Module | None:
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

    def _evaluate_ema(self, network: nn.Module, x: torch.Tensor, y: torch.Tensor, stage: str) -> None:
        self._log_ema(self.forward_ema(network, x), y, stage)

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
