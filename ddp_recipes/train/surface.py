"""A recipe's open Trainer surface: the user's callbacks, logger and Trainer settings on top of the recipe's.

Three ways in, one check each (:mod:`ddp_recipes.config.trainer_settings` owns the rules):

* ``main(callbacks=[...], logger=..., trainer_kwargs={...})`` from a script;
* ``--callbacks SPEC`` / ``--trainer KEY=VALUE`` on the command line;
* ``callbacks:`` (``class_path`` / ``init_args``, as LightningCLI writes them) and ``trainer:`` in ``--config``.

Every callback is built in every rank from the same spec, so Lightning restores its state by ``state_key``
from a checkpoint on ``--resume``, as it does for its own.
"""

from __future__ import annotations

import difflib
import inspect
from dataclasses import dataclass, field
from typing import Any

from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import Callback

from ddp_recipes.config.run_config import RunConfig
from ddp_recipes.config.trainer_settings import check_trainer_settings, probe_trainer
from ddp_recipes.errors import ConfigError, lit
from ddp_recipes.train.userclass import check_subclass, import_class

# LightningCLI resolves a bare class name among Lightning's callbacks: so does --callbacks.
_SHORT_NAMES_FROM = "lightning.pytorch.callbacks"


@dataclass
class UserSurface:
    """What a run adds to the recipe's Trainer: callbacks after the recipe's, Trainer keywords."""

    callbacks: list[Callback] = field(default_factory=list)
    trainer_kwargs: dict[str, Any] = field(default_factory=dict)


def open_surface(cfg: RunConfig, callbacks: Any = None, logger: Any = None,
                 trainer_kwargs: dict[str, Any] | None = None) -> UserSurface:
    """The user's part of the Trainer, checked before any process starts: ``--callbacks`` then ``callbacks``;
    ``trainer_kwargs`` with ``--config``'s ``trainer:`` and ``--trainer`` over them (a script's keywords are
    its defaults, the command line moves them); ``logger`` (a Logger, a list of them, or False) replaces the
    recipe's logger."""
    given = _as_callbacks(callbacks)
    source = "main(trainer_kwargs=...)"
    if trainer_kwargs is not None and not isinstance(trainer_kwargs, dict):
        raise ConfigError(f"{source} must be a dict of lightning.Trainer arguments (got {lit(repr(trainer_kwargs))})")
    kwargs = {**check_trainer_settings(dict(trainer_kwargs or {}), cfg.TRAINER_OWNED, source=source), **cfg.trainer}
    probe_trainer(kwargs, "{trainer}" if cfg.trainer else source)
    _refuse_checkpoint_io(kwargs.get("plugins"), "{trainer}" if "plugins" in cfg.trainer else source)
    if logger is not None:
        kwargs["logger"] = logger
    built = [build_callback(spec) for spec in cfg.callbacks]
    for callback, source in [*((c, "{callbacks}") for c in built), *((c, "main(callbacks=...)") for c in given)]:
        _refuse_tuner(callback, source)
    return UserSurface([*built, *given], kwargs)


# Lightning's tuners rewrite what the run planned before the first step: the per-device batch (and so the
# global batch, the LR scaled from it, the resume position's arithmetic and summary.json) or the LR.
_TUNERS = {"BatchSizeFinder": "the batch size the run planned (global batch, LR scaling, resume position); set "
                              "{batch_size} or {global_batch_size}",
           "LearningRateFinder": "the learning rate the run planned (scaled to the global batch); set {lr}"}


# Trainer settings that only act on validation (a value that turns it off is fine without it).
_VALIDATION_SETTINGS = {"val_check_interval": None, "check_val_every_n_epoch": None, "limit_val_batches": 0,
                        "num_sanity_val_steps": 0}


def without_validation(trainer_kwargs: dict[str, Any], has_val: bool, how: str) -> dict[str, Any]:
    """A run's Trainer settings, checked against whether it has validation data: a validation setting on a
    run without it would do nothing, so it is refused naming ``how`` a run gets a validation set. A run without
    validation gets ``limit_val_batches=0``: Lightning then skips validation without asking for the empty
    loader, which would make it warn "Total length of `list` across ranks is zero"."""
    if has_val:
        return trainer_kwargs
    for key, off in _VALIDATION_SETTINGS.items():
        if key in trainer_kwargs and (off is None or trainer_kwargs[key] != off):
            raise ConfigError(f"{{trainer}} {key}={lit(repr(trainer_kwargs[key]))} has no effect: this run has no "
                              f"validation data; {how}, or drop it")
    return {**trainer_kwargs, "limit_val_batches": 0}


def _refuse_checkpoint_io(plugins: Any, source: str) -> None:
    """A CheckpointIO among the plugins would replace the recipe's AtomicCheckpointIO without a word."""
    from lightning.pytorch.plugins.io import CheckpointIO

    from ddp_recipes.checkpointing.checkpoint import AtomicCheckpointIO

    for plugin in plugins if isinstance(plugins, list | tuple) else [plugins]:
        if isinstance(plugin, CheckpointIO) and not isinstance(plugin, AtomicCheckpointIO):
            raise ConfigError(f"{source} plugins {lit(type(plugin).__name__)} would replace the recipe's "
                              "AtomicCheckpointIO, which writes last.ckpt atomically (a kill mid-save keeps the "
                              "previous one) and, on object storage, the manifests {resume} auto reads; subclass "
                              "AtomicCheckpointIO to change it, or leave it out")


def _refuse_tuner(callback: Callback, source: str) -> None:
    from lightning.pytorch.callbacks import BatchSizeFinder, LearningRateFinder

    for cls in (BatchSizeFinder, LearningRateFinder):
        if isinstance(callback, cls):
            raise ConfigError(f"{source} {lit(type(callback).__name__)} changes {_TUNERS[cls.__name__]} instead")


def _as_callbacks(callbacks: Any) -> list[Callback]:
    """``main(callbacks=...)``: one Callback or a list of them."""
    items = [] if callbacks is None else list(callbacks) if isinstance(callbacks, list | tuple) else [callbacks]
    for item in items:
        if not isinstance(item, Callback):
            raise ConfigError(f"main(callbacks=...) takes lightning Callback instances (got {lit(repr(item))}); "
                              "pass an instance, or a class path in {callbacks}")
    return items


def callback_class(path: str) -> type[Callback]:
    """The class a ``class_path`` names: ``package.module.Class``, ``package.module:Class``, or a bare name
    from ``lightning.pytorch.callbacks``."""
    if ":" not in path:
        module, _, name = path.rpartition(".")
        path = f"{module or _SHORT_NAMES_FROM}:{name}"
    return check_subclass(import_class(path, "{callbacks}"), Callback, "{callbacks}")


def build_callback(spec: dict[str, Any]) -> Callback:
    """One callback from its checked spec (``{"class_path": ..., "init_args": {...}}``)."""
    cls, name = callback_class(spec["class_path"]), spec["class_path"]
    init_args = spec["init_args"]
    signature = inspect.signature(cls)
    named = [p.name for p in signature.parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    takes = f"it takes: {', '.join(named)}" if named else "it takes no arguments"
    if not any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values()):
        unknown = [key for key in init_args if key not in named]
        if unknown:
            close = difflib.get_close_matches(unknown[0], named, n=1)
            guess = f"did you mean {close[0]}? " if close else ""
            raise ConfigError(f"{{callbacks}} {lit(name)}: no argument {lit(repr(unknown[0]))}; {guess}({takes})")
    try:
        signature.bind(**init_args)
    except TypeError as err:
        raise ConfigError(f"{{callbacks}} {lit(name)}: {lit(err)} ({takes})") from None
    try:
        return cls(**init_args)
    except (TypeError, ValueError, MisconfigurationException) as err:  # the class refused the given arguments
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"{{callbacks}} {lit(name)}({lit(_args(init_args))}): {lit(reason)}") from None


def _args(init_args: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in init_args.items())
