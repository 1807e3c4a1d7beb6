"""Checkpoints in object storage: whole or invisible, with no rename to lean on.

A save of ``<folder>/last.ckpt`` on a URL writes two things, in this order:

1. the checkpoint itself as a new object ``<folder>/objects/last-<step>-<token>.ckpt`` (spooled to the local
   cache first, then uploaded; a multipart upload appears only once complete, and a cut one is a new name
   nobody points at);
2. the manifest ``<folder>/last.ckpt.manifest.json``: a small JSON naming that object, its size, sha256,
   global step, epoch and run id (:mod:`~ddp_recipes.checkpointing.ownership`), written in one request.

Then the object the manifest named before is deleted. ``--resume auto`` reads only manifests and takes the
one with the most steps whose object is there with the recorded size; the download is checked against the
sha256 before it is loaded. A kill before step 2 leaves the previous manifest and its object untouched,
so the previous complete checkpoint is the one resumed. ``--resume URL`` takes a manifest, the name it was
saved under (``.../checkpoints/last.ckpt``) or a checkpoint object.
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
from ddp_recipes.storage import (
    Url,
    cache_dir,
    download,
    is_url,
    listing,
    put_bytes,
    put_file,
    read_bytes,
    remove,
    size,
)

MANIFEST = ".manifest.json"
OBJECTS = "objects"
FORMAT = "ddp-recipes-checkpoint-manifest/1"


def manifest_url(url: str) -> Url:
    """The manifest of the checkpoint saved as ``url`` (``.../last.ckpt`` -> ``.../last.ckpt.manifest.json``)."""
    return Url(url + MANIFEST)


def publish(url: str, write: Callable[[IO[bytes]], None], step: int, epoch: int, run_id: str | None = None) -> Url:
    """Save a checkpoint as ``url`` on an object store (the module docstring's two steps); returns the
    object written. ``write`` serialises the checkpoint into a binary file."""
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
    return target


def unpublish(url: str) -> None:
    """Remove the checkpoint saved as ``url``: its manifest first (it is invisible from then on), then its object."""
    url = Url(url)
    entry = _read_manifest(manifest_url(url))
    remove(manifest_url(url))
    if entry is not None:
        remove(url.parent / entry["object"])


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


def published(folder: str, asked: str = "--resume auto") -> list[tuple[Url, dict[str, Any]]]:
    """(manifest URL, manifest) of every complete checkpoint in ``folder``: the manifest parses and names
    an object that is there with the recorded size. Others are skipped with a one-line warning (naming the
    request, ``asked``)."""
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
        found.append((where, entry))
    return found


def newest_published(folder: str) -> Url | None:
    """The checkpoint object ``--resume auto`` takes in ``folder``: the most optimizer steps, then epochs,
    ties to last.ckpt, then by name (the rule of the local folders); None when there is none."""
    best: tuple[tuple[int, int, int, str], Url] | None = None
    for where, entry in published(folder):
        name = entry.get("name", "")
        key = (int(entry.get("global_step", 0)), int(entry.get("epoch", 0)), int(name == "last.ckpt"), name)
        if best is None or key > best[0]:
            best = (key, where)
    return best[1] if best else None


def resolve_url(url: str) -> tuple[Url, dict[str, Any] | None]:
    """(checkpoint object, its manifest or None) for ``--resume URL``: a manifest, the name a checkpoint
    was saved under, or an object. Raises naming ``--resume`` when there is nothing there."""
    url = Url(url)
    for candidate in ((url,) if url.endswith(MANIFEST) else (manifest_url(url),)):
        entry = _read_manifest(candidate)
        if entry is not None:
            return Url(candidate).parent / entry["object"], entry
    if not url.endswith(MANIFEST) and size(url) is not None:
        return url, None
    raise CheckpointError(f"{{resume}} {lit(url)}: no such checkpoint (no object, no {MANIFEST} manifest); pass "
                          "an existing checkpoint URL, auto or none")


def exists(url: str) -> bool:
    """Whether a checkpoint is saved as ``url``: its manifest, or a plain object of that name."""
    return size(manifest_url(url)) is not None or size(url) is not None


class SeesPublished:
    """A ``ModelCheckpoint``'s ``file_exists`` that knows a name on a URL is a manifest plus an object.

    Lightning's version counter (``epoch=0.ckpt`` taken: save ``epoch=0-v1.ckpt``; the same for ``save_last``)
    asks the callback's filesystem whether the name exists: on a URL only the manifest does, so each save
    overwrote the last one. A class, not a closure: the callback stays picklable (the spawn launcher).
    """

    def __init__(self, callback: Any) -> None:
        self.callback = callback

    def __call__(self, filepath: str, trainer: Any) -> bool:
        if not is_url(filepath):
            return type(self.callback).file_exists(self.callback, filepath, trainer)
        # Rank 0 asks the store (it is the one that writes), the others take its answer.
        return trainer.strategy.broadcast(exists(filepath) if trainer.is_global_zero else False)


def see_published(callbacks: list[Any]) -> None:
    """Give every ``ModelCheckpoint`` among ``callbacks`` a :class:`SeesPublished` ``file_exists``."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    for callback in callbacks:
        if isinstance(callback, ModelCheckpoint) and not isinstance(vars(callback).get("file_exists"), SeesPublished):
            callback.file_exists = SeesPublished(callback)


_fetched: dict[str, Path] = {}


def fetch(url: str) -> Path:
    """The checkpoint at ``url`` (any form :func:`resolve_url` takes) as a local file in this process's
    cache, downloaded once and checked against its manifest's size and sha256."""
    target, entry = resolve_url(url)
    if target in _fetched and _fetched[target].is_file():
        return _fetched[target]
    local = download(target, cache_dir() / "checkpoints" / target.name)
    if entry is not None:
        if _sha256(local) != entry.get("sha256"):
            local.unlink(missing_ok=True)
            raise CheckpointError(f"{{resume}} {lit(url)}: the downloaded object {lit(target)} does not match its "
                                  "manifest's sha256 (changed or damaged in the store); pass another checkpoint")
    _fetched[target] = local
    return local


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
