"""Optimizers and weight-decay groups as torchvision's classification reference builds them.

``build_optimizer`` gives the reference's ``--opt`` choices their exact settings (RMSprop with the
TF-style ``eps=0.0316, alpha=0.9``; AdamW without momentum). ``param_groups`` gives normalization
parameters and biases their own weight decay (``--norm-weight-decay``, ``--bias-weight-decay``).
``split_backbone`` gives a fine-tuned network's backbone its own groups and learning rate
(``--backbone-lr-mult``).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torchvision.ops._utils import split_normalization_params

from ddp_recipes.config.choices import OPTIMIZERS, check_choice
from ddp_recipes.config.optim import WITH_MOMENTUM as WITH_MOMENTUM
from ddp_recipes.config.optim import OptimizerArgs
from ddp_recipes.errors import ConfigError

__all__ = ["OPTIMIZERS", "OptimizerArgs", "build_optimizer", "optimizer_state_kind", "param_groups", "split_backbone"]

# OptimizerArgs and WITH_MOMENTUM live in ddp_recipes.config.optim, torch-free: a recipe checks its flags before
# torch loads.


def optimizer_state_kind(name: str | None) -> str:
    """The optimizer whose state a run keeps (None: SGD): SGD with or without Nesterov keep the same state."""
    name = name or "sgd"
    return "sgd" if name == "sgd_nesterov" else name


def param_groups(model: nn.Module, weight_decay: float, norm_weight_decay: float | None = None,
                 bias_weight_decay: float | None = None) -> list[dict]:
    """Parameter groups of ``model``'s trainable parameters, each with its ``weight_decay``.

    ``norm_weight_decay``: the decay of normalization layers' parameters (BatchNorm, LayerNorm, GroupNorm,
    InstanceNorm, LocalResponseNorm); ``bias_weight_decay``: of every parameter named ``bias``, a norm
    layer's included (it wins over the norm rule, as in the reference). None: ``weight_decay``, like the rest.

    Groups, empty ones left out: the other parameters at ``weight_decay`` first, then the norm and bias
    groups (one group when their decays are equal); each in ``model.parameters()`` order. So
    ``norm_weight_decay=0, bias_weight_decay=0`` reproduces ``ResNetClassifier.param_groups`` for a
    torchvision ResNet exactly, group layout included (its optimizer checkpoints stay loadable).
    """
    for name, value in (("weight_decay", weight_decay), ("norm_weight_decay", norm_weight_decay),
                        ("bias_weight_decay", bias_weight_decay)):
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise ConfigError(f"{{{name}}} must be >= 0 (got {value})", name)
    # torchvision's own split (the reference's norm classes, leaf modules only), not a second isinstance walk.
    norm_ids = {id(p) for p in split_normalization_params(model)[0]}
    other: list[nn.Parameter] = []
    special: dict[float, list[nn.Parameter]] = {}  # insertion order: norm's decay first, then bias's
    for value in (norm_weight_decay, bias_weight_decay):
        if value is not None:
            special.setdefault(float(value), [])
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if bias_weight_decay is not None and name.rsplit(".", 1)[-1] == "bias":
            special[float(bias_weight_decay)].append(p)
        elif norm_weight_decay is not None and id(p) in norm_ids:
            special[float(norm_weight_decay)].append(p)
        else:
            other.append(p)
    groups = [{"params": other, "weight_decay": float(weight_decay)}]
    groups += [{"params": params, "weight_decay": value} for value, params in special.items()]
    return [g for g in groups if g["params"]]


def build_optimizer(name: str, param_groups: list[dict] | list[nn.Parameter], lr: float, momentum: float = 0.9,
                    weight_decay: float = 0.0) -> torch.optim.Optimizer:
    """The reference's optimizer ``name`` (one of :data:`OPTIMIZERS`) over ``param_groups``.

    ``weight_decay`` is the default of groups that set none; ``momentum`` is ignored by ``adamw``.
    """
    check_choice("optimizer", name, OPTIMIZERS)
    if not (math.isfinite(lr) and lr > 0):
        raise ConfigError(f"{{lr}} must be a positive number (got {lr})")
    if not 0 <= momentum < 1:
        raise ConfigError(f"{{momentum}} must be in [0, 1) (got {momentum})")
    if not (math.isfinite(weight_decay) and weight_decay >= 0):
        raise ConfigError(f"{{weight_decay}} must be >= 0 (got {weight_decay})")
    if name in ("sgd", "sgd_nesterov"):
        if name == "sgd_nesterov" and momentum == 0:
            raise ConfigError("{optimizer} sgd_nesterov needs {momentum} > 0")
        return torch.optim.SGD(param_groups, lr=lr, momentum=momentum, weight_decay=weight_decay,
                               nesterov=name == "sgd_nesterov")
    if name == "rmsprop":
        # TensorFlow's RMSprop settings, which the reference's MobileNet/EfficientNet recipes were tuned with.
        return torch.optim.RMSprop(param_groups, lr=lr, momentum=momentum, weight_decay=weight_decay,
                                   eps=0.0316, alpha=0.9)
    return torch.optim.AdamW(param_groups, lr=lr, weight_decay=weight_decay)


def split_backbone(groups: list[dict] | list[nn.Parameter], backbone: set[int], lr: float,
                   backbone_lr_mult: float = 1.0) -> list[dict]:
    """Each of ``groups`` split in its backbone part (the parameters whose ``id`` is in ``backbone``) and the
    rest, the head: backbone groups first, each named ``"backbone"`` and at ``backbone_lr_mult`` times its LR
    (the group's own ``lr``, else ``lr``), then the head groups, named ``"head"``; every other setting (weight
    decay, ...) kept, empty groups left out. The discriminative learning rates of fine-tuning (Howard & Ruder
    2018): an LR schedule scales every group by the same factor, so the ratio holds throughout.
    """
    if not (math.isfinite(backbone_lr_mult) and backbone_lr_mult > 0):
        raise ConfigError(f"{{backbone_lr_mult}} must be > 0 (got {backbone_lr_mult}; to train no backbone "
                          "parameter, freeze them: {freeze_backbone})", "backbone_lr_mult")
    as_dicts = [g if isinstance(g, dict) else {"params": [g]} for g in groups]
    if groups and not isinstance(groups[0], dict):  # a plain list of parameters: one group
        as_dicts = [{"params": list(groups)}]
    parts: dict[str, list[dict]] = {"backbone": [], "head": []}
    for group in as_dicts:
        params = list(group["params"])
        settings = {k: v for k, v in group.items() if k != "params"}
        for name, chosen in (("backbone", [p for p in params if id(p) in backbone]),
                             ("head", [p for p in params if id(p) not in backbone])):
            if not chosen:
                continue
            part = {**settings, "params": chosen, "name": name}
            if name == "backbone":
                part["lr"] = float(settings.get("lr", lr)) * backbone_lr_mult
            parts[name].append(part)
    return parts["backbone"] + parts["head"]
