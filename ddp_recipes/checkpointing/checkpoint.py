"""Checkpoints that survive a kill mid-save, and the ``--resume auto|PATH`` rule.

Lightning's TorchCheckpointIO (``_atomic_save``) writes inside an fsspec transaction: the bytes go to a
temp file from ``tempfile.mkstemp()``, i.e. in ``$TMPDIR``, which is often another filesystem than the
checkpoint folder (a node-local /tmp, a network home), so the final "rename" is a copy that a kill can cut
short, and nothing is fsynced, so a power cut can leave the new name with missing data.
:class:`AtomicCheckpointIO` writes the temp file in the checkpoint's own folder, fsyncs it, renames it over
the old one (``os.replace``: atomic on POSIX within one filesystem) and fsyncs the folder, so a reader sees
the old checkpoint or the new one, never half of one; the temp file a killed save leaves behind is removed
by the next save. Only rank 0 writes (Lightning's strategies call ``save_checkpoint`` on rank 0
only); every rank loads the same file. On an object store (``--output-dir s3://...``), where there is no
rename, a save is an object and then a manifest naming it (:mod:`ddp_recipes.checkpointing.remote`).
"""

from __future__ import annotations

import os
import pickle
import re
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from ddp_recipes.atomic import atomic_write
from ddp_recipes.checkpointing import remote
from ddp_recipes.errors import CheckpointError, lit
from ddp_recipes.storage import StorageError, Url, check_store, is_url

CHECKPOINT_DIR = "checkpoints"


class AtomicCheckpointIO(TorchCheckpointIO):
    """TorchCheckpointIO with temp-file + fsync + rename saves; on a URL, object + manifest saves
    (:func:`~ddp_recipes.checkpointing.remote.publish`) and loads through a verified local copy."""

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError("AtomicCheckpointIO does not take storage_options")
        if is_url(path):
            remote.publish(os.fspath(path), lambda f: torch.save(checkpoint, f),
                           step=int(checkpoint.get("global_step", 0)), epoch=int(checkpoint.get("epoch", 0)))
            return
        if not _is_local_file_protocol(path):
            raise TypeError(f"AtomicCheckpointIO cannot save to {path}")
        atomic_write(Path(os.fspath(path).removeprefix("file://")), lambda f: torch.save(checkpoint, f))

    @override
    def load_checkpoint(self, path: str | os.PathLike, map_location: Any = lambda storage, loc: storage,
                        weights_only: bool | None = None) -> dict[str, Any]:
        if is_url(path):  # the copy read_checkpoint already downloaded and verified, or a new one
            local = remote.fetch(os.fspath(path))
            # weights_only whatever the caller asked (fit/test(..., weights_only=False) arrives here as False):
            # a file from a store never runs code; the pack's plain-data types are allowed.
            with plain_data():
                return super().load_checkpoint(local, map_location=map_location, weights_only=True)
        return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)

    @override
    def remove_checkpoint(self, path: str | os.PathLike) -> None:
        if is_url(path):
            remote.unpublish(os.fspath(path))
            return
        super().remove_checkpoint(path)


def resolve_resume(resume: str | None, output_dir: str) -> str | None:
    """The checkpoint to resume from: None (fresh), the newest complete one under ``output_dir`` for
    "auto" (None when there is none yet; see :func:`newest_checkpoint`), or PATH, which must exist."""
    if not resume or resume == "none":
        return None
    if resume == "auto":
        if is_url(output_dir):  # a missing bucket or a refused credential fails here, not as "no checkpoint"
            check_store(os.fspath(output_dir), "output_dir")
        return newest_checkpoint(output_dir)
    if is_url(resume):
        try:
            remote.resolve_url(resume)  # raises naming --resume when there is nothing there
        except StorageError as err:  # refused, or the store is down: about --resume, not --output-dir
            raise err.renamed(output_dir="resume") from err.__cause__
        return resume
    if not Path(resume).is_file():
        raise CheckpointError(f"{{resume}} {lit(resume)}: no such checkpoint file; pass an existing .ckpt, auto or none")
    return resume


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


def checkpoint_candidates(output_dir: str | os.PathLike) -> list[Path]:
    """What ``--resume auto`` considers: ``checkpoints/*.ckpt`` (last, best, the recipe's others) and
    Lightning's SLURM ``hpc_ckpt_*.ckpt`` in the output folder. Temp files of unfinished saves are not."""
    out = Path(output_dir)
    found = [*sorted((out / CHECKPOINT_DIR).glob("*.ckpt")), *sorted(out.glob("hpc_ckpt_*.ckpt"))]
    return [p for p in found if p.is_file() and not p.name.startswith(".")]


def checkpoint_position(path: str | os.PathLike) -> tuple[int, int]:
    """(global step, epoch) of a checkpoint, read without loading its tensors; raises if unreadable."""
    with plain_data():
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise ValueError("not a Lightning checkpoint")
    return int(checkpoint.get("global_step", 0)), int(checkpoint.get("epoch", 0))


def newest_checkpoint(output_dir: str | os.PathLike) -> str | None:
    """The complete checkpoint with the most optimizer steps, skipping truncated or unreadable files with a
    one-line warning each; None when there is none. Ties go to last.ckpt, then the newest hpc_ckpt_N, then
    by name: every rank resolves this on its own before the process group exists, so the rule uses what
    the files say, not their write times. On a URL: the newest manifest whose object is complete
    (:func:`~ddp_recipes.checkpointing.remote.newest_published`), as the name it was saved under."""
    if is_url(output_dir):
        found = remote.newest_published(Url(os.fspath(output_dir)) / CHECKPOINT_DIR)
        return found.removesuffix(remote.MANIFEST) if found else None
    return newest_of(checkpoint_candidates(output_dir))


def newest_of(paths: list[Path], asked: str = "--resume auto") -> str | None:
    """:func:`newest_checkpoint`'s rule over ``paths``; ``asked`` names the request in the warnings."""
    best: tuple[tuple[int, int, tuple[int, int, str]], Path] | None = None
    for path in paths:
        try:
            step, epoch = checkpoint_position(path)
        except Exception as err:  # truncated zip, garbage, not a checkpoint: skip it, keep looking
            reason = str(err).splitlines()[0][:120] if str(err) else type(err).__name__
            rank_zero_warn(f"{asked}: skipping {path}: not a readable checkpoint ({reason})")
            continue
        key = (step, epoch, _tie_rank(path))
        if best is None or key > best[0]:
            best = (key, path)
    return str(best[1]) if best else None


def _tie_rank(path: Path) -> tuple[int, int, str]:
    number = path.stem.removeprefix("hpc_ckpt_")
    if path.name == "last.ckpt":
        return (2, 0, path.name)
    if path.name.startswith("hpc_ckpt_") and number.isdigit():
        return (1, int(number), path.name)
    return (0, 0, path.name)


def read_checkpoint(path: str) -> dict[str, Any]:
    """Load a checkpoint on CPU as plain data, turning any failure into one line naming ``--resume``.

    ``weights_only=True``: a ``.ckpt`` is a pickle, and a full unpickle runs whatever code the file names,
    on every rank. The pack's checkpoints hold only tensors, numbers, strings, lists and dicts; a user's
    hyper-parameters may add a Namespace, a Path or numpy scalars (:func:`plain_data`). A file with anything
    else is refused before any of it runs. A URL is read from a local copy checked against its manifest.
    """
    try:
        local = remote.fetch(path) if is_url(path) else path
        with plain_data():
            checkpoint = torch.load(local, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        names = re.findall(r"GLOBAL ([\w.]+)", str(err))
        raise CheckpointError(f"{{resume}} {lit(path)} holds Python objects, not only tensors and plain data"
                          f"{' (' + names[0] + ')' if names else ''}; loading it would run code from the file, so "
                          "it is refused: pass a checkpoint written by this pack, or {resume} none") from None
    except CheckpointError:
        raise
    except StorageError as err:  # the download of a URL checkpoint failed for good
        raise err.renamed(output_dir="resume") from err.__cause__
    except Exception as err:  # truncated zip, pickle garbage, wrong format: all mean "not a checkpoint"
        raise CheckpointError(f"{{resume}} {lit(path)} is not a readable checkpoint ({type(err).__name__}: "
                          f"{str(err).splitlines()[0][:120] if str(err) else 'unreadable'}); "
                          "pass another file, or {resume} none to start fresh") from None
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise CheckpointError(f"{{resume}} {lit(path)} is not a Lightning checkpoint (no state_dict); "
                          "pass a .ckpt written by this recipe")
    return checkpoint


def check_compatible(checkpoint: dict[str, Any], path: str, expected: dict[str, Any],
                     accepted: dict[str, tuple] | None = None, defaults: dict[str, Any] | None = None) -> None:
    """Fail naming the flag when the checkpoint's hyper-parameters disagree with this run's model.

    ``accepted`` lists the values this recipe can build (e.g. its ``--arch`` choices): a checkpoint with
    another one comes from another recipe, and suggesting its value would only fail again. ``defaults``:
    the value a key had when the checkpoint does not record it (the recipe passes some only when set).
    """
    saved = {**(defaults or {}), **(checkpoint.get("hyper_parameters") or {})}
    for key, value in expected.items():
        if key in saved and saved[key] != value:
            flag = "{" + key + "}"  # a parameter: the CLI spells it as the flag
            if accepted and key in accepted and saved[key] not in accepted[key]:
                raise CheckpointError(f"{{resume}} {lit(path)} was trained with {flag} {lit(saved[key])}, which this recipe does not "
                                  "build (a checkpoint of another recipe?); pass a checkpoint written by this recipe")
            raise CheckpointError(f"{{resume}} {lit(path)} was trained with {flag} {lit(saved[key])} but this run has {flag} "
                              f"{value}; pass {flag} {lit(saved[key])} or another checkpoint")
