"""Checkpoints that survive a kill mid-save, and the ``--resume auto|PATH`` rule.

Lightning's TorchCheckpointIO writes the final path directly: a process killed during the write leaves a
truncated ``last.ckpt`` and the previous one is gone. :class:`AtomicCheckpointIO` writes a temp file in the
same folder, fsyncs it and renames it over the old one (``os.replace`` is atomic on POSIX), so a reader
sees the old checkpoint or the new one, never half of one; the temp file a killed save leaves behind is
removed by the next save. Only rank 0 writes (Lightning's strategies call ``save_checkpoint`` on rank 0
only); every rank loads the same file.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from ddp_recipes.config import ConfigError

CHECKPOINT_DIR = "checkpoints"


class AtomicCheckpointIO(TorchCheckpointIO):
    """TorchCheckpointIO with temp-file + fsync + rename saves."""

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError("AtomicCheckpointIO does not take storage_options")
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
        _remove_stale_temps(target)
        try:
            with open(tmp, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
        _fsync_dir(target.parent)


def _remove_stale_temps(target: Path) -> None:
    # A save killed between open and rename leaves its temp file (as large as a checkpoint); its writer
    # is gone when no process has its pid any more.
    for stale in target.parent.glob(f".{target.name}.tmp-*"):
        pid = stale.name.rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            stale.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _fsync_dir(folder: Path) -> None:
    # The rename itself must reach the disk, or a power cut can bring back the old name's contents.
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class RNGStateCheckpoint(Callback):
    """Every rank's python/numpy/torch RNG state goes into the checkpoint and comes back on resume.

    Lightning restores weights, optimizer, scheduler and loops, not random streams; without this, a resumed
    run draws other augmentations and dropout masks (and DataLoader worker seeds, which come from the main
    process's torch RNG) than the uninterrupted one. ``state_dict`` runs on every rank when a checkpoint is
    dumped, so gathering there is safe. Restored at train start, after the checkpoint and before the
    first epoch's loader iterator. A resume at another world size keeps the fresh per-rank seeds.
    """

    def __init__(self) -> None:
        self._pending: list[dict[str, Any]] | None = None

    @override
    def state_dict(self) -> dict[str, Any]:
        name, keys, pos, has_gauss, gauss = np.random.get_state()
        # Plain lists and tensors only: Lightning may load checkpoints with torch.load(weights_only=True).
        state = {"python": random.getstate(), "numpy": (name, keys.tolist(), pos, has_gauss, gauss),
                 "torch": torch.get_rng_state(),
                 "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}
        if dist.is_available() and dist.is_initialized():
            ranks: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, state)
            return {"ranks": ranks}
        return {"ranks": [state]}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._pending = state_dict.get("ranks")

    @override
    def on_train_start(self, trainer, pl_module) -> None:
        pending, self._pending = self._pending, None
        if not pending:
            return
        if len(pending) != trainer.world_size:
            rank_zero_info(f"checkpoint RNG states are for {len(pending)} rank(s), this run has "
                           f"{trainer.world_size}: keeping fresh per-rank seeds")
            return
        state = pending[trainer.global_rank]
        random.setstate(state["python"])
        name, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
        torch.set_rng_state(state["torch"])
        if state["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])


def resolve_resume(resume: str | None, output_dir: str) -> str | None:
    """The checkpoint to resume from: None (fresh), the latest in ``<output-dir>/checkpoints`` for "auto"
    (None when there is none yet), or PATH, which must exist."""
    if not resume or resume == "none":
        return None
    if resume == "auto":
        last = Path(output_dir) / CHECKPOINT_DIR / "last.ckpt"
        return str(last) if last.exists() else None
    if not Path(resume).is_file():
        raise ConfigError(f"--resume {resume}: no such checkpoint file; pass an existing .ckpt, auto or none")
    return resume


def read_checkpoint(path: str) -> dict[str, Any]:
    """Load a checkpoint on CPU, turning any failure into one line naming ``--resume``."""
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # truncated zip, pickle garbage, wrong format: all mean "not a checkpoint"
        raise ConfigError(f"--resume {path} is not a readable checkpoint ({type(err).__name__}: "
                          f"{str(err).splitlines()[0][:120] if str(err) else 'unreadable'}); "
                          "pass another file, or --resume none to start fresh") from None
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise ConfigError(f"--resume {path} is not a Lightning checkpoint (no state_dict); "
                          "pass a .ckpt written by this recipe")
    return checkpoint


def check_compatible(checkpoint: dict[str, Any], path: str, expected: dict[str, Any]) -> None:
    """Fail naming the flag when the checkpoint's hyper-parameters disagree with this run's model."""
    saved = checkpoint.get("hyper_parameters") or {}
    for key, value in expected.items():
        if key in saved and saved[key] != value:
            flag = "--" + key.replace("_", "-")
            raise ConfigError(f"--resume {path} was trained with {flag} {saved[key]} but this run has {flag} "
                              f"{value}; pass {flag} {saved[key]} or another checkpoint")
