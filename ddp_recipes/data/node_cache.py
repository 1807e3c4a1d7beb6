"""The node's cache of a bucket's stream: one folder per dataset, shared by every rank on the node and their loader
workers (a folder per rank would download the dataset once per rank), removed when the last process using it exits.

Each joining process holds an exclusive ``flock`` on ``leases/<id>`` for its life; the kernel drops it when the
process dies (SIGKILL too), so a lease that can be locked is a dead process's (no pids, no clocks). A folder whose
leases can all be locked is removed by the last leaver and by every join. More: docs/streaming.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import socket
import tempfile
import uuid
from collections.abc import Iterator
from multiprocessing.util import Finalize
from pathlib import Path

from ddp_recipes.errors import ConfigError, lit
from ddp_recipes.storage.store import CACHE_ENV

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]

KEY = re.compile(r"[0-9a-f]{24}")  # only folders of this name are ever removed: nothing else under the root is ours
LEASES = "leases"

_held: dict[Path, tuple[int, Path | None]] = {}  # folder -> this process's open, locked lease and its file
_owner: int | None = None  # the pid _held belongs to: a forked child inherits the dict, not the leases' ownership


def cache_root() -> Path:
    """Where the node's stream folders live (``$DDP_RECIPES_CACHE_DIR/stream``, else under the temp folder)."""
    root = os.environ.get(CACHE_ENV)
    if root:
        return Path(root) / "stream"
    user = os.getuid() if hasattr(os, "getuid") else 0  # another user's folder there is not writable
    return Path(tempfile.gettempdir()) / f"ddp-recipes-stream-{user}"


def dataset_key(url: str, indexes: dict[str, bytes]) -> str:
    """The folder name of a dataset: its URL and every split's ``index.json`` (its chunk list and ``updated_at``),
    so a dataset converted again into the same URL never reads the old one's chunks."""
    digest = hashlib.sha256(url.rstrip("/").encode())
    for split in sorted(indexes):
        digest.update(f"\0{split}\0".encode() + hashlib.sha256(indexes[split]).digest())
    return digest.hexdigest()[:24]


def join(key: str) -> Path:
    """The node's folder for ``key``, created if needed, with this process's lease on it until it exits; dead
    processes' folders under the root are removed first. A root this process cannot write (a read-only disk,
    another user's folder) is one line naming ``DDP_RECIPES_CACHE_DIR`` (a :class:`ConfigError`)."""
    try:
        return _join(key)
    except OSError as err:
        raise ConfigError(f"{CACHE_ENV} {lit(cache_root())}: the stream cache cannot be made there "
                          f"({lit(err.strerror or err)}); point {CACHE_ENV} at a writable local disk of this "
                          "user's") from None


def _join(key: str) -> Path:
    global _owner
    if _owner != os.getpid():  # a forked child: the parent's leases are the parent's
        _held.clear()
        _owner = os.getpid()
        # multiprocessing's exit hook, not atexit: it also runs in a rank that Lightning's fork launcher started
        # (a multiprocessing child, which ends in os._exit); a forked loader worker starts with it emptied.
        Finalize(None, _leave, exitpriority=0)
    root = cache_root()
    folder = root / key
    if folder in _held:
        return folder
    if fcntl is None:
        folder = root / f"{key}-pid-{os.getpid()}"  # not a KEY name: removed by this process only
        folder.mkdir(parents=True, exist_ok=True)
        _held[folder] = (-1, None)
        return folder
    root.mkdir(parents=True, exist_ok=True)
    with _root_locked(root):
        _collect_locked(root)
        (folder / LEASES).mkdir(parents=True, exist_ok=True)
        lease = folder / LEASES / f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        fd = os.open(lease, os.O_CREAT | os.O_RDWR, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)  # never blocks: the name is new
        _held[folder] = (fd, lease)
    return folder


def collect(root: Path | None = None) -> list[Path]:
    """Remove every folder under ``root`` (the cache root) that no live process holds a lease on; the ones removed."""
    root = cache_root() if root is None else root
    if fcntl is None or not root.is_dir():
        return []
    with _root_locked(root):
        return _collect_locked(root)


def in_use(folder: Path) -> bool:
    """Whether a live process holds a lease on ``folder``; dead processes' leases found on the way are removed."""
    live = False
    for lease in sorted((folder / LEASES).glob("*")):
        try:
            fd = os.open(lease, os.O_RDWR)
        except FileNotFoundError:
            continue
        try:
            # A new open file description: it conflicts with the holder's lock even in the holder's own process.
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            live = True
        else:
            lease.unlink(missing_ok=True)
        finally:
            os.close(fd)
    return live


def _collect_locked(root: Path) -> list[Path]:
    removed = []
    for folder in sorted(root.iterdir()):
        if folder.is_dir() and KEY.fullmatch(folder.name) and not in_use(folder):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


@contextlib.contextmanager
def _root_locked(root: Path) -> Iterator[None]:
    fd = os.open(root / ".lock", os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # drops the lock


def _leave() -> None:
    """At exit: give up this process's leases, then remove every folder no live process holds."""
    if _owner != os.getpid():
        return
    roots = {folder.parent for folder in _held}
    for folder, (fd, lease) in _held.items():
        if lease is None:
            shutil.rmtree(folder, ignore_errors=True)
            continue
        # By its own path: containers sharing a volume can show the same host name and pid.
        lease.unlink(missing_ok=True)
        os.close(fd)
    _held.clear()
    for root in roots:
        with contextlib.suppress(OSError):
            collect(root)
