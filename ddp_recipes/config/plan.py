"""The resolved run: every derived value computed once, frozen, and read by the runner, the trainer and the
DataModules. A :class:`~ddp_recipes.config.run_config.RunConfig` says what was asked; a :class:`RunPlan` says what runs.

:class:`DDPOptions` are the DDP knobs as one object: config -> ``build_trainer`` -> ``TunedDDPStrategy``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from ddp_recipes.config.choices import ACCELERATORS, COMM_HOOKS, LR_SCALING_RULES, START_METHODS, check_choice
from ddp_recipes.config.world import (
    check_devices,
    lightning_precision,
    resolve_accelerator,
    resolve_precision,
    resolve_world,
)
from ddp_recipes.errors import ConfigError, lit


def scale_lr(base_lr: float, global_batch: int, reference_batch: int, rule: str = "none") -> float:
    """The LR for ``global_batch`` given ``base_lr`` tuned at ``reference_batch``."""
    if rule not in LR_SCALING_RULES:
        raise ConfigError(f"{{lr_scaling}} must be one of {', '.join(LR_SCALING_RULES)} (got {rule!r})")
    if global_batch < 1 or reference_batch < 1:
        raise ConfigError(f"batch sizes must be >= 1 (global {global_batch}, reference {reference_batch})")
    ratio = global_batch / reference_batch
    if rule == "linear":
        return base_lr * ratio
    if rule == "sqrt":
        return base_lr * math.sqrt(ratio)
    return base_lr


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{{{name}}} must be True or False (got {lit(repr(value))})", name)
    return value


def _seconds(name: str, value: Any, zero: str = "") -> float:
    """A positive, finite number of seconds from a number, a numeric string ("30") or a timedelta."""
    seconds = value.total_seconds() if isinstance(value, timedelta) else value
    if isinstance(seconds, str):
        try:
            seconds = float(seconds)
        except ValueError:
            pass
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not 0 < seconds < 10**9:
        raise ConfigError(f"{{{name}}} must be > 0 seconds and finite{zero}: a number, a numeric string or a "
                          f"timedelta (got {lit(repr(value))})", name)
    return float(seconds)


def _positive_mb(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise ConfigError(f"{{{name}}} must be > 0 (MiB; got {lit(repr(value))})", name)
    return value


def _int_at_least(low: int, why: str = "") -> Callable[[str, Any], int]:
    def check(name: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigError(f"{{{name}}} must be an integer >= {low}{why} (got {lit(repr(value))})", name)
        return value
    return check


def _seed(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{{{name}}} must be an integer (got {lit(repr(value))})", name)
    return value


def _run_seed(name: str, value: Any) -> int:
    # The run's seed also seeds numpy (seed_everything, PL_GLOBAL_SEED for the sampler): numpy's range.
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**32:
        raise ConfigError(f"{{{name}}} must be an integer in 0..{2**32 - 1} (got {lit(repr(value))})", name)
    return value


# The one check of every DDP value, whoever receives it (DDPOptions from a config or build_trainer's
# keywords, TunedDDPStrategy from a user's Trainer(strategy=...)). Each returns the value normalised.
_DDP_CHECKS: dict[str, Callable[[str, Any], Any]] = {
    "find_unused_parameters": _flag,
    "static_graph": _flag,
    "gradient_as_bucket_view": _flag,
    "broadcast_buffers": _flag,
    "sync_batchnorm": _flag,
    "nccl_p2p_disable": _flag,
    "comm_hook": lambda name, value: check_choice(name, value, COMM_HOOKS) or value,
    "start_method": lambda name, value: check_choice(name, value, START_METHODS) or value,
    "bucket_cap_mb": _positive_mb,
    "timeout_s": _seconds,
    "hang_report_s": lambda name, value: 0.0 if value in (0, "0") else _seconds(name, value, " (or 0: no report)"),
    "timeout": lambda name, value: timedelta(seconds=_seconds(name, value)),
    # PowerSGD's error feedback needs DDP's buckets stable, which it rebuilds after the first iteration.
    "powersgd_rank": _int_at_least(1),
    "powersgd_start_iter": _int_at_least(2, " (DDP rebuilds its buckets after the first iteration)"),
    "seed": _seed,
}


def check_ddp_values(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` checked and normalised (``timeout`` -> timedelta, ``timeout_s`` -> float); None means
    unset and passes. A :class:`ConfigError` naming the parameter for the first bad one."""
    return {name: _DDP_CHECKS[name](name, value) if value is not None and name in _DDP_CHECKS else value
            for name, value in values.items()}


DEFAULT_TIMEOUT_S = 1800.0  # torch's default_pg_timeout, Lightning's DDPStrategy default (config stays torch-free)


@dataclass(frozen=True)
class DDPOptions:
    """How DistributedDataParallel wraps and synchronises the model (the DDP flags of every recipe)."""

    find_unused_parameters: bool = False
    static_graph: bool = False
    comm_hook: str = "none"
    bucket_cap_mb: float | None = None  # None: DDP's own default (25 MiB)
    sync_batchnorm: bool = False
    timeout_s: float | None = None  # None: torch's default collective timeout
    hang_report_s: float | None = None  # None: derived from the steps seen (ddp_recipes.train.rank_watch); 0: off

    def __post_init__(self) -> None:
        for name, value in check_ddp_values(dataclasses.asdict(self)).items():
            object.__setattr__(self, name, value)  # frozen; "30" -> 30.0 for timeout_s
        timeout_s = self.timeout_s or DEFAULT_TIMEOUT_S
        if self.hang_report_s and self.hang_report_s >= timeout_s:
            default = "" if self.timeout_s else ", the default"
            raise ConfigError(f"{{hang_report_s}} ({self.hang_report_s:g} s) must be below {{timeout_s}} "
                              f"({timeout_s:g} s{default}): the report comes before the collective timeout ends the "
                              "run; lower it or leave it unset (derived from the steps seen)", "hang_report_s")

    def strategy_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of :class:`~ddp_recipes.ddp.strategy.TunedDDPStrategy` these options set."""
        return dict(find_unused_parameters=self.find_unused_parameters, static_graph=self.static_graph,
                    bucket_cap_mb=self.bucket_cap_mb, comm_hook=self.comm_hook,
                    timeout=timedelta(seconds=self.timeout_s) if self.timeout_s else None)


@dataclass(frozen=True)
class BatchPlan:
    """Samples per optimizer step: ``per_device`` x world size x ``accumulation`` = ``global_batch``."""

    per_device: int
    accumulation: int
    global_batch: int

    @classmethod
    def solve(cls, world: int, per_device: int | None, accumulation: int | None, global_batch: int | None,
              default_per_device: int) -> BatchPlan:
        """The plan from whichever of the three were given (any two fix the third)."""
        if global_batch is None:
            per_device = per_device or default_per_device
            accumulation = accumulation or 1
            return cls(per_device, accumulation, per_device * world * accumulation)
        if per_device is None:
            accumulation = accumulation or 1
            if global_batch % (world * accumulation):
                raise ConfigError(
                    f"{{global_batch_size}} {global_batch} is not divisible by world size x accumulation = "
                    f"{world} x {accumulation}; pick a multiple of {world * accumulation} or change "
                    "{accumulate_grad_batches}")
            return cls(global_batch // (world * accumulation), accumulation, global_batch)
        derived, rest = divmod(global_batch, per_device * world)
        if rest or derived < 1:
            raise ConfigError(
                f"{{global_batch_size}} {global_batch} is not a multiple of {{batch_size}} x world size = "
                f"{per_device} x {world}; pick a multiple of {per_device * world}")
        if accumulation is not None and accumulation != derived:
            raise ConfigError(
                f"{{accumulate_grad_batches}} {accumulation} contradicts {{global_batch_size}} {global_batch} = "
                f"{per_device} x {world} devices x {derived}; give two of the three, not all three")
        return cls(per_device, derived, global_batch)

    def astuple(self) -> tuple[int, int, int]:
        return self.per_device, self.accumulation, self.global_batch

    def check_fits(self, samples: int, world: int, flag: str = "{batch_size}") -> None:
        """Refuse a per-device batch larger than a rank's share of ``samples`` training samples: every step would
        train on that share, not on the batch the LR, the printed plan and summary.json are computed for.
        ``flag``: what the user set (``{global_batch_size}`` when given, or a library's loader argument)."""
        share = math.ceil(samples / max(1, world))  # the sampler's per-rank share (padded to equal)
        if samples < 1 or self.per_device <= share:
            return
        given = self.global_batch if "global" in flag else self.per_device
        most = share * world * self.accumulation if "global" in flag else share
        per = f" ({self.per_device} per device)" if given != self.per_device else " per device"
        raise ConfigError(f"{flag} {given}{per} is larger than the {share} training "
                          f"samples each of the {world} rank(s) gets ({samples} in all), so every step would train "
                          f"on fewer samples than planned, with the LR scaled for the larger batch; pass {flag} "
                          f"{most} or less")


@dataclass(frozen=True)
class RunPlan:
    """What runs: resolved world, hardware, batch arithmetic, learning rate, loader workers and DDP options.
    From :func:`~ddp_recipes.build_trainer`'s keywords the batch and LR facts stay None (the checks that need
    them are skipped)."""

    devices: int
    num_nodes: int
    accelerator: str  # "cpu" or "cuda"
    precision: str  # what Lightning runs: 16-mixed on CPU resolves to bf16-mixed
    ddp: DDPOptions
    accumulation: int = 1  # micro-batches per optimizer step (the Trainer's accumulate_grad_batches)
    max_epochs: int | None = None
    max_steps: int = -1
    seed: int | None = None
    tf32: bool = True
    diagnostics: bool = True
    batch: BatchPlan | None = None
    base_lr: float | None = None
    lr_scaling: str | None = None
    reference_batch: int | None = None
    warmup_epochs: float | None = None
    num_workers: int | None = None
    compile_backend: str | None = None  # None: eager

    @property
    def world_size(self) -> int:
        return self.devices * self.num_nodes

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def lr(self) -> float | None:
        """The peak LR: ``base_lr`` scaled from ``reference_batch`` to the global batch by ``lr_scaling``."""
        if self.base_lr is None or self.batch is None or self.reference_batch is None:
            return self.base_lr
        return scale_lr(self.base_lr, self.batch.global_batch, self.reference_batch, self.lr_scaling or "none")

    @classmethod
    def resolve(cls, *, devices: int | None = None, num_nodes: int | None = None, accelerator: str = "auto",
                precision: str | int = "32-true", ddp: DDPOptions | None = None,
                accumulate_grad_batches: int | None = None, per_device_batch: int | None = None,
                global_batch: int | None = None, default_batch: int | None = None, lr_scaling: str | None = None,
                **facts: Any) -> RunPlan:
        """Resolve the world (flags, else torchrun's environment), the accelerator and precision it gets, and
        the batch plan; check what can be checked before any process starts."""
        devices, num_nodes = resolve_world(devices, num_nodes)
        if accumulate_grad_batches is not None:
            _int_at_least(1)("accumulate_grad_batches", accumulate_grad_batches)
        if facts.get("seed") is not None:
            _run_seed("seed", facts["seed"])
        for name in ("max_steps", "max_epochs"):  # Lightning's meaning: 0 is zero, -1 no limit
            if facts.get(name) is not None:
                _int_at_least(-1, " (-1: no limit)")(name, facts[name])
        if lr_scaling is not None:
            check_choice("lr_scaling", lr_scaling, LR_SCALING_RULES)
        batch = None
        if default_batch is not None or per_device_batch is not None or global_batch is not None:
            batch = BatchPlan.solve(devices * num_nodes, per_device_batch, accumulate_grad_batches, global_batch,
                                    default_batch or 1)
        # Last: 'auto' and 'cuda' ask torch about CUDA (seconds to import); the flags' own arithmetic fails first.
        precision = lightning_precision(precision)  # any of Lightning's spellings: 16 -> 16-mixed, "bf16" -> ...
        check_choice("accelerator", accelerator.lower(), ACCELERATORS)
        accel = resolve_accelerator(accelerator)
        check_devices(devices, accel)
        return cls(devices=devices, num_nodes=num_nodes, accelerator=accel,
                   precision=resolve_precision(precision, accel), ddp=ddp or DDPOptions(), batch=batch,
                   accumulation=batch.accumulation if batch else accumulate_grad_batches or 1,
                   lr_scaling=lr_scaling, **facts)

    def replace(self, **changes: Any) -> RunPlan:
        return dataclasses.replace(self, **changes)
