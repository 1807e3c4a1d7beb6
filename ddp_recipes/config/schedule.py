"""The LR schedule's settings (:class:`ScheduleArgs`, torchvision's reference schedule :class:`ReferenceSchedule`),
torch-free: a recipe checks its flags with them before torch loads. The schedulers themselves are built in
:mod:`ddp_recipes.optim.schedules`."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ddp_recipes.config.choices import LR_SCHEDULERS, WARMUP_METHODS, check_choice
from ddp_recipes.config.run_config import refuse_unused
from ddp_recipes.errors import ConfigError


@dataclass(frozen=True)
class ReferenceSchedule:
    """torchvision's classification reference schedule (``--lr-scheduler`` and its flags): each default
    here, once, and each value checked once, in ``__post_init__`` (a :class:`ConfigError` naming it)."""

    lr_scheduler: str = "steplr"
    """cosineannealinglr, steplr or exponentiallr: the main schedule after the warm-up."""
    lr_step_size: int = 30
    """Epochs between steplr decays."""
    lr_gamma: float = 0.1
    """Decay factor of steplr (per step) and exponentiallr (per epoch), in (0, 1]."""
    lr_min: float = 0.0
    """cosineannealinglr's final LR (absolute, as the reference's ``eta_min``)."""
    lr_warmup_epochs: float = 0.0
    """Warm-up length in epochs (fractions allowed; the run's ``--warmup-epochs``)."""
    lr_warmup_method: str = "constant"
    """linear (from ``lr_warmup_decay`` x lr to lr) or constant (``lr_warmup_decay`` x lr)."""
    lr_warmup_decay: float = 0.01
    """The warm-up's starting factor, in (0, 1]."""

    def __post_init__(self) -> None:
        check_choice("lr_scheduler", self.lr_scheduler, LR_SCHEDULERS)
        check_choice("lr_warmup_method", self.lr_warmup_method, WARMUP_METHODS)
        step = self.lr_step_size
        if isinstance(step, bool) or not isinstance(step, int) or step < 1:
            raise ConfigError(f"{{lr_step_size}} must be a whole number of epochs >= 1 (got {step!r})")
        if not 0 < self.lr_gamma <= 1:
            raise ConfigError(f"{{lr_gamma}} must be in (0, 1] (got {self.lr_gamma})")
        if not (math.isfinite(self.lr_min) and self.lr_min >= 0):
            raise ConfigError(f"{{lr_min}} must be >= 0 (got {self.lr_min})")
        if not (math.isfinite(self.lr_warmup_epochs) and self.lr_warmup_epochs >= 0):
            raise ConfigError(f"{{lr_warmup_epochs}} must be >= 0 (got {self.lr_warmup_epochs})")
        if not 0 < self.lr_warmup_decay <= 1:
            raise ConfigError(f"{{lr_warmup_decay}} must be in (0, 1] (got {self.lr_warmup_decay})")

    @classmethod
    def of(cls, settings: Mapping[str, Any], warmup_epochs: float = 0.0) -> ReferenceSchedule:
        """The schedule of a mapping holding some of the fields (a module's hparams, a config's ``vars``);
        the missing ones take their default here. ``warmup_epochs``: the run's warm-up."""
        given = {f.name: settings[f.name] for f in dataclasses.fields(cls)
                 if f.name != "lr_warmup_epochs" and settings.get(f.name) is not None}
        return cls(**given, lr_warmup_epochs=warmup_epochs)


@dataclass(frozen=True)
class ScheduleArgs:
    """The schedule a run follows after its warm-up, as a recipe's flags choose it: the pack's cosine or
    torchvision's reference (:class:`ReferenceSchedule`). ``__post_init__`` refuses a setting the chosen
    schedule does not read (never silently dropped) and two schedules at once."""

    cosine: bool | None = None
    """Cosine decay to 0 after a linear warm-up from 0; None: on unless ``lr_scheduler`` is given."""
    lr_scheduler: str | None = None
    """The reference's schedule after the warm-up (None: ``cosine``'s)."""
    lr_step_size: int = ReferenceSchedule.lr_step_size
    """Epochs between steplr decays."""
    lr_gamma: float = ReferenceSchedule.lr_gamma
    """Decay factor of steplr and exponentiallr."""
    lr_min: float = ReferenceSchedule.lr_min
    """cosineannealinglr's final LR."""
    lr_warmup_method: str = ReferenceSchedule.lr_warmup_method
    """The reference's warm-up: linear or constant."""
    lr_warmup_decay: float = ReferenceSchedule.lr_warmup_decay
    """The reference's warm-up starting factor."""
    warmup_epochs: float = 0.0
    """The run's warm-up length in epochs."""

    def __post_init__(self) -> None:
        refuse_unused(self, [
            (self.lr_scheduler is None, ("lr_step_size", "lr_gamma", "lr_min", "lr_warmup_method", "lr_warmup_decay"),
             "{lr_scheduler}"),
            (self.lr_scheduler != "steplr", ("lr_step_size",), "{lr_scheduler} steplr"),
            (self.lr_scheduler not in ("steplr", "exponentiallr"), ("lr_gamma",),
             "{lr_scheduler} steplr or exponentiallr"),
            (self.lr_scheduler != "cosineannealinglr", ("lr_min",), "{lr_scheduler} cosineannealinglr"),
            (self.lr_scheduler is None or not self.warmup_epochs, ("lr_warmup_method", "lr_warmup_decay"),
             "{lr_scheduler} and {lr_warmup_epochs} > 0")])
        if self.cosine and self.lr_scheduler is not None:
            raise ConfigError("{cosine} and {lr_scheduler} are two schedules; give one")
        _ = self.reference  # checks the reference's values

    @property
    def decays_cosine(self) -> bool:
        """Whether the pack's cosine follows the warm-up (``cosine``, else: no ``lr_scheduler``)."""
        return self.lr_scheduler is None if self.cosine is None else bool(self.cosine)

    @property
    def reference(self) -> ReferenceSchedule | None:
        """The reference's schedule (None without ``lr_scheduler``)."""
        return ReferenceSchedule.of(vars(self), self.warmup_epochs) if self.lr_scheduler else None
