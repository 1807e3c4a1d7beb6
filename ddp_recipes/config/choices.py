"""Every choice list of the pack, defined once.

Each is a ``Literal`` type: config fields are annotated with it, so the CLI's ``choices``, the config's
validation, ``build_trainer``, the strategy, the bench and the doctor all read the same tuple.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Iterable
from typing import Any, Literal, get_args, get_origin

from ddp_recipes.errors import ConfigError, lit

Precision = Literal["32-true", "16-mixed", "bf16-mixed"]  # the pack's own: resolved per accelerator
# A recipe's --precision: not Lightning's transformer-engine ones, which swap the model's layers for Transformer
# Engine's (build_trainer passes them on: LIGHTNING_PRECISIONS).
PrecisionFlag = Literal["32-true", "16-mixed", "bf16-mixed", "bf16-true", "16-true", "64-true", "32", "16", "bf16",
                        "64"]
CommHook = Literal["none", "fp16", "bf16", "powersgd"]
LRScaling = Literal["none", "linear", "sqrt"]
Accelerator = Literal["auto", "cpu", "gpu", "cuda"]
Backend = Literal["auto", "gloo", "nccl"]
StartMethod = Literal["popen", "spawn", "fork", "forkserver"]  # DDPStrategy's launch modes
ResNetData = Literal["synthetic", "cifar10", "imagefolder", "stream"]
MNISTArch = Literal["mlp", "cnn"]
Optimizer = Literal["sgd", "sgd_nesterov", "adamw", "rmsprop"]
LRScheduler = Literal["cosineannealinglr", "steplr", "exponentiallr"]
WarmupMethod = Literal["linear", "constant"]

PRECISIONS: tuple[str, ...] = get_args(Precision)
PRECISION_FLAGS: tuple[str, ...] = get_args(PrecisionFlag)
LIGHTNING_PRECISIONS: tuple[str, ...] = (*PRECISION_FLAGS, "transformer-engine", "transformer-engine-float16")
# Lightning's meaning of its short spellings (its _convert_precision_to_unified_args, 2.x): the one table of them.
PRECISION_SPELLINGS = {"32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed", "64": "64-true"}
COMM_HOOKS: tuple[str, ...] = get_args(CommHook)
LR_SCALING_RULES: tuple[str, ...] = get_args(LRScaling)
ACCELERATORS: tuple[str, ...] = get_args(Accelerator)
BACKENDS: tuple[str, ...] = get_args(Backend)
START_METHODS: tuple[str, ...] = get_args(StartMethod)
RESNET_DATA: tuple[str, ...] = get_args(ResNetData)
MNIST_ARCHS: tuple[str, ...] = get_args(MNISTArch)
OPTIMIZERS: tuple[str, ...] = get_args(Optimizer)
LR_SCHEDULERS: tuple[str, ...] = get_args(LRScheduler)
WARMUP_METHODS: tuple[str, ...] = get_args(WarmupMethod)


def check_choice(param: str, value: Any, choices: Iterable[Any]) -> None:
    """A :class:`ConfigError` naming ``param`` unless ``value`` is one of ``choices``."""
    choices = tuple(choices)
    if value not in choices:
        raise ConfigError(f"{{{param}}} must be one of {', '.join(map(str, choices))} (got {lit(repr(value))})", param)


# Appended with the ImageNet training flags (torchvision's classification reference names).
AutoAugment = Literal["ra", "ta_wide", "augmix", "imagenet"]
Interpolation = Literal["nearest", "bilinear", "bicubic"]

AUTO_AUGMENTS: tuple[str, ...] = get_args(AutoAugment)
INTERPOLATIONS: tuple[str, ...] = get_args(Interpolation)

# Where an image folder's files are decoded and augmented: in the loader workers, or on the training device.
Decode = Literal["cpu", "gpu"]
DECODES: tuple[str, ...] = get_args(Decode)


def check_choices(config: Any, owned_elsewhere: Iterable[str] = ()) -> None:
    """Every field annotated with a ``Literal`` holds one of its values (a config built in Python is checked
    here; the CLI's ``choices`` are the same tuples). ``owned_elsewhere``: fields whose one check is made where
    the value is resolved (the run's precision, accelerator, comm hook and LR scaling: in the plan)."""
    hints = typing.get_type_hints(type(config))
    skip = set(owned_elsewhere)
    for f in dataclasses.fields(config):
        choices = literal_choices(hints[f.name]) if f.name not in skip else None
        if choices and getattr(config, f.name) is not None:
            check_choice(f.name, getattr(config, f.name), choices)


def literal_choices(annotation: Any) -> tuple[Any, ...] | None:
    """The values of a ``Literal[...]`` annotation (also inside ``X | None``); None for any other type."""
    if get_origin(annotation) is Literal:
        return get_args(annotation)
    for arg in get_args(annotation):
        if get_origin(arg) is Literal:
            return get_args(arg)
    return None

# Compute dtypes a peak FLOP/s figure is for (ddp_recipes.train.peaks; `bench peak --precision` also takes these).
PeakDtype = Literal["fp32", "tf32", "bf16", "fp16", "fp8"]
PEAK_DTYPES: tuple[str, ...] = get_args(PeakDtype)

# Experiment trackers (--logger, comma-separated; each one a Lightning logger class, see ddp_recipes.train.tracking).
TrackerName = Literal["csv", "tensorboard", "mlflow", "wandb"]
TRACKERS: tuple[str, ...] = get_args(TrackerName)


def parse_trackers(value: str) -> tuple[str, ...]:
    """``--logger``'s comma-separated value as a tuple of tracker names (``none``: no logger at all)."""
    names = tuple(part.strip().lower() for part in str(value).split(",") if part.strip())
    if names == ("none",):
        return ()
    for name in names:
        if name not in TRACKERS:
            raise ConfigError(f"{{logger}} must be none or a comma-separated list of {', '.join(TRACKERS)} "
                              f"(got {lit(repr(name))})", "logger")
    if not names:
        raise ConfigError("{logger} is empty; pass csv (the default), several such as csv,tensorboard, or none",
                          "logger")
    if len(set(names)) < len(names):
        raise ConfigError(f"{{logger}} names a tracker twice ({lit(value)}); give each once", "logger")
    return names
