"""Bring your own model: a user's LightningModule / LightningDataModule class run through a recipe.

A recipe takes the class from Python (``main(argv, model_cls=MyNet)``) or from the command line
(``--model-class package.module:MyNet``), checks that it is one the recipe can drive, and records its
import path in every checkpoint (``checkpoint["ddp_recipes"]``) and in ``summary.json``, so ``--resume``
rebuilds the same class.

Not in the checkpoint's ``hyper_parameters``: Lightning's ``load_from_checkpoint`` passes those back to
``__init__``, where an extra key breaks a user's class that takes ``**kwargs``.

A checkpoint names a class; it never makes this code import a file: only a module that is already
importable (an installed package, or a module in the working directory) is rebuilt from the record, as
``--model-class`` would import it. A class defined in a script (``__main__``) has to be given again, by
running that script.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Collection
from dataclasses import dataclass, replace
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from ddp_recipes.errors import ConfigError, lit

CHECKPOINT_KEY = "ddp_recipes"
SCRIPT_MODULES = ("__main__", "__mp_main__")


def class_path(cls: type) -> str:
    """``package.module:QualName``, the form ``--model-class`` takes."""
    return f"{cls.__module__}:{cls.__qualname__}"


def defined_in_script(path: str) -> bool:
    return path.partition(":")[0] in SCRIPT_MODULES


def source_file(cls: type) -> str | None:
    """The resolved path of the file that defines ``cls`` (None for classes without one)."""
    try:
        found = inspect.getsourcefile(cls)
    except (TypeError, OSError):
        return None
    return os.path.realpath(found) if found else None


def same_class(recorded: str, cls: type, recorded_file: str | None = None) -> bool:
    """A class matches a recorded path by module and name. A class defined in a script (``__main__``) has no
    importable path, so on either side the name and the defining file must both match: the same class run
    as ``python my_model.py`` and as ``--model-class my_model:Net``, never another script's class that
    happens to share the name."""
    current = class_path(cls)
    if not (defined_in_script(recorded) or defined_in_script(current)):
        return recorded == current
    if recorded.partition(":")[2] != current.partition(":")[2]:
        return False
    # Two scripts' classes both record as __main__:Net: only the defining file tells them apart.
    return recorded_file is None or recorded_file == source_file(cls)


def import_class(spec: str, flag: str) -> type:
    """The class ``package.module:ClassName`` names; a ``ConfigError`` naming ``flag`` otherwise."""
    module_name, sep, qualname = spec.partition(":")
    if not sep or not module_name or not qualname or module_name.startswith("."):
        raise ConfigError(f"{flag} {lit(repr(spec))} is not an absolute import path; write it as "
                          "package.module:ClassName")
    if module_name in SCRIPT_MODULES:
        raise ConfigError(f"{flag} {lit(spec)}: a class defined in a script cannot be imported; move it into a module "
                          "(a .py file beside the script) and pass module:ClassName")
    # `python -m recipes.x` has the working directory on sys.path; a console script or torchrun's worker
    # may not. Appended, so a local file never shadows an installed package.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # noqa: BLE001 - whatever the user's module raises at import is bad input here
        reason = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise ConfigError(f"{flag} {lit(spec)}: cannot import {module_name} ({type(err).__name__}: {lit(reason)}); "
                          "check the module path, that it is importable from the working directory, and its top-level "
                          "code") from None
    obj: Any = module
    for part in qualname.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{flag} {lit(spec)}: {module_name} has no {qualname!r}; check the class name") from None
        obj = getattr(obj, part)
    if not isinstance(obj, type):
        raise ConfigError(f"{flag} {lit(spec)} is a {type(obj).__name__}, not a class")
    return obj


def check_subclass(cls: Any, base: type, flag: str) -> type:
    """``cls`` itself when it subclasses ``base``; a ``ConfigError`` naming ``flag`` otherwise."""
    if not isinstance(cls, type):
        raise ConfigError(f"{flag} must be a class, got {type(cls).__name__} {cls!r}")
    if not issubclass(cls, base):
        raise ConfigError(f"{flag} {class_path(cls)} does not subclass {base.__module__}.{base.__qualname__}; "
                          f"derive it from {base.__qualname__} so the recipe can drive it")
    return cls


@dataclass(frozen=True)
class RecipeClasses:
    """The classes a run builds: the recipe's module ``base`` or a user's subclass ``model``, and a user's
    DataModule class (None: the recipe's own data)."""

    base: type[L.LightningModule]
    model: type[L.LightningModule] | None = None
    datamodule: type[L.LightningDataModule] | None = None

    @property
    def model_class(self) -> type[L.LightningModule]:
        return self.model or self.base

    def record(self) -> dict[str, str | None]:
        return {"model_class": class_path(self.model_class), "model_file": source_file(self.model_class),
                "datamodule_class": class_path(self.datamodule) if self.datamodule else None,
                "datamodule_file": source_file(self.datamodule) if self.datamodule else None}


def resolve_classes(base: type[L.LightningModule], model_cls: type | None = None, datamodule_cls: type | None = None,
                    model_spec: str | None = None, datamodule_spec: str | None = None) -> RecipeClasses:
    """The run's classes from ``main(model_cls=, datamodule_cls=)`` and the ``--model-class`` /
    ``--datamodule-class`` flags (both may be given when they name the same class)."""
    model = _pick(model_cls, model_spec, "model_cls", "{model_class}")
    datamodule = _pick(datamodule_cls, datamodule_spec, "datamodule_cls", "{datamodule_class}")
    if model is not None:
        check_subclass(model, base, "{model_class}" if model_spec else "model_cls")
    if datamodule is not None:
        check_subclass(datamodule, L.LightningDataModule, "{datamodule_class}" if datamodule_spec else "datamodule_cls")
    return RecipeClasses(base, model, datamodule)


def _pick(given: type | None, spec: str | None, kwarg: str, flag: str) -> type | None:
    from_flag = import_class(spec, flag) if spec else None
    if given is not None and from_flag is not None and from_flag is not given:
        raise ConfigError(f"{flag} {lit(spec)} and main({kwarg}={class_path(given)}) name different classes; give one")
    return given if given is not None else from_flag


def follow_checkpoint(classes: RecipeClasses, checkpoint: dict[str, Any], path: str) -> RecipeClasses:
    """The classes a resumed run builds: the ones the checkpoint was trained with.

    A class given for this run must be the recorded one (a class with the same parameter names would
    otherwise load the weights silently). When none was given, a recorded importable class is imported, as
    ``--model-class`` would import it; a recorded script class has to be given again. A checkpoint without
    the record (no ``checkpoint["ddp_recipes"]``) is not checked: it names no class to hold the run to.
    """
    if CHECKPOINT_KEY not in checkpoint:
        return classes
    record = checkpoint[CHECKPOINT_KEY] or {}
    _refuse_other_recipe(record.get("model_class"), classes.base, path)
    model = _follow(record.get("model_class"), record.get("model_file"), classes.model, classes.base, path,
                    "{model_class}", "model_cls")
    datamodule = _follow(record.get("datamodule_class"), record.get("datamodule_file"), classes.datamodule, None,
                         path, "{datamodule_class}", "datamodule_cls")
    for cls, base in ((model, classes.base), (datamodule, L.LightningDataModule)):
        if cls is not None and not issubclass(cls, base):
            raise ConfigError(f"{{resume}} {lit(path)} was trained with {class_path(cls)}, which this recipe does not "
                              "build (a checkpoint of another recipe?); pass a checkpoint written by this recipe")
    return replace(classes, model=model, datamodule=datamodule)


def _describe(cls: type | None) -> str:
    return class_path(cls) if cls is not None else "the recipe's own data"


def _refuse_other_recipe(recorded: str | None, base: type, path: str) -> None:
    """A record naming one of this pack's modules that is not the recipe's own: another recipe's checkpoint
    (fail saying so, rather than suggest a --model-class this recipe would refuse)."""
    if recorded is None or not recorded.startswith("ddp_recipes.modules."):
        return
    try:
        recorded_cls = import_class(recorded, "{model_class}")
    except ConfigError:
        return
    if not issubclass(recorded_cls, base):
        raise ConfigError(f"{{resume}} {lit(path)} was trained with {lit(recorded)}, which this recipe does not build "
                          "(a checkpoint of another recipe?); pass a checkpoint written by this recipe")


def _follow(recorded: str | None, recorded_file: str | None, given: type | None, default: type | None, path: str,
            flag: str, kwarg: str) -> type | None:
    """The class to build for one record: ``given``, else the recorded one, else None (the default)."""
    if given is not None:
        if recorded is None or not same_class(recorded, given, recorded_file):
            default_recorded = recorded is None or (default is not None and recorded == class_path(default))
            fix = f"drop {flag} ({kwarg}=)" if default_recorded else f"pass {flag} {recorded}"
            raise ConfigError(f"{{resume}} {lit(path)} was trained with {recorded or _describe(None)} but this run "
                              f"builds {_describe(given)}; {fix} or pass another checkpoint")
        return given
    if recorded is None or (default is not None and class_path(default) == recorded):
        return None
    if defined_in_script(recorded):
        raise ConfigError(f"{{resume}} {lit(path)} was trained with {lit(recorded)}, a class defined in a script: run "
                          f"that script again (it passes {kwarg}=), or move the class into a module and pass {flag}")
    return import_class(recorded, f"{flag} (recorded in {{resume}} {path})")


def construct_datamodule(cls: type[L.LightningDataModule], offered: dict[str, Any],
                         given: Collection[str] = ()) -> L.LightningDataModule:
    """A user's DataModule, given the run's values for the ``__init__`` parameters it declares.

    ``given``: the offered flags the user set; one the class does not take would have no effect, so it is
    refused in one line rather than dropped.

    ``batch_size`` is the per-device batch of the run's plan (``--batch-size``/``--global-batch-size``), so
    the class must take it: with its own batch size the global batch, the LR scaling and the resume
    arithmetic would silently be wrong. A required parameter the recipe cannot give fails in one line.
    """
    kwargs = _accepted(cls, offered, "{datamodule_class}")
    ignored = [name for name in given if name not in kwargs]
    if ignored:
        raise ConfigError(f"{{{ignored[0]}}} has no effect: {{datamodule_class}} {lit(class_path(cls))} does not take "
                          f"{ignored[0]} in __init__; add it there or drop {{{ignored[0]}}}", ignored[0])
    if "batch_size" not in kwargs:
        raise ConfigError(f"{{datamodule_class}} {class_path(cls)} must take batch_size in __init__ (the per-device "
                          "batch the recipe plans from {batch_size} / {global_batch_size})")
    return cls(**kwargs)


def model_kwargs(cls: type[L.LightningModule], given: dict[str, Any]) -> dict[str, Any]:
    """The recipe's keyword arguments for the model class, checked against its ``__init__``.

    The class must accept each of them (by name, or through ``**kwargs`` passed on to the parent) and
    require nothing else; otherwise one line says which. Recipes call it before any process starts.
    """
    kwargs = _accepted(cls, given, "{model_class}")
    refused = sorted(set(given) - set(kwargs))
    if refused:
        raise ConfigError(f"{{model_class}} {class_path(cls)}: __init__ does not take {', '.join(refused)}, which the "
                          "recipe passes; add **kwargs and pass them on to super().__init__(**kwargs)")
    return kwargs


def _accepted(cls: type, offered: dict[str, Any], flag: str) -> dict[str, Any]:
    """The offered keywords ``cls.__init__`` takes (all of them when it has ``**kwargs``); a ``ConfigError``
    when it requires a parameter that is not offered."""
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    named = {p.name: p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    missing = [n for n, p in named.items() if p.default is p.empty and n not in offered]
    if missing:
        raise ConfigError(f"{flag} {class_path(cls)}: __init__ requires {', '.join(missing)}, which the recipe "
                          f"cannot give (it gives {', '.join(sorted(offered))}); give them defaults")
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return dict(offered)
    return {k: v for k, v in offered.items() if k in named}


class RecordClasses(Callback):
    """Writes the run's model and DataModule import paths into every checkpoint (``checkpoint["ddp_recipes"]``)."""

    def __init__(self, classes: RecipeClasses) -> None:
        self.classes = classes

    @override
    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        checkpoint[CHECKPOINT_KEY] = replace(self.classes, model=type(pl_module)).record()
