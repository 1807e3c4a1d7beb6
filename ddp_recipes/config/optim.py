"""The optimizer's settings as a recipe's flags give them (:class:`OptimizerArgs`), torch-free: a recipe checks
its flags with them before torch loads. The optimizers themselves are built in :mod:`ddp_recipes.optim.optimizers`."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ddp_recipes.config.run_config import refuse_unused
from ddp_recipes.errors import ConfigError

# The optimizers that take a momentum (AdamW has none).
WITH_MOMENTUM = ("sgd", "sgd_nesterov", "rmsprop")


@dataclass(frozen=True)
class OptimizerArgs:
    """The reference's optimizer settings as a recipe's flags give them; ``__post_init__`` refuses a momentum
    the optimizer has no use for and a negative per-group weight decay."""

    optimizer: str = "sgd"
    """One of :data:`OPTIMIZERS`."""
    momentum: float = 0.9
    """Momentum of SGD and RMSprop."""
    norm_weight_decay: float = 0.0
    """Weight decay of normalization layers."""
    bias_weight_decay: float = 0.0
    """Weight decay of biases."""

    def __post_init__(self) -> None:
        refuse_unused(self, [(self.optimizer not in WITH_MOMENTUM, ("momentum",),
                              "{optimizer} sgd, sgd_nesterov or rmsprop (AdamW has none)")])
        for name in ("norm_weight_decay", "bias_weight_decay"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ConfigError(f"{{{name}}} must be >= 0 (got {value})", name)
