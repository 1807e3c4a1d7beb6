"""The weight EMA's settings (:class:`EMAArgs`), torch-free: a recipe checks its flags with them before torch
loads. The EMA itself is :mod:`ddp_recipes.optim.ema`'s callback."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ddp_recipes.config.run_config import refuse_unused
from ddp_recipes.errors import ConfigError


@dataclass(frozen=True)
class EMAArgs:
    """The EMA's settings: each default here, once, and each value checked once, in ``__post_init__``
    (a :class:`ConfigError` naming it; a recipe renames the parameters to its flags)."""

    decay: float = 0.99998
    """Weight of the average per update, in [0, 1] (torchvision's reference value, before :func:`adjusted_decay`)."""
    update_every: int = 32
    """Optimizer steps between two updates (the reference's ``--model-ema-steps``)."""
    warmup_epochs: float = 0.0
    """The LR warm-up's length in epochs: the average copies the weights while it lasts."""
    enabled: bool = True
    """Whether a run keeps the average (a recipe's ``--model-ema``); without it, a decay or an update interval
    other than the default would have no effect and is refused."""

    def __post_init__(self) -> None:
        refuse_unused(self, [(not self.enabled, ("update_every", "decay"), "{enabled}")])
        if not 0.0 <= self.decay <= 1.0:
            raise ConfigError(f"{{decay}} must be in [0, 1] (got {self.decay})")
        every = self.update_every
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ConfigError(f"{{update_every}} must be a whole number of optimizer steps >= 1 (got {every!r})")
        if not (math.isfinite(self.warmup_epochs) and self.warmup_epochs >= 0):
            raise ConfigError(f"{{warmup_epochs}} must be >= 0 (got {self.warmup_epochs})")
