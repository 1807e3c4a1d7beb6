"""The one check of the ResNet module's training settings (:func:`check_training_hparams`), torch-free: the
recipe runs it on its flags before torch loads, the module on its hyper-parameters."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ddp_recipes.config.finetune import FineTuning
from ddp_recipes.config.schedule import ReferenceSchedule
from ddp_recipes.errors import ConfigError


def check_training_hparams(hp: Mapping[str, Any]) -> None:
    """The one check of :class:`ResNetClassifier`'s training settings, whoever holds them (its hparams, the
    ResNet recipe's config): a :class:`ConfigError` naming the first bad one. Missing keys take the defaults."""
    momentum, nesterov = hp.get("momentum", 0.9), hp.get("nesterov", False)
    ranges = [("momentum", momentum, 1, False), ("label_smoothing", hp.get("label_smoothing", 0.0), 1, False),
              ("dropout", hp.get("dropout", 0.0), 1, False),
              ("weight_decay", hp.get("weight_decay", 0.0), math.inf, True),
              ("warmup_epochs", hp.get("warmup_epochs", 0.0), math.inf, True)]
    for name, value, high, closed in ranges:
        if not (0 <= value and (value <= high if closed else value < high) and math.isfinite(value)):
            bound = ">= 0" if high == math.inf else f"in [0, {high})"
            raise ConfigError(f"{{{name}}} must be {bound} (got {value})", name)
    optimizer = hp.get("optimizer")
    if nesterov and optimizer not in (None, "sgd", "sgd_nesterov"):
        raise ConfigError(f"{{nesterov}} is SGD's; {{optimizer}} {optimizer} has none (drop {{nesterov}})")
    if nesterov and not momentum > 0:
        raise ConfigError("{nesterov} needs {momentum} > 0")
    if hp.get("lr_scheduler"):
        ReferenceSchedule.of(hp, hp.get("warmup_epochs", 0.0))  # checks them
    FineTuning.of(hp)  # checks them
