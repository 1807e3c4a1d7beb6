"""Pretrained weights for fine-tuning: resolve ``--weights``, fetch them into torch's hub cache, load them
with every key and shape checked, and report what a run fine-tunes.

``--weights`` is a torchvision weights name for the model (``IMAGENET1K_V2``, ``DEFAULT``) or a local state-dict
file. Named weights are fetched into torch's hub cache once per node (``prepare_data``, hash checked), then read
on every rank with ``weights_only=True``, as a local file is: loading a state dict never runs code from the file.
"""

from __future__ import annotations

import os
import pickle
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torchvision import models
from torchvision.models import WeightsEnum
from typing_extensions import override

from ddp_recipes.checkpointing.checkpoint import code_refused
from ddp_recipes.config.finetune import FineTuning as FineTuning  # torch-free there: checked before torch loads
from ddp_recipes.errors import ConfigError, lit

# What a path looks like when it names no existing file (else the value is a weights name).
STATE_DICT_SUFFIXES = (".pth", ".pt", ".ckpt", ".bin", ".tar")


@dataclass(frozen=True)
class EvalPreset:
    """The evaluation transforms named weights were evaluated with (torchvision's ``weights.transforms()``)."""

    crop_size: int
    resize_size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    interpolation: str

    def resize_for(self, crop_size: int) -> int:
        """The resize of another crop size at this preset's ratio (232 for 224 keeps 232)."""
        return int(round(crop_size * self.resize_size / self.crop_size))


@dataclass(frozen=True)
class PretrainedWeights:
    """``--weights`` resolved: torchvision weights (``enum``) or a local state-dict file (``path``)."""

    spec: str
    enum: WeightsEnum | None = None
    path: Path | None = None

    @property
    def name(self) -> str:
        return f"{type(self.enum).__name__}.{self.enum.name}" if self.enum is not None else str(self.path)

    @property
    def cache_file(self) -> Path | None:
        """Where torchvision looks for named weights: ``<torch.hub.get_dir()>/checkpoints/<URL's file name>``."""
        if self.enum is None:
            return None
        return Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(urlparse(self.enum.url).path)

    @property
    def num_classes(self) -> int | None:
        """The classes of the weights' classifier (None for a local file: read from its shapes instead)."""
        categories = self.enum.meta.get("categories") if self.enum is not None else None
        return len(categories) if categories else None

    def eval_preset(self) -> EvalPreset | None:
        """The weights' evaluation transforms (None for a local file, which carries none)."""
        if self.enum is None:
            return None
        t = self.enum.transforms()
        return EvalPreset(crop_size=int(t.crop_size[0]), resize_size=int(t.resize_size[0]), mean=tuple(t.mean),
                          std=tuple(t.std), interpolation=t.interpolation.value)


def resolve_weights(arch: str, spec: str) -> PretrainedWeights:
    """``--weights`` for ``--arch``: an existing file, else a weights name of that model; a one-line
    :class:`ConfigError` naming the choices otherwise. Reads no weights."""
    path = Path(spec).expanduser()
    if path.is_file():
        return PretrainedWeights(spec, path=path)
    if os.sep in spec or "/" in spec or spec.endswith(STATE_DICT_SUFFIXES):
        raise ConfigError(f"{{weights}} {lit(spec)} is not a file; pass a state-dict file that exists or a "
                          "torchvision weights name (e.g. IMAGENET1K_V1)")
    enum = models.get_model_weights(arch)
    names = list(enum.__members__)
    cls, _, member = spec.rpartition(".")
    if cls and cls != enum.__name__:
        raise ConfigError(f"{{weights}} {spec} are not weights of {{arch}} {arch} (its weights are {enum.__name__}."
                          f"{'|'.join(names)}); pass the --arch they belong to, or one of {', '.join(names)}")
    if member not in enum.__members__:
        raise ConfigError(f"{{weights}} {spec}: {{arch}} {arch} has the weights {', '.join(names)} "
                          f"({enum.__name__}); pass one of them or a state-dict file")
    return PretrainedWeights(spec, enum=enum[member])


def fetch_weights(weights: PretrainedWeights) -> None:
    """Put named weights in torch's hub cache unless they are there; one line naming the file to place when
    the download fails (offline). Run on one process per node (``prepare_data``): ranks never race on it."""
    target = weights.cache_file
    if target is None or target.is_file():
        return
    match = re.search(r"-([a-f0-9]+)\.", target.name)  # torch.hub's HASH_REGEX: the file name's hash prefix
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        # A temporary file moved into place: an interrupted download never leaves a partial cache entry.
        torch.hub.download_url_to_file(weights.enum.url, os.fspath(target), match.group(1) if match else None,
                                       progress=False)
    except (OSError, RuntimeError) as err:  # URLError is an OSError; a bad hash a RuntimeError
        reason = str(getattr(err, "reason", None) or err).splitlines()[0][:120]
        raise ConfigError(_missing(weights, f"downloading {weights.enum.url} failed: {type(err).__name__}: "
                                            f"{reason}")) from None


def _missing(weights: PretrainedWeights, why: str) -> str:
    target = weights.cache_file
    return (f"{{weights}} {weights.name} needs {target.name} in torch's hub cache {lit(target.parent)} ({why}); "
            f"place that file there (from {weights.enum.url}), or set TORCH_HOME to a cache that holds it")


def read_weights(weights: PretrainedWeights) -> dict[str, torch.Tensor]:
    """The state dict of ``weights`` on CPU, read with ``weights_only=True`` (named weights from the cache
    :func:`fetch_weights` filled: never downloaded here, by every rank at once)."""
    try:
        if weights.enum is not None:
            if not weights.cache_file.is_file():
                raise ConfigError(_missing(weights, "not there, and not fetched on this node"))
            # check_hash=False: the hash was checked when the file was downloaded; a file placed by hand is
            # trusted as torch.hub trusts its cache.
            state = weights.enum.get_state_dict(progress=False, check_hash=False, weights_only=True,
                                                map_location="cpu")
        else:
            # mmap: a check before any process starts (the recipe's) reads the header, not every tensor.
            state = torch.load(weights.path, map_location="cpu", weights_only=True, mmap=_is_zip(weights.path))
    except pickle.UnpicklingError as err:
        raise code_refused(err, "weights", weights.name, "tensors",
                           "save a plain state dict, torch.save(model.state_dict(), path)") from None
    except ConfigError:
        raise
    except Exception as err:  # truncated zip, wrong format
        if weights.path is not None and not _is_zip(weights.path) and not _is_pickle(weights.path):
            # torch.load's legacy reader reads any other file as a pickle and fails with e.g. "KeyError: 101"
            raise ConfigError(f"{{weights}} {lit(weights.name)} is not a PyTorch file (neither a torch.save archive "
                              "nor a pickle); save the weights with torch.save(model.state_dict(), path)") from None
        raise ConfigError(f"{{weights}} {lit(weights.name)} is not a readable state-dict file ({type(err).__name__}: "
                          f"{str(err).splitlines()[0][:120] if str(err) else 'unreadable'}); replace it") from None
    return unwrap_state_dict(state, weights.name)


def _is_pickle(path: Path) -> bool:
    """A pickle of protocol 2 or later (torch.save's legacy format) starts with the PROTO opcode."""
    with open(path, "rb") as f:
        return f.read(1) == b"\x80"


def _is_zip(path: Path) -> bool:
    """torch.save's format since 1.6 (a zip archive), the one ``mmap`` can read; older files load whole."""
    with open(path, "rb") as f:
        return f.read(4) == b"PK\x03\x04"


def head_keys(network: nn.Module, backbone: list[nn.Module]) -> set[str]:
    """The state-dict keys of ``network`` outside the ``backbone`` modules: its classifier."""
    inside = {id(t) for m in backbone for t in [*m.parameters(), *m.buffers()]}
    return {k for k, t in network.state_dict(keep_vars=True).items() if id(t) not in inside}


def unwrap_state_dict(state: Any, name: str) -> dict[str, torch.Tensor]:
    """The network's tensors of a saved file: a plain state dict, torchvision's reference checkpoint
    (``{"model": ...}``), a Lightning checkpoint of this pack (``state_dict`` under ``model.``), or a DDP
    module's (``module.`` prefixes)."""
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
        if any(k.startswith("model.") for k in state):  # the network of an ImageClassifier, not its metrics
            state = {k: v for k, v in state.items() if k.startswith("model.")}
    elif isinstance(state, dict) and isinstance(state.get("model"), dict):
        state = state["model"]
    if not isinstance(state, dict) or not state or not all(torch.is_tensor(v) for v in state.values()):
        raise ConfigError(f"{{weights}} {lit(name)} is not a state dict (a dict of tensors); save one with "
                          "torch.save(model.state_dict(), path)")
    for prefix in ("model.", "module."):
        if all(k.startswith(prefix) for k in state):
            state = {k[len(prefix):]: v for k, v in state.items()}
    return state


def _some(names: list[str], shown: int = 3) -> str:
    """The first ``shown`` of ``names``, and how many more: a wrong file lists hundreds of keys."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


@dataclass
class LoadReport:
    """What :func:`load_pretrained` did: tensors loaded, and the head layers replaced (name -> text)."""

    loaded: int
    replaced: dict[str, str]

    def describe(self) -> str:
        new = "; new head " + ", ".join(f"{k} ({v})" for k, v in self.replaced.items()) if self.replaced else ""
        return f"{self.loaded} tensors loaded{new}"


def load_pretrained(network: nn.Module, state: dict[str, torch.Tensor], head: set[str], name: str,
                    rename: dict[str, str] | None = None, copy: bool = True) -> LoadReport:
    """Copy ``state`` into ``network``, every key and shape checked (else one ``ConfigError`` line, nothing loaded).

    Only in ``head`` (the classifier's keys) may a shape differ, in its first dimension (the classes): that layer
    keeps its fresh initialisation. ``rename``: key prefixes of the file mapped to the network's. ``copy=False``
    only checks (e.g. a network on the meta device, before any process starts).
    """
    for old, new in (rename or {}).items():
        state = {new + k[len(old):] if k.startswith(old) else k: v for k, v in state.items()}
    own = network.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    mismatched = [k for k in own if k in state and own[k].shape != state[k].shape]
    replaced = [k for k in mismatched if k in head and own[k].shape[1:] == state[k].shape[1:]]
    wrong = [k for k in mismatched if k not in replaced]
    if missing or unexpected or wrong:
        parts = [f"{len(missing)} missing ({_some(missing)})" if missing else "",
                 f"{len(unexpected)} unexpected ({_some(unexpected)})" if unexpected else "",
                 f"{len(wrong)} of another shape ("
                 + _some([f"{k} {list(state[k].shape)} vs {list(own[k].shape)}" for k in wrong]) + ")" if wrong else ""]
        raise ConfigError(f"{{weights}} {lit(name)} do not fit this model: {lit('; '.join(p for p in parts if p))} of "
                          f"its {len(own)} tensors (file vs model); pass the {{arch}} (and flags) they were trained "
                          "with, or weights of this model")
    if copy:
        with torch.no_grad():
            for key, value in own.items():
                if key not in replaced:
                    value.copy_(state[key])
    layers: dict[str, str] = {}
    for key in replaced:
        layer = key.rpartition(".")[0]
        if key.endswith("weight") or layer not in layers:
            layers[layer] = f"{state[key].shape[0]} -> {own[key].shape[0]} outputs, freshly initialised"
    return LoadReport(loaded=len(own) - len(replaced), replaced=layers)


class FineTuningRecord(Callback):
    """Fills :attr:`summary` (for ``summary.json``) when training starts: the optimizer's parameter groups and
    the module's ``fine_tuning`` record (weights, new head, schedule)."""

    def __init__(self) -> None:
        self.summary: dict[str, Any] = {}

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        groups = []
        for group in trainer.optimizers[0].param_groups if trainer.optimizers else []:
            params = group["params"]
            groups.append({"name": group.get("name", "all"), "lr": float(group.get("initial_lr", group["lr"])),
                           "weight_decay": float(group.get("weight_decay", 0.0)), "tensors": len(params),
                           "parameters": sum(p.numel() for p in params),
                           "frozen_tensors": sum(not p.requires_grad for p in params)})
        self.summary.update(dict(getattr(pl_module, "fine_tuning", {}) or {}), param_groups=groups)

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.summary["backbone_frozen_at_end"] = bool(getattr(pl_module, "backbone_frozen", False))
