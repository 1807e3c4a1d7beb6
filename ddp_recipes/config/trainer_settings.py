"""The Trainer settings a recipe does not own: ``--trainer KEY=VALUE``, a ``trainer:`` mapping in ``--config``,
``main(trainer_kwargs=...)``; and ``--callbacks`` / ``callbacks:`` as LightningCLI writes them.

A setting is checked once, here, against ``lightning.Trainer``'s signature (one line naming the flag to use);
text values are read as the annotation asks: ``1.0`` stays a float (Lightning's "the whole set"), ``10`` an int.
"""

from __future__ import annotations

import collections.abc
import difflib
import functools
import inspect
import re
import types
import typing
from typing import Any, Literal, Union, get_args, get_origin

from ddp_recipes.errors import ConfigError, lit

# lightning.Trainer arguments a recipe sets itself, and where a user sets them instead.
PACK_OWNED: dict[str, str] = {
    "accelerator": "{accelerator}",
    "devices": "{devices}",
    "num_nodes": "{num_nodes}",
    "precision": "{precision}",
    "strategy": "the DDP flags ({find_unused_parameters}, {static_graph}, {comm_hook}, {bucket_cap_mb}, {timeout_s})",
    "sync_batchnorm": "{sync_batchnorm}",
    "max_epochs": "{max_epochs}",
    "max_steps": "{max_steps}",
    "accumulate_grad_batches": "{accumulate_grad_batches} (or {global_batch_size})",
    "default_root_dir": "{output_dir}",
    "callbacks": "{callbacks} (in --config a top-level callbacks: list of class_path / init_args) or "
                 "main(callbacks=[...])",
    "logger": "{logger} (csv, tensorboard, mlflow, wandb) or main(logger=...)",
    "log_every_n_steps": "{log_every_n_steps} (the live throughput metrics follow it too)",
    # last.ckpt is what --resume and preemption run on; Lightning refuses it with enable_checkpointing=False.
    "enable_checkpointing": "{checkpoint_every_n_steps} (the recipe's last.ckpt is what {resume} reads)",
    # Lightning re-creates the training loader with a SequentialSampler, which the resumable loader cannot take.
    "overfit_batches": "{trainer} limit_train_batches=N (overfit_batches swaps the training loader's sampler, and "
                       "the recipe's resumable loader keeps its own order)",
    "barebones": "the recipe's flags (barebones turns off the logging, checkpoints and callbacks a recipe runs on)",
}


def _scalar_readings(text: str) -> list[Any]:
    """What a command-line value may mean, most specific first: None, a bool, an int, a float, YAML for a
    ``{...}`` / ``[...]`` value, and always the text itself last."""
    readings: list[Any] = []
    lowered = text.strip().lower()
    if lowered in ("null", "none", "~"):
        readings.append(None)
    if lowered in ("true", "false"):
        readings.append(lowered == "true")
    for kind in (int, float):
        try:
            readings.append(kind(text))
        except ValueError:
            pass
    if text.strip()[:1] in ("{", "["):
        import yaml

        try:
            readings.append(yaml.safe_load(text))
        except yaml.YAMLError:
            pass
    return [*readings, text]


def _matches(value: Any, hint: Any) -> bool:
    """Whether ``value`` fits the annotation ``hint`` (what cannot be checked, e.g. a protocol, passes)."""
    origin = get_origin(hint)
    if hint is Any:
        return True
    if origin is Union or origin is types.UnionType:
        return any(_matches(value, arm) for arm in get_args(hint))
    if origin is Literal:
        return any(value == arm and type(value) is type(arm) for arm in get_args(hint))
    if hint is type(None) or hint is None:
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if origin in (dict, collections.abc.Mapping):
        key, item = get_args(hint) or (Any, Any)
        return isinstance(value, dict) and all(_matches(k, key) and _matches(v, item) for k, v in value.items())
    if origin in (list, collections.abc.Sequence, collections.abc.Iterable):
        (item,) = get_args(hint) or (Any,)
        return isinstance(value, list | tuple) and all(_matches(v, item) for v in value)
    if isinstance(hint, type):
        return isinstance(value, hint)
    return True


def describe_hint(hint: Any) -> str:
    """An annotation as a short ``int | float | None``."""
    origin = get_origin(hint)
    if origin is Union or origin is types.UnionType:
        return " | ".join(dict.fromkeys(describe_hint(arm) for arm in get_args(hint)))
    if origin is Literal:
        return " | ".join(repr(arm) for arm in get_args(hint))
    if hint is type(None):
        return "None"
    if origin is not None:
        return re.sub(r"\b(?:[a-z_][\w]*\.)+", "", repr(hint))
    return getattr(hint, "__name__", repr(hint))


@functools.cache
def trainer_hints() -> dict[str, Any]:
    """``lightning.Trainer.__init__``'s parameters and their annotations (imported here, on first use only)."""
    import lightning as L

    hints = typing.get_type_hints(L.Trainer.__init__)
    return {name: hints.get(name, Any) for name in inspect.signature(L.Trainer.__init__).parameters if name != "self"}


def check_trainer_settings(settings: dict[str, Any], owned: dict[str, str],
                           source: str = "{trainer}") -> dict[str, Any]:
    """``settings`` checked against ``lightning.Trainer``'s signature, text values read as their annotation
    asks; ``owned`` maps the settings the pack sets itself to the flag to use instead. ``source`` opens each
    message: the flag (``{trainer}``) or a script's keyword (``main(trainer_kwargs=...)``)."""
    if not settings:
        return {}
    for key in settings:  # before Lightning's signature is read (importing Lightning takes seconds)
        if str(key) in owned:
            raise ConfigError(f"{source} {lit(str(key))} is the recipe's own setting; use {owned[str(key)]} instead")
    hints = trainer_hints()
    checked: dict[str, Any] = {}
    for key, value in settings.items():
        name = str(key)
        if name not in hints:
            close = difflib.get_close_matches(name, list(hints), n=1)
            if close and close[0] in owned:  # max_epoch: the recipe's --max-epochs, not Trainer's min_epochs
                hint = f"did you mean {close[0]}? It is the recipe's own setting: use {owned[close[0]]}"
            else:
                hint = f"did you mean {close[0]}?" if close else "see lightning.Trainer's arguments"
            raise ConfigError(f"{source} {lit(name)}: lightning.Trainer has no such argument; {hint}")
        readings = _scalar_readings(value) if isinstance(value, str) else [value]
        fitting = next((reading for reading in readings if _matches(reading, hints[name])), _MISSING)
        if fitting is _MISSING:
            raise ConfigError(f"{source} {lit(name)}={lit(repr(value))}: lightning.Trainer takes "
                              f"{lit(describe_hint(hints[name]))} there")
        checked[name] = fitting
    return checked


_MISSING = object()


def probe_trainer(settings: dict[str, Any], source: str = "{trainer}") -> None:
    """Lightning's own checks of ``settings``, before any process starts (``max_time=abc``): one CPU Trainer is
    built and dropped, the process-wide switches it sets put back as they were."""
    if not settings:
        return
    failed = _probe(settings)
    if failed is None:
        return
    culprit = next((key for key in settings if _probe({key: settings[key]}) is not None), None)
    shown = f"{culprit}={settings[culprit]!r}" if culprit is not None else ", ".join(settings)
    raise ConfigError(f"{source} {lit(shown)}: lightning.Trainer refuses it ({lit(failed)})")


def _probe(settings: dict[str, Any]) -> str | None:
    """None when ``lightning.Trainer`` takes ``settings``; else the first line of its error."""
    import logging
    import os
    import warnings

    import lightning as L
    import torch
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    quiet = {"accelerator": "cpu", "devices": 1, "logger": False, "enable_checkpointing": False,
             "enable_progress_bar": False, "enable_model_summary": False}
    logger = logging.getLogger("lightning.pytorch")
    saved = (logger.level, torch.are_deterministic_algorithms_enabled(),
             torch.is_deterministic_algorithms_warn_only_enabled(), torch.backends.cudnn.benchmark,
             os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            L.Trainer(**{**quiet, **settings})
    except (MisconfigurationException, ValueError, TypeError) as err:
        return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    finally:
        logger.setLevel(saved[0])
        torch.use_deterministic_algorithms(saved[1], warn_only=saved[2])
        torch.backends.cudnn.benchmark = saved[3]
        if saved[4] is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        else:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = saved[4]
    return None


def split_setting(text: str, param: str = "trainer") -> tuple[str, str]:
    """``KEY=VALUE`` as (key, value text)."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"{{{param}}} takes KEY=VALUE, e.g. {{{param}}} val_check_interval=0.25 "
                          f"(got {lit(repr(text))})", param)
    return key.strip(), value


def callback_spec(spec: Any, param: str = "callbacks") -> dict[str, Any]:
    """One callback as LightningCLI writes it, ``{"class_path": ..., "init_args": {...}}``, checked for shape
    (a bare class path is the same with no arguments; text on the command line may be a YAML mapping)."""
    if isinstance(spec, str):
        text = spec.strip()
        if text.startswith("{"):
            import yaml

            try:
                spec = yaml.safe_load(text)
            except yaml.YAMLError as err:
                raise ConfigError(f"{{{param}}} {lit(repr(text))} is not a YAML mapping ({lit(type(err).__name__)})",
                                  param) from None
        else:
            spec = {"class_path": text}
    if not isinstance(spec, dict):
        raise ConfigError(f"{{{param}}} entries are a class path or a mapping with class_path and init_args "
                          f"(got {lit(repr(spec))})", param)
    extra = sorted(set(map(str, spec)) - {"class_path", "init_args"})
    if extra:
        raise ConfigError(f"{{{param}}} {lit(repr(spec))}: unknown key {lit(repr(extra[0]))}; a callback has "
                          "class_path and init_args", param)
    path, init_args = spec.get("class_path"), spec.get("init_args") or {}
    if not isinstance(path, str) or not path.strip():
        raise ConfigError(f"{{{param}}} {lit(repr(spec))} has no class_path, e.g. "
                          "class_path: lightning.pytorch.callbacks.EarlyStopping", param)
    if not isinstance(init_args, dict):
        raise ConfigError(f"{{{param}}} {lit(path)}: init_args must be a mapping of argument names to values "
                          f"(got {lit(repr(init_args))})", param)
    return {"class_path": path.strip(), "init_args": {str(k): v for k, v in init_args.items()}}
