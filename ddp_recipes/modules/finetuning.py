"""Fine-tuning a classifier's backbone: frozen before the DDP wrap, unfrozen at an epoch, its own LR.

A frozen backbone has ``requires_grad=False`` before DDP wraps the model (in none of DDP's gradient buckets, no
``find_unused_parameters`` needed) and its BatchNorm layers in eval mode; at ``unfreeze_at_epoch`` it becomes
trainable and the model is wrapped in DDP again (:func:`~ddp_recipes.ddp.rewrap.rewrap_ddp`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from itertools import chain
from typing import Any

from lightning.pytorch import LightningModule
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from typing_extensions import override

from ddp_recipes.ddp.rewrap import rewrap_ddp
from ddp_recipes.optim.optimizers import split_backbone


def default_backbone(network: nn.Module) -> list[nn.Module]:
    """Every child of ``network`` but the last one with parameters (its classifier)."""
    children = list(network.children())
    with_params = [i for i, child in enumerate(children) if next(child.parameters(), None) is not None]
    return [child for i, child in enumerate(children) if not with_params or i != with_params[-1]]


class BackboneFineTuning(LightningModule):
    """The fine-tuning part of :class:`~ddp_recipes.modules.classifier.ImageClassifier`: what to freeze
    (:meth:`backbone_modules`), when it trains again, and the optimizer's backbone and head groups
    (:meth:`optimizer_groups`). Expects ``self.model`` and :meth:`param_groups` from the classifier."""

    #: Whether the backbone is frozen now (``freeze_backbone``, until ``unfreeze_at_epoch``); saved in checkpoints.
    backbone_frozen: bool = False

    def backbone_modules(self) -> list[nn.Module]:
        """The modules ``freeze_backbone`` freezes and ``backbone_lr_mult`` scales: the one hook for what to
        freeze. By default every child of ``self.model`` but the last one with parameters, its classifier."""
        return default_backbone(self.model)

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
    def train(self, mode: bool = True) -> BackboneFineTuning:
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
        super().setup(stage)
        if self.hparams.get("freeze_backbone") and not getattr(self, "_freeze_applied", False):
            self._freeze_applied = True
            self.set_backbone_frozen(True)

    def _unfreeze_epoch(self) -> int | None:
        epoch = self.hparams.get("unfreeze_at_epoch")
        return None if epoch is None or not self.hparams.get("freeze_backbone") else int(epoch)

    @override
    def on_train_epoch_start(self) -> None:
        super().on_train_epoch_start()
        self._unfreeze_if_due()

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # Resumed from a checkpoint saved at the last batch of the epoch before the switch, Lightning starts the
        # next epoch as a restart with no on_train_epoch_start: the switch is also checked before each batch.
        super().on_train_batch_start(batch, batch_idx)
        if self.backbone_frozen:
            self._unfreeze_if_due()

    def _unfreeze_if_due(self) -> None:
        epoch = self._unfreeze_epoch()
        if self.backbone_frozen and epoch is not None and self.current_epoch >= epoch:
            # Re-wrapping, not "LR 0 while frozen": a zero LR would all-reduce the frozen part's gradients every
            # step and let momentum collect them, to be applied at the switch.
            self.set_backbone_frozen(False)
            rewrapped = rewrap_ddp(self.trainer.strategy)
            if self.trainer.is_global_zero:
                n = sum(p.numel() for m in self.backbone_modules() for p in m.parameters())
                print(f"epoch {self.current_epoch}: backbone unfrozen ({n:,} parameters now trained"
                      f"{', DDP wrapped again' if rewrapped else ''})", flush=True)

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        if self.hparams.get("freeze_backbone"):
            checkpoint["backbone_frozen"] = self.backbone_frozen

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Lightning calls this after setup() and before the DDP wrap: a checkpoint saved after the switch
        # resumes with the backbone trainable from the first step, wrapped once.
        super().on_load_checkpoint(checkpoint)
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
        """:meth:`param_groups`, split into backbone and head groups when fine-tuning; otherwise exactly
        :meth:`param_groups`. A backbone frozen until ``unfreeze_at_epoch`` joins the optimizer from the start, so
        the groups never change mid-run (torch's optimizers skip a parameter whose ``grad`` is None)."""
        hp = self.hparams
        mult = float(hp.get("backbone_lr_mult", 1.0))
        if not hp.get("freeze_backbone") and mult == 1.0:
            return self.param_groups()
        with self._with_backbone_trainable(self._unfreeze_epoch() is not None):
            groups = self.param_groups()
        return split_backbone(groups, self._backbone_tensors(), float(hp.lr), mult)
