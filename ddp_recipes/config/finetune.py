"""How a run fine-tunes (:class:`FineTuning`), torch-free: a recipe checks its flags with it before torch loads.
Loading the weights is :mod:`ddp_recipes.modules.pretrained`'s."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ddp_recipes.errors import ConfigError


@dataclass(frozen=True)
class FineTuning:
    """How a run fine-tunes: the weights it starts from, the frozen backbone, its LR and the epoch it thaws at.
    ``__post_init__`` refuses a setting that has no effect, and what the run around it (its stem, its DDP comm
    hook, ``compile``, its epochs) cannot combine with."""

    weights: str | None = None
    """Pretrained weights: a torchvision weights name or a local state-dict file."""
    freeze_backbone: bool = False
    """Train only the classifier."""
    backbone_lr_mult: float = 1.0
    """The backbone's LR as a multiple of the classifier's, > 0."""
    unfreeze_at_epoch: int | None = None
    """With ``freeze_backbone``: train the backbone too from this epoch (>= 1) on."""
    cifar_stem: bool | None = None
    """The run's stem as asked (True: the CIFAR stem, which loads none of the weights' stem)."""
    comm_hook: str = "none"
    """The run's DDP comm hook (PowerSGD's error feedback is laid out by the gradient buckets)."""
    compile: bool = False
    """Whether the run is compiled (thawing wraps the model in DDP again)."""
    max_epochs: int | None = None
    """The run's epochs (None or <= 0: unbounded)."""

    def __post_init__(self) -> None:
        freeze, mult, epoch = self.freeze_backbone, self.backbone_lr_mult, self.unfreeze_at_epoch
        if not (math.isfinite(mult) and mult > 0):
            raise ConfigError(f"{{backbone_lr_mult}} must be > 0 (got {mult}); to train no backbone parameter, pass "
                              "{freeze_backbone}")
        if epoch is not None and not freeze:
            raise ConfigError("{unfreeze_at_epoch} unfreezes a frozen backbone; add {freeze_backbone}")
        if epoch is not None and (isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 1):
            raise ConfigError(f"{{unfreeze_at_epoch}} must be an epoch >= 1 (got {epoch}); without it the backbone "
                              "stays frozen")
        if freeze and epoch is None and mult != 1.0:
            raise ConfigError("{backbone_lr_mult} has no effect on a backbone frozen for the whole run; add "
                              "{unfreeze_at_epoch} or drop {backbone_lr_mult}")
        if self.weights and self.cifar_stem:
            raise ConfigError("{cifar_stem} replaces the stem the {weights} were trained with (and loads none of "
                              "it); drop {cifar_stem}: with {weights} the default is the pretrained stem")
        if epoch is not None:
            self._check_thaw(epoch)

    def _check_thaw(self, epoch: int) -> None:
        if self.comm_hook == "powersgd":
            raise ConfigError("{unfreeze_at_epoch} rebuilds DDP's gradient buckets, which PowerSGD's error "
                              "feedback is laid out by; use {comm_hook} none, fp16 or bf16")
        if self.compile:
            raise ConfigError("{unfreeze_at_epoch} wraps the model in DDP again mid-run, which is not supported "
                              "under {compile} yet; drop {compile} or {unfreeze_at_epoch}")
        epochs = self.max_epochs
        if epochs is not None and epochs > 0 and epoch >= epochs:
            raise ConfigError(f"{{unfreeze_at_epoch}} {epoch} is never reached: the run has "
                              f"{epochs} epochs (0..{epochs - 1}); lower it or raise {{max_epochs}}")

    @classmethod
    def of(cls, hp: Mapping[str, Any]) -> FineTuning:
        """The fine-tuning settings of a module's hyper-parameters (missing ones: the defaults)."""
        return cls(freeze_backbone=hp.get("freeze_backbone", False), backbone_lr_mult=hp.get("backbone_lr_mult", 1.0),
                   unfreeze_at_epoch=hp.get("unfreeze_at_epoch"))

    @property
    def fine_tunes(self) -> bool:
        """Whether the run fine-tunes (``summary.json`` then has a ``fine_tuning`` record)."""
        return bool(self.weights or self.freeze_backbone or self.backbone_lr_mult != 1.0)
