"""How a local file is written so that a reader sees it whole or not at all (the local store's whole-file
write: :func:`ddp_recipes.storage.store.write_atomic`, behind checkpoints, summary.json, the doctor's JSON).

The bytes go to a temp file in the target's own folder (``os.replace`` is atomic only within one
filesystem), are flushed and fsynced, renamed over the target, and the folder is fsynced so the rename
survives a power cut. A file that need only be whole (``durable=False``: a log rewritten at every log step,
which plain Lightning appends to without either) skips both fsyncs: a killed process still leaves the old
file or the new one. The temp file a killed writer leaves behind is removed by the next write once no
process has its pid.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import IO


def replace_file(target: str | os.PathLike, write: Callable[[IO[bytes]], None], durable: bool = True) -> None:
    """Call ``write`` with a binary file object; the result replaces the local file ``target`` in one rename
    (with ``durable``, one that survives a power cut)."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    _remove_stale_temps(target)
    try:
        with open(tmp, "wb") as f:
            write(f)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    if durable:
        _fsync_dir(target.parent)


def _remove_stale_temps(target: Path) -> None:
    # A write killed between open and rename leaves its temp file (as large as a checkpoint); its writer
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
