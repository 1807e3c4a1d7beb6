"""A checkpoint as files, wherever the run's folder is: saved whole or not at all, found again, read back.

Where the store renames (a local folder), a checkpoint is one file renamed into place. A bucket has no rename: a
save writes a new object ``<folder>/objects/last-<step>-<token>.ckpt``, then its manifest
``<folder>/last.ckpt.manifest.json`` (object, size, sha256, step, epoch, run id), then deletes the old object; a
kill before the manifest leaves the previous checkpoint the one resumed (docs/cloud-and-kubernetes.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from ddp_recipes.errors import CheckpointError, lit
from ddp_recipes.lightning_seam.reach import is_local_path
from ddp_recipes.storage import Url
from ddp_recipes.storage.store import (
    cache_dir,
    download,
    glob,
    listing,
    put_bytes,
    put_file,
    read_bytes,
    remove,
    renames,
    size,
    write_atomic,
)

MANIFEST = ".manifest.json"
OBJECTS = "objects"
FORMAT = "ddp-recipes-checkpoint-manifest/1"
CHECKPOINTS = "*.ckpt"


class OneFile:
    """A checkpoint on a store that renames: the file itself, replaced whole by each save."""

    def save(self, path: str, write: Callable[[IO[bytes]], None], step: int, epoch: int, run_id: str | None) -> None:
        if not is_local_path(path):
            raise TypeError(f"AtomicCheckpointIO cannot save to {path}")
        write_atomic(path, write)

    def remove(self, path: str) -> None:
        remove(path)

    def exists(self, path: str) -> bool:
        return size(path) is not None

    def resolve(self, path: str) -> tuple[str, dict[str, Any] | None]:
        if size(path) is None:
            raise CheckpointError(f"{{resume}} {lit(path)}: no such checkpoint file; pass an existing .ckpt, auto or "
                                  "none")
        return path, None

    def manifest(self, path: str) -> dict[str, Any] | None:
        return None

    def saved_in(self, folder: str, extra: list[Any], asked: str) -> list[tuple[str, dict[str, Any] | None]]:
        return [(p, None) for p in dict.fromkeys([*glob(folder, CHECKPOINTS), *extra])]

    def loose(self, folder: str, pattern: str) -> list[Any]:
        return glob(folder, pattern)

    def fetch(self, path: str) -> Any:
        return path


class Published:
    """A checkpoint on a store without rename: an object plus the manifest naming it (the module docstring)."""

    def save(self, url: str, write: Callable[[IO[bytes]], None], step: int, epoch: int, run_id: str | None) -> None:
        url = Url(url)
        folder, name = url.parent, url.name
        stem = name.removesuffix(".ckpt")
        spool = cache_dir() / f"upload-{os.getpid()}-{secrets.token_hex(4)}.ckpt"
        try:
            with open(spool, "wb") as f:
                write(f)
            digest = _sha256(spool)
            target = folder / OBJECTS / f"{stem}-{step:08d}-{secrets.token_hex(4)}.ckpt"
            put_file(spool, target)
            nbytes = spool.stat().st_size
        finally:
            spool.unlink(missing_ok=True)
        entry = {"format": FORMAT, "name": name, "object": f"{OBJECTS}/{target.name}", "bytes": nbytes,
                 "sha256": digest, "global_step": int(step), "epoch": int(epoch), "run_id": run_id}
        put_bytes(manifest_url(url), (json.dumps(entry, indent=2, sort_keys=True) + "\n").encode())
        # The new manifest is in place: the object it replaced, and any left by an upload killed before its
        # manifest (a store without atomic uploads keeps a partial one), are garbage now.
        keep = {target.name}
        for old in listing(folder / OBJECTS):
            if old not in keep and re.fullmatch(re.escape(stem) + r"-\d{8,}-[0-9a-f]{8}\.ckpt", old):
                remove(folder / OBJECTS / old)

    def remove(self, url: str) -> None:
        """The manifest first (the checkpoint is invisible from then on), then its object."""
        url = Url(url)
        entry = _read_manifest(manifest_url(url))
        remove(manifest_url(url))
        if entry is not None:
            remove(url.parent / entry["object"])

    def exists(self, url: str) -> bool:
        return size(manifest_url(url)) is not None or size(url) is not None

    def resolve(self, url: str) -> tuple[Url, dict[str, Any] | None]:
        url = Url(url)
        for candidate in ((url,) if url.endswith(MANIFEST) else (manifest_url(url),)):
            entry = _read_manifest(candidate)
            if entry is not None:
                return Url(candidate).parent / entry["object"], entry
        if not url.endswith(MANIFEST) and size(url) is not None:
            return url, None
        raise CheckpointError(f"{{resume}} {lit(url)}: no such checkpoint (no object, no {MANIFEST} manifest); "
                              "pass an existing checkpoint URL, auto or none")

    def manifest(self, url: str) -> dict[str, Any] | None:
        return self.resolve(url)[1]

    def saved_in(self, folder: str, extra: list[Any], asked: str) -> list[tuple[Url, dict[str, Any] | None]]:
        """Every complete checkpoint: its manifest parses and names an object that is there with the recorded
        size. Others are skipped with a one-line warning naming the request, ``asked``. The folder's
        manifests are all: ``extra`` local files are not taken for a bucket's folder."""
        folder = Url(folder)
        found = []
        for entry_name in listing(folder):
            if not entry_name.endswith(".ckpt" + MANIFEST):
                continue
            where = folder / entry_name
            entry = _read_manifest(where)
            if entry is None:
                rank_zero_warn(f"{asked}: skipping {where}: not a checkpoint manifest")
                continue
            actual = size(folder / entry["object"])
            if actual != entry.get("bytes"):
                state = "missing" if actual is None else f"{actual} bytes, the manifest says {entry.get('bytes')}"
                rank_zero_warn(f"{asked}: skipping {where}: its object {entry['object']} is {state}")
                continue
            found.append((Url(where.removesuffix(MANIFEST)), entry))
        return found

    def loose(self, folder: str, pattern: str) -> list[Any]:
        return []  # a bucket's checkpoints are the manifests of its checkpoint folder

    def fetch(self, url: str) -> Path:
        target, entry = self.resolve(url)
        if target in _fetched and _fetched[target].is_file():
            return _fetched[target]
        local = download(target, cache_dir() / "checkpoints" / target.name)
        if entry is not None:
            if _sha256(local) != entry.get("sha256"):
                local.unlink(missing_ok=True)
                raise CheckpointError(f"{{resume}} {lit(url)}: the downloaded object {lit(target)} does not match "
                                      "its manifest's sha256 (changed or damaged in the store); pass another "
                                      "checkpoint")
        _fetched[target] = local
        return local


_fetched: dict[str, Path] = {}
_ONE_FILE, _PUBLISHED = OneFile(), Published()


def _rule(path: str | os.PathLike) -> OneFile | Published:
    return _ONE_FILE if renames(path) else _PUBLISHED


def manifest_url(url: str) -> Url:
    """The manifest of the checkpoint saved as ``url`` (``.../last.ckpt`` -> ``.../last.ckpt.manifest.json``)."""
    return Url(url + MANIFEST)


def _read_manifest(url: Url) -> dict[str, Any] | None:
    if size(url) is None:
        return None
    try:
        entry = json.loads(read_bytes(url))
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(entry, dict) or entry.get("format") != FORMAT or not isinstance(entry.get("object"), str):
        return None
    return entry


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# ---- the interface ---------------------------------------------------------------------------------------

def save(path: str | os.PathLike, write: Callable[[IO[bytes]], None], step: int, epoch: int,
         run_id: str | None = None) -> None:
    """Save the checkpoint ``write`` serialises (into a binary file) as ``path``, whole or not at all."""
    _rule(path).save(os.fspath(path), write, step, epoch, run_id)


def remove_saved(path: str | os.PathLike) -> None:
    """Remove the checkpoint saved as ``path``."""
    _rule(path).remove(os.fspath(path))


def exists(path: str | os.PathLike) -> bool:
    """Whether a checkpoint is saved as ``path`` (on a bucket: its manifest, or a plain object of that name)."""
    return _rule(path).exists(os.fspath(path))


def resolve(path: str | os.PathLike) -> tuple[Any, dict[str, Any] | None]:
    """(the file to read, its manifest or None) for ``--resume PATH``: on a bucket a manifest, the name a
    checkpoint was saved under, or an object. Raises naming ``--resume`` when there is nothing there."""
    return _rule(path).resolve(os.fspath(path))


def manifest(path: str | os.PathLike) -> dict[str, Any] | None:
    """What the store records of the checkpoint ``path`` beside it (a bucket's manifest); None where the
    checkpoint is only its file. Raises naming ``--resume`` when a bucket holds nothing there."""
    return _rule(path).manifest(os.fspath(path))


def saved_in(folder: str | os.PathLike, extra: list[Any] | None = None,
             asked: str = "--resume auto") -> list[tuple[Any, dict[str, Any] | None]]:
    """(path, manifest or None) of every complete checkpoint in ``folder`` (``*.ckpt``; on a bucket, the
    manifests), plus the local ``extra`` files where the folder is local."""
    return _rule(folder).saved_in(os.fspath(folder), list(extra or []), asked)


def loose(folder: str | os.PathLike, pattern: str) -> list[Any]:
    """Checkpoint files matching ``pattern`` directly in ``folder``, outside a checkpoint folder (Lightning's
    SLURM ``hpc_ckpt_N.ckpt``); none on a bucket."""
    return _rule(folder).loose(os.fspath(folder), pattern)


def fetch(path: str | os.PathLike) -> Any:
    """The checkpoint at ``path`` as a local file: the file itself, or on a bucket (any form :func:`resolve`
    takes) a copy in this process's cache, downloaded once and checked against its manifest's size and sha256."""
    return _rule(path).fetch(os.fspath(path))


class SeesPublished:
    """A ``ModelCheckpoint``'s ``file_exists`` that knows a name on a bucket is a manifest plus an object (else
    Lightning's version counter sees no name taken and each save overwrites the last). A class: it pickles."""

    def __init__(self, callback: Any) -> None:
        self.callback = callback

    def __call__(self, filepath: str, trainer: Any) -> bool:
        if renames(filepath):  # one file per name: the callback's own check
            return type(self.callback).file_exists(self.callback, filepath, trainer)
        # Rank 0 asks the store (it is the one that writes), the others take its answer.
        return trainer.strategy.broadcast(exists(filepath) if trainer.is_global_zero else False)


def see_published(callbacks: list[Any]) -> None:
    """Give every ``ModelCheckpoint`` among ``callbacks`` a :class:`SeesPublished` ``file_exists``."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    for callback in callbacks:
        if isinstance(callback, ModelCheckpoint) and not isinstance(vars(callback).get("file_exists"), SeesPublished):
            callback.file_exists = SeesPublished(callback)
