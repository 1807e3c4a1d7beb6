"""A torchvision ResNet as a LightningModule: the write-up's ImageNet/CIFAR workload, DDP-ready.

What it adds over ``torchvision.models.resnet*``: a CIFAR stem for small images, gradient checkpointing
per stage (``--grad-checkpointing``, the write-up's OOM remedy), channels-last memory format, SGD without
weight decay on BatchNorm and bias parameters, and torchmetrics accuracy that stays exact under DDP.
``arch`` is any torchvision classification model; the CIFAR stem and checkpointing by stage need the ResNet
layout. ``weights`` fine-tunes from pretrained weights (:mod:`ddp_recipes.modules.pretrained`), fetched in
``prepare_data`` and loaded on every rank in ``setup`` with every key and shape checked.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from torchmetrics import Metric
from torchmetrics.classification import MulticlassAccuracy
from typing_extensions import override

from ddp_recipes.config.hparams import check_training_hparams  # torch-free there: checked before torch loads
from ddp_recipes.config.schedule import ReferenceSchedule
from ddp_recipes.data.augment import batch_mixer
from ddp_recipes.errors import ConfigError
from ddp_recipes.modules.architectures import (
    RESNET_FAMILY,
    STAGES,
    STAGES_STRIDE,
    STEM_STRIDE,
    build_arch,
    fit_pretrained,
)
from ddp_recipes.modules.classifier import ImageClassifier
from ddp_recipes.modules.pretrained import PretrainedWeights, fetch_weights, head_keys, read_weights, resolve_weights
from ddp_recipes.optim.optimizers import param_groups


class _KeepBatchNormStats:
    """Undo the BatchNorm running-stat updates of a checkpoint's recompute: re-run in training mode, every
    BatchNorm would take two momentum steps per batch, unlike a run without ``--grad-checkpointing``."""

    def __init__(self, module: nn.Module) -> None:
        self.norms = [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
                      and m.track_running_stats]
        self.saved: list[list[torch.Tensor]] = []

    @staticmethod
    def _buffers(norm: nn.Module) -> tuple[torch.Tensor, ...]:
        return norm.running_mean, norm.running_var, norm.num_batches_tracked

    def __enter__(self) -> None:
        self.saved = [[b.clone() for b in self._buffers(n)] for n in self.norms]

    def __exit__(self, *exc: object) -> None:
        with torch.no_grad():
            for norm, saved in zip(self.norms, self.saved, strict=True):
                for buffer, value in zip(self._buffers(norm), saved, strict=True):
                    buffer.copy_(value)
        self.saved = []


def _keep_batchnorm_stats(stage: nn.Module) -> tuple[contextlib.nullcontext, _KeepBatchNormStats]:
    """The eager checkpoint ``context_fn``: nothing around the forward, the BN-stat restore around the recompute."""
    return contextlib.nullcontext(), _KeepBatchNormStats(stage)


class ResNetClassifier(ImageClassifier):
    """A torchvision image classifier (ResNet family by default) trained with SGD; override :meth:`build_model`
    for another network. ``lr`` is used as given: recipes pass it already scaled for the global batch."""

    def __init__(self, arch: str = "resnet18", num_classes: int = 10, cifar_stem: bool = False,
                 lr: float = 0.1, momentum: float = 0.9, nesterov: bool = False, weight_decay: float = 5e-4,
                 label_smoothing: float = 0.0, warmup_epochs: float = 0.0, cosine: bool = True,
                 channels_last: bool = False, grad_checkpointing: bool = False, dropout: float = 0.0,
                 optimizer: str | None = None, norm_weight_decay: float = 0.0, bias_weight_decay: float = 0.0,
                 lr_scheduler: str | None = None, lr_step_size: int = ReferenceSchedule.lr_step_size,
                 lr_gamma: float = ReferenceSchedule.lr_gamma, lr_min: float = ReferenceSchedule.lr_min,
                 lr_warmup_method: str = ReferenceSchedule.lr_warmup_method,
                 lr_warmup_decay: float = ReferenceSchedule.lr_warmup_decay, mixup_alpha: float = 0.0,
                 cutmix_alpha: float = 0.0, weights: str | None = None, freeze_backbone: bool = False,
                 backbone_lr_mult: float = 1.0, unfreeze_at_epoch: int | None = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self._check_hparams()
        # Resolved (not read) now: a bad name fails at construction; the file is fetched in prepare_data.
        self.pretrained: PretrainedWeights | None = resolve_weights(arch, weights) if weights else None
        #: What the run fine-tunes from (weights, new head, schedule), for the set-up print and summary.json.
        self.fine_tuning: dict[str, Any] = {}
        # Built here, not in setup(): every rank builds the same module and DDP broadcasts rank 0's weights.
        self.model = self.build_model()
        if grad_checkpointing:
            missing = [n for n in ("conv1", "bn1", "relu", "maxpool", *STAGES, "avgpool", "fc")
                       if not hasattr(self.model, n)]
            if missing:
                raise ConfigError(f"{{grad_checkpointing}} needs a torchvision-style ResNet; build_model() "
                                 f"returned a {type(self.model).__name__} without {', '.join(missing)}")
        if channels_last:
            # NHWC lets cuDNN use tensor-core convolution kernels without transposes under AMP.
            self.model = self.model.to(memory_format=torch.channels_last)
        self.init_metrics()

    def _check_hparams(self) -> None:
        hp = self.hparams
        if hp.num_classes < 1:
            raise ConfigError(f"{{num_classes}} must be >= 1 (got {hp.num_classes})")
        if hp.lr <= 0:
            raise ConfigError(f"{{lr}} must be > 0 (got {hp.lr})")
        check_training_hparams(hp)
        if hp.get("mixup_alpha", 0.0) or hp.get("cutmix_alpha", 0.0):
            batch_mixer(hp.num_classes, hp.get("mixup_alpha", 0.0), hp.get("cutmix_alpha", 0.0))  # checks them

    @override
    def build_metrics(self) -> dict[str, Metric]:
        """Top-1 and, from 5 classes up, top-5 accuracy (``val_acc``, ``val_acc5``; top-5 of fewer classes
        is always 1.0)."""
        metrics = super().build_metrics()
        if self.hparams.num_classes >= 5:
            metrics["acc5"] = MulticlassAccuracy(num_classes=self.hparams.num_classes, top_k=5, average="micro")
        return metrics

    @override
    def build_model(self) -> nn.Module:
        """The network, from ``self.hparams``: the one method to override for another architecture."""
        hp = self.hparams
        return build_arch(hp.arch, hp.num_classes, bool(hp.cifar_stem), float(hp.get("dropout", 0.0)),
                          pretrained=bool(hp.get("weights")))

    @staticmethod
    def min_image_size(cifar_stem: bool) -> int:
        """The smallest input side for which a ResNet's layer4 feature map covers >= 1x1 real pixels: below it
        the last stages convolve zero padding, and training runs on, learning nothing there."""
        return STEM_STRIDE[bool(cifar_stem)] * STAGES_STRIDE

    @classmethod
    def check_image_size(cls, image_size: int, cifar_stem: bool) -> None:
        """Raise a ``ValueError`` naming the flags when ``image_size`` is too small for a ResNet's stem."""
        need = cls.min_image_size(cifar_stem)
        if image_size >= need:
            return
        if cifar_stem:
            raise ConfigError(f"{{image_size}} {image_size} is too small even with {{cifar_stem}}: the network "
                             f"downsamples {need}x, so it needs >= {need} px")
        raise ConfigError(f"{{image_size}} {image_size} is too small for the ImageNet stem (the network "
                         f"downsamples {need}x, so it needs >= {need} px): use {{cifar_stem}} (>= "
                         f"{cls.min_image_size(True)} px) or larger images")

    @override
    def prepare_data(self) -> None:
        """Fetch ``weights`` into torch's hub cache: Lightning runs this on local rank 0 of each node only."""
        if self.pretrained is not None:
            fetch_weights(self.pretrained)

    def load_weights(self) -> None:
        """Load ``weights`` into ``self.model`` (every rank, the same file): the classifier is kept fresh when
        its shape differs (``num_classes``); any other difference fails in one line."""
        weights = self.pretrained
        own_network = type(self).build_model is ResNetClassifier.build_model
        report = fit_pretrained(self.model, read_weights(weights), head_keys(self.model, self.backbone_modules()),
                                weights.name, self.hparams.arch if own_network else None)
        self.fine_tuning.update(weights=weights.name, loaded_tensors=report.loaded, new_head=report.replaced)
        if self._trainer is None or self.trainer.is_global_zero:
            where = f" ({weights.cache_file})" if weights.cache_file is not None else ""
            print(f"weights          {weights.name}{where}: {report.describe()}", flush=True)

    @override
    def setup(self, stage: str) -> None:
        if stage == "fit" and self.pretrained is not None and not getattr(self, "_weights_loaded", False):
            self._weights_loaded = True  # once: a second fit() continues from the trained weights
            self.load_weights()
        super().setup(stage)  # freezing (BackboneFineTuning), after the weights
        hp = self.hparams
        if stage == "fit" and hp.get("freeze_backbone"):
            epoch = self._unfreeze_epoch()
            self.fine_tuning.update(freeze_backbone=True, unfreeze_at_epoch=epoch)
            if self.trainer.is_global_zero:
                until = (f"until epoch {epoch}, then trained at LR x {hp.get('backbone_lr_mult', 1.0):g}" if epoch
                         else "for the whole run")
                print(f"backbone         frozen {until} (BatchNorm in eval mode; outside SyncBN and DDP's gradient "
                      "buckets)", flush=True)
        # Every rank checks, so a bad flag fails loudly everywhere instead of training on padding.
        datamodule = getattr(self.trainer, "datamodule", None)
        image_size = getattr(datamodule, "image_size", None)
        if (isinstance(image_size, int) and type(self).build_model is ResNetClassifier.build_model
                and self.hparams.arch in RESNET_FAMILY):
            self.check_image_size(image_size, self.hparams.cifar_stem)
        num_classes = getattr(datamodule, "num_classes", None)
        if isinstance(num_classes, int) and num_classes != self.hparams.num_classes:
            raise ConfigError(f"the data has {num_classes} classes but the model was built with "
                             f"num_classes={self.hparams.num_classes}")

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.hparams.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        if self.hparams.grad_checkpointing and self.training and torch.is_grad_enabled():
            return self._checkpointed_forward(x)
        return self.model(x)

    def _checkpointed_forward(self, x: torch.Tensor) -> torch.Tensor:
        """torchvision's ``ResNet._forward_impl``, keeping only each stage's input for backward (one extra forward
        per stage). ``use_reentrant=False``: works under DDP without ``static_graph``."""
        m = self.model
        x = m.maxpool(m.relu(m.bn1(m.conv1(x))))  # the stem is cheap in memory: run it normally
        compiling = torch.compiler.is_compiling()
        for name in STAGES:
            stage = getattr(m, name)
            if compiling:
                # Under torch.compile the recompute is the partitioner's: BatchNorm's statistics are updated once,
                # nothing to undo (and dynamo takes only a context_fn of two TorchDispatchModes).
                x = checkpoint(stage, x, use_reentrant=False)
            else:
                x = checkpoint(stage, x, use_reentrant=False,
                               context_fn=functools.partial(_keep_batchnorm_stats, stage))
        return m.fc(torch.flatten(m.avgpool(x), 1))

    @override
    def param_groups(self) -> list[dict]:
        """Weight decay on conv/linear weights; ``norm_weight_decay`` and ``bias_weight_decay`` (default 0, unlike
        torchvision's reference: decaying them only fights the normalization, Goyal et al. 2017)."""
        hp = self.hparams
        return param_groups(self, hp.weight_decay, hp.get("norm_weight_decay", 0.0), hp.get("bias_weight_decay", 0.0))
