"""Whether a checkpoint's weights fit the network a run builds, told before any process starts.

Lightning's restore of a checkpoint of another network ends each rank in a traceback listing every key. Here the
run's module is built on the meta device (no memory, milliseconds) and its names and shapes compared with the
file's: what does not match is one line naming a few of each.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities.model_helpers import is_overridden

from ddp_recipes.errors import CheckpointError, lit

SHOWN = 3  # names quoted per kind of mismatch


def meta_module(build: Callable[[], L.LightningModule]) -> L.LightningModule | None:
    """The module ``build`` makes, on the meta device, with its ``configure_model`` run (Lightning runs it before it
    restores a checkpoint); None when it cannot be built there (the ranks then load the file as they would)."""
    try:
        with torch.device("meta"):
            module = build()
            if is_overridden("configure_model", module, L.LightningModule):
                module.configure_model()
    except Exception:  # noqa: BLE001 - a module that needs real tensors to be built is checked in the ranks
        return None
    return module


def _prefixes(names: Iterable[str]) -> str:
    counts = Counter(name.split(".", 1)[0] + "." if "." in name else name for name in names)
    return " / ".join(f"'{prefix}'" for prefix, _ in counts.most_common(SHOWN))


def _some(names: list[str]) -> str:
    more = f" (+{len(names) - SHOWN} more)" if len(names) > SHOWN else ""
    return ", ".join(names[:SHOWN]) + more


def check_state_fits(checkpoint: dict[str, Any], path: str, module: L.LightningModule, base: type,
                     flags: str) -> None:
    """Refuse, naming ``--resume``, a checkpoint whose ``state_dict`` would not load into ``module`` (names, when
    it loads strictly, and shapes). A subclass of ``base`` that overrides ``on_load_checkpoint``,
    ``load_state_dict`` or ``setup`` may rename keys or add layers itself: left to the load. ``flags``: the
    recipe's flags that shape its network, for the fix."""
    cls = type(module)
    if any(getattr(cls, hook) is not getattr(base, hook) for hook in ("on_load_checkpoint", "load_state_dict",
                                                                      "setup")):
        return
    saved = checkpoint.get("state_dict")
    if not isinstance(saved, dict):
        return  # read_checkpoint refused a file without one already
    own = module.state_dict()
    expected = {name: tuple(t.shape) for name, t in own.items() if isinstance(t, torch.Tensor)}
    held = {name: tuple(t.shape) for name, t in saved.items() if isinstance(t, torch.Tensor)}
    strict = getattr(module, "strict_loading", True) is not False
    missing = [name for name in expected if name not in held] if strict else []
    unexpected = [name for name in held if name not in expected] if strict else []
    lazy = torch.nn.parameter.UninitializedParameter  # a lazy module's shape is known after its first batch
    reshaped = [f"{name} {list(held[name])} in the file, {list(shape)} here" for name, shape in expected.items()
                if name in held and held[name] != shape and not isinstance(own[name], lazy)]
    where = f"{{resume}} {lit(path)}"
    if missing or unexpected:
        parts = [f"missing: {_some(missing)}" if missing else "", f"unexpected: {_some(unexpected)}" if unexpected
                 else "", f"other shapes: {_some(reshaped)}" if reshaped else ""]
        raise CheckpointError(
            f"{where} does not hold the network this run builds: its state_dict has {len(held)} tensors whose names "
            f"start with {_prefixes(held) or 'nothing'} while this run's {cls.__name__} has {len(expected)} starting "
            f"with {_prefixes(expected)} ({lit('; '.join(p for p in parts if p))}); pass a checkpoint this recipe "
            "wrote (<output-dir>/checkpoints/last.ckpt), or {resume} none to start fresh", "resume")
    if reshaped:
        raise CheckpointError(
            f"{where} holds this run's {cls.__name__} with other shapes ({lit(_some(reshaped))}): it was trained "
            f"with other {flags}; pass those, or another checkpoint", "resume")
