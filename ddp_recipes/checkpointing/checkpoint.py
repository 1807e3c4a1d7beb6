"""Checkpoints that survive a kill mid-save, and reading them as plain data.

Lightning's ``_atomic_save`` writes its temp file in ``$TMPDIR`` (often another filesystem: the "rename" is a
copy a kill can cut) and fsyncs nothing. :class:`AtomicCheckpointIO` writes the temp file in the checkpoint's own
folder, fsyncs it, ``os.replace``s it over the old one and fsyncs the folder: a reader sees the old checkpoint or
the new one, never half. Only rank 0 writes; every rank loads the same file. On an object store a save is an
object and then a manifest naming it (:mod:`ddp_recipes.checkpointing.files`).
"""

from __future__ import annotations

import os
import pickle
import re
import zipfile
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.io import TorchCheckpointIO
from typing_extensions import override

from ddp_recipes.checkpointing import files
from ddp_recipes.errors import CheckpointError, ConfigError, lit
from ddp_recipes.storage import is_url
from ddp_recipes.storage.retry import StorageError

CHECKPOINT_DIR = "checkpoints"
RUN_KEY = "ddp_recipes_run"  # a checkpoint's run: {"run_id": ...} (see checkpointing.run_folder.ownership)


def run_of(checkpoint: dict[str, Any]) -> str | None:
    """The run id a loaded checkpoint records (None: it records none, as plain Lightning's do)."""
    entry = checkpoint.get(RUN_KEY)
    run_id = entry.get("run_id") if isinstance(entry, dict) else None
    return run_id if isinstance(run_id, str) and run_id else None


class TrainerStateCallback(Callback):
    """A callback whose checkpoint state is read from the Trainer: Lightning's ``state_dict`` gets no Trainer,
    so the callback keeps the one it was set up with (None before ``setup``)."""

    _trainer: L.Trainer | None = None

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._trainer = trainer


class AtomicCheckpointIO(TorchCheckpointIO):
    """TorchCheckpointIO whose saves, loads and removals go through :mod:`~ddp_recipes.checkpointing.files`:
    temp-file + fsync + rename saves; on a URL, object + manifest saves and loads through a verified local copy."""

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError("AtomicCheckpointIO does not take storage_options")
        files.save(path, lambda f: torch.save(checkpoint, f), step=int(checkpoint.get("global_step", 0)),
                   epoch=int(checkpoint.get("epoch", 0)), run_id=run_of(checkpoint))

    @override
    def load_checkpoint(self, path: str | os.PathLike, map_location: Any = lambda storage, loc: storage,
                        weights_only: bool | None = None) -> dict[str, Any]:
        if is_url(path):
            # A file from an object store never runs code: weights_only whatever the caller asked
            # (fit/test(..., weights_only=False) arrives here as False); the pack's plain-data types are allowed.
            # The copy is the one read_checkpoint already downloaded and verified, or a new one.
            with plain_data():
                return super().load_checkpoint(files.fetch(path), map_location=map_location, weights_only=True)
        return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)

    @override
    def remove_checkpoint(self, path: str | os.PathLike) -> None:
        files.remove_saved(path)


def _safe_globals() -> list[Any]:
    """Plain-data types a user's hyper-parameters commonly hold (an argparse Namespace, a Path, numpy
    scalars): rebuilding them runs no code of the file's choosing, so ``weights_only`` loads may accept them."""
    import argparse
    import pathlib

    import numpy as np

    multiarray = getattr(getattr(np, "_core", None), "multiarray", None) or np.core.multiarray
    dtypes = [t for t in vars(getattr(np, "dtypes", object)).values() if isinstance(t, type)]
    return [argparse.Namespace, pathlib.Path, pathlib.PosixPath, pathlib.WindowsPath, pathlib.PurePosixPath,
            pathlib.PureWindowsPath, multiarray.scalar, np.dtype, *dtypes]


def plain_data():
    """The context for every checkpoint load of the pack (its reader, Lightning's restore):
    ``weights_only`` plus the plain-data types of :func:`_safe_globals`."""
    return torch.serialization.safe_globals(_safe_globals())


def code_refused(err: pickle.UnpicklingError, param: str, name: object, holds: str, fix: str,
                 error: type[ConfigError] = ConfigError) -> ConfigError:
    """The error for a file a ``weights_only`` load refused (``err``): it names Python objects to rebuild, and
    loading them would run code from the file. ``holds``: what such a file may hold; ``fix``: the way on."""
    names = re.findall(r"GLOBAL ([\w.]+)", str(err))
    found = f" ({names[0]})" if names else ""
    return error(f"{{{param}}} {lit(name)} holds Python objects, not only {holds}{lit(found)}; loading it would run "
                 f"code from the file, so it is refused: {fix}", param)


def _starts_as_checkpoint(local: Any) -> bool:
    """Whether the file starts as torch.save writes: a zip archive, or a legacy pickle (protocol 2+)."""
    try:
        with open(local, "rb") as f:
            head = f.read(4)
    except (OSError, TypeError):
        return True  # not a local file: let the loader's own error speak
    return head == b"PK\x03\x04" or head[:1] == b"\x80"


def unreadable_because(local: Any, err: BaseException) -> str:
    """Why a file torch.load refused is no checkpoint, in a user's words: one that does not start as a zip
    archive is some other file; one that does was cut or damaged."""
    reason = str(err).splitlines()[0][:120] if str(err) else type(err).__name__
    try:
        if os.path.getsize(local) == 0:
            return "is empty (0 bytes: a save that never wrote, or a full disk)"
    except (OSError, TypeError):
        pass
    if not _starts_as_checkpoint(local):
        return "is not a checkpoint file (a .ckpt is the zip archive trainer.save_checkpoint writes)"
    if isinstance(err, pickle.UnpicklingError):  # whole, but a weights-only load refuses what it holds
        return "holds Python objects beyond tensors and plain data, which a weights-only load refuses"
    return f"is a cut or damaged checkpoint ({reason})"


def load_header(local: Any) -> Any:
    """A local checkpoint file as plain data, mapped (a zip archive: its tensors are read only when used)."""
    with plain_data():
        return torch.load(local, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(local))


def read_checkpoint(path: str) -> dict[str, Any]:
    """A checkpoint's header on CPU as plain data (mapped: its tensors are read only when used), any failure one
    line naming ``--resume``. ``weights_only=True``: a full unpickle would run whatever code the file names, on
    every rank. A URL is read from a local copy checked against its manifest."""
    local: Any = path
    try:
        local = files.fetch(path)  # the file itself, or a bucket's object downloaded and checked
        checkpoint = load_header(local)
    except pickle.UnpicklingError as err:
        if not _starts_as_checkpoint(local):  # torch reads any other file as a legacy pickle and fails so
            raise CheckpointError(f"{{resume}} {lit(path)} {unreadable_because(local, err)}; "
                                  "pass another file, or {resume} none to start fresh") from None
        raise code_refused(err, "resume", path, "tensors and plain data",
                           "pass a checkpoint written by this pack, or {resume} none", CheckpointError) from None
    except CheckpointError:
        raise
    except StorageError as err:  # the download of a URL checkpoint failed for good
        raise err.renamed(output_dir="resume") from err.__cause__
    except Exception as err:  # truncated zip, pickle garbage, wrong format: all mean "not a checkpoint"
        raise CheckpointError(f"{{resume}} {lit(path)} {unreadable_because(local, err)}; "
                              "pass another file, or {resume} none to start fresh") from None
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise CheckpointError(f"{{resume}} {lit(path)} is not a Lightning checkpoint (no state_dict); "
                          "pass a .ckpt written by this recipe")
    return checkpoint


def check_compatible(checkpoint: dict[str, Any], path: str, expected: dict[str, Any],
                     accepted: dict[str, tuple] | None = None, defaults: dict[str, Any] | None = None) -> None:
    """Fail naming the flag when the checkpoint's hyper-parameters disagree with this run's model. ``accepted``:
    the values this recipe can build (another one means another recipe's checkpoint); ``defaults``: a key's value
    when the checkpoint does not record it."""
    saved = {**(defaults or {}), **(checkpoint.get("hyper_parameters") or {})}
    for key, value in expected.items():
        if key in saved and saved[key] != value:
            flag = "{" + key + "}"  # a parameter: the CLI spells it as the flag
            if accepted and key in accepted and saved[key] not in accepted[key]:
                raise CheckpointError(f"{{resume}} {lit(path)} was trained with {flag} {lit(saved[key])}, which this "
                                      "recipe does not build (a checkpoint of another recipe?); pass a checkpoint "
                                      "written by this recipe")
            raise CheckpointError(f"{{resume}} {lit(path)} was trained with {flag} {lit(saved[key])} but this run has "
                                  f"{flag} {value}; pass {flag} {lit(saved[key])} or another checkpoint")
