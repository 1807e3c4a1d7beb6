"""The one interface a run's files go through, local folder or bucket alike: read, write whole or not at all,
list, remove, upload, download, prove a folder usable.

A local folder's whole-file write is a temp file renamed over the target; a bucket's (through fsspec, every call
retried on transient errors) is one upload request, whole or absent. Downloads land in a per-process cache: a new
node never reads a previous node's disk.
"""

from __future__ import annotations

import atexit
import io
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable
from fnmatch import fnmatch
from pathlib import Path
from typing import IO, Any, TypeVar

from ddp_recipes.atomic import replace_file
from ddp_recipes.errors import ConfigError, lit
from ddp_recipes.storage import Url, is_url
from ddp_recipes.storage.retry import StorageError, filesystem, reason, retrying

T = TypeVar("T")

CACHE_ENV = "DDP_RECIPES_CACHE_DIR"


class LocalStore:
    """A folder on this machine's file systems (``file://`` paths included)."""

    renames = True  # a whole-file write can be renamed into place

    def attempt(self, what: str, call: Callable[[], T]) -> T:
        return call()

    def read_bytes(self, path: str) -> bytes:
        return _local(path).read_bytes()

    def size(self, path: str) -> int | None:
        file = _local(path)
        return file.stat().st_size if file.is_file() else None

    def listing(self, folder: str) -> list[str]:
        where = _local(folder)
        return sorted(p.name for p in where.iterdir()) if where.is_dir() else []

    def remove(self, path: str) -> None:
        _local(path).unlink(missing_ok=True)

    def write_atomic(self, path: str, write: Callable[[IO[bytes]], None], durable: bool = True) -> None:
        replace_file(_local(path), write, durable)

    def write_new(self, path: str, data: bytes, replace: bool) -> None:
        target = _local(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
        tmp.write_bytes(data)
        try:
            if replace:
                os.replace(tmp, target)
                return
            try:
                os.link(tmp, target)  # atomic, and fails if another process created it first
            except FileExistsError:
                raise
            except OSError:  # a filesystem without hard links
                os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)

    def put_file(self, local: str | os.PathLike, path: str) -> None:
        with open(local, "rb") as source:
            replace_file(_local(path), lambda f: shutil.copyfileobj(source, f))

    def download(self, path: str, dest: Path) -> Path:
        with open(_local(path), "rb") as source:
            replace_file(dest, lambda f: shutil.copyfileobj(source, f))
        return dest

    def check(self, path: str, param: str) -> Path:
        return _local(path)  # the file system is there; a folder is checked where it is made

    def make_writable(self, path: str, param: str) -> Path:
        out = _local(path)
        try:
            out.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=out, prefix=".write-test-"):
                pass
        except OSError as err:
            raise ConfigError(f"{{{param}}} {lit(path)} is not writable ({err.strerror}); pass a writable "
                              f"{{{param}}}", param) from None
        return out


def _local(path: str | os.PathLike) -> Path:
    return Path(os.fspath(path).removeprefix("file://"))


class BucketStore:
    """A bucket (or container) of an object store, through fsspec, every call retried on transient errors."""

    renames = False  # no rename: a checkpoint there is an object plus a manifest (checkpointing.files)

    def attempt(self, what: str, call: Callable[[], T]) -> T:
        return retrying(what, call)

    def read_bytes(self, url: str) -> bytes:
        fs, path = filesystem(url)
        return retrying(f"read of {url}", lambda: fs.cat_file(path))

    def size(self, url: str) -> int | None:
        fs, path = filesystem(url)

        def info() -> int | None:
            fs.invalidate_cache(path)  # another process (the previous node) wrote it
            try:
                return int(fs.info(path)["size"])
            except FileNotFoundError:
                return None

        return retrying(f"lookup of {url}", info)

    def listing(self, url: str) -> list[str]:
        fs, path = filesystem(url)

        def ls() -> list[str]:
            fs.invalidate_cache(path)
            try:
                return sorted(os.path.basename(p.rstrip("/")) for p in fs.ls(path, detail=False))
            except FileNotFoundError:
                return []

        return retrying(f"listing of {url}", ls)

    def remove(self, url: str) -> None:
        fs, path = filesystem(url)

        def rm() -> None:
            try:
                fs.rm_file(path)
            except FileNotFoundError:
                pass

        retrying(f"delete of {url}", rm)

    def write_atomic(self, url: str, write: Callable[[IO[bytes]], None], durable: bool = True) -> None:
        buffer = io.BytesIO()  # one upload: stored whole once it is acknowledged, durable or not
        write(buffer)
        self.put_bytes(url, buffer.getvalue())

    def put_bytes(self, url: str, data: bytes) -> None:
        fs, path = filesystem(url)
        retrying(f"upload of {url}", lambda: fs.pipe_file(path, data))

    def write_new(self, url: str, data: bytes, replace: bool) -> None:
        self.put_bytes(url, data)  # a store without an exclusive create: the last writer's object stays

    def put_file(self, local: str | os.PathLike, url: str) -> None:
        fs, path = filesystem(url)
        retrying(f"upload of {url}", lambda: fs.put_file(os.fspath(local), path))

    def download(self, url: str, dest: Path) -> Path:
        fs, path = filesystem(url)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.part-{os.getpid()}")
        try:
            retrying(f"download of {url}", lambda: fs.get_file(path, os.fspath(tmp)))
            os.replace(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)
        return dest

    def check(self, url: str, param: str) -> Url:
        return check_bucket(url, param)

    def make_writable(self, url: str, param: str) -> Url:
        return check_bucket(url, param)


_LOCAL, _BUCKET = LocalStore(), BucketStore()


def store_of(path: str | os.PathLike) -> LocalStore | BucketStore:
    """The store that serves ``path``: a bucket for a URL (:func:`~ddp_recipes.storage.is_url`), else the local
    file systems."""
    return _BUCKET if is_url(path) else _LOCAL


# ---- the operations, for any path -------------------------------------------------------------------------

def read_bytes(path: str | os.PathLike) -> bytes:
    """The whole file."""
    return store_of(path).read_bytes(os.fspath(path))


def size(path: str | os.PathLike) -> int | None:
    """The file's size in bytes, None when there is no such file."""
    return store_of(path).size(os.fspath(path))


def listing(folder: str | os.PathLike) -> list[str]:
    """The names (not paths) of the entries directly under ``folder``; [] when there is none."""
    return store_of(folder).listing(os.fspath(folder))


def glob(folder: str | os.PathLike, pattern: str) -> list[Any]:
    """The files directly under ``folder`` whose names match ``pattern``, sorted, as paths of its kind."""
    where = Url(os.fspath(folder)) if is_url(folder) else _local(folder)
    found = [where / name for name in listing(where) if fnmatch(name, pattern) and not name.startswith(".")]
    return [p for p in found if isinstance(p, Url) or p.is_file()]


def remove(path: str | os.PathLike) -> None:
    """Delete the file if it is there."""
    store_of(path).remove(os.fspath(path))


def write_atomic(path: str | os.PathLike, write: Callable[[IO[bytes]], None], durable: bool = True) -> None:
    """Call ``write`` with a binary file object; a reader sees the old file or the whole new one.
    ``durable=False``: whole, but not fsynced (a power cut may bring back the old file)."""
    store_of(path).write_atomic(os.fspath(path), write, durable)


def put_bytes(path: str | os.PathLike, data: bytes, durable: bool = True) -> None:
    """Write ``data`` as the file ``path`` through :func:`write_atomic`."""
    write_atomic(path, lambda f: f.write(data), durable)


def write_json_atomic(path: str | os.PathLike, payload: Any, indent: int | None = 2) -> None:
    """``payload`` as JSON (keys sorted, non-JSON values as strings) through :func:`write_atomic`."""
    text = json.dumps(payload, indent=indent, sort_keys=True, default=str) + "\n"
    put_bytes(path, text.encode())


def write_new(path: str | os.PathLike, data: bytes, replace: bool = False) -> None:
    """Write ``data`` as the file ``path``. Unless ``replace``, a file another process created there first is
    a :class:`FileExistsError` on a local file system; a bucket has no exclusive create and takes the write."""
    store_of(path).write_new(os.fspath(path), data, replace)


def put_file(local: str | os.PathLike, path: str | os.PathLike) -> None:
    """Copy the local file to ``path`` (on a bucket a multipart upload appears only when complete)."""
    store_of(path).put_file(local, os.fspath(path))


def download(path: str | os.PathLike, dest: str | os.PathLike) -> Path:
    """Copy ``path`` to the local file ``dest`` (through a temp name: a cut copy is never taken for a whole one)."""
    return store_of(path).download(os.fspath(path), Path(dest))


def attempt(path: str | os.PathLike, what: str, call: Callable[[], T]) -> T:
    """``call()`` (an operation on ``path`` by another library) under the store's error policy: on a bucket
    retried on transient errors, ``what`` naming it."""
    return store_of(path).attempt(what, call)


def renames(path: str | os.PathLike) -> bool:
    """Whether the store of ``path`` can rename a whole file into place (a local file system can; a bucket
    cannot, so a checkpoint there needs a manifest)."""
    return store_of(path).renames


def check_store(path: str | os.PathLike, param: str = "output_dir") -> Path | Url:
    """Prove that the store of ``path`` can be written before anything runs (a bucket: :func:`check_bucket`;
    a local file system needs no proof); returns ``path`` as a Path or Url."""
    return store_of(path).check(os.fspath(path), param)


def make_writable(path: str | os.PathLike, param: str) -> Path | Url:
    """Create the folder ``path`` if needed and prove it writable, or raise naming ``param`` (a bucket:
    :func:`check_bucket`)."""
    return store_of(path).make_writable(os.fspath(path), param)


def check_bucket(url: str, param: str = "output_dir") -> Url:
    """Prove that ``url`` can be written before anything runs (a probe object written and deleted); a missing
    bucket or a refused credential is one line naming ``param``."""
    fs, path = filesystem(url, param)
    bucket = path.strip("/").split("/", 1)[0]
    fix = f"create it or pass another {{{param}}}"

    def probe() -> None:
        # A plain PUT: fsspec's open() would create a missing bucket on the way (makedirs), and its exists()
        # reads "access denied" as "no such bucket".
        probe_path = f"{path.rstrip('/')}/.write-test-{uuid.uuid4().hex[:12]}"
        fs.pipe_file(probe_path, b"")
        fs.rm_file(probe_path)

    try:
        retrying(f"write check of {url}", probe, param=param)
    except StorageError as err:
        cause = err.__cause__
        if isinstance(cause, PermissionError):
            raise ConfigError(f"{{{param}}} {lit(url)}: access denied ({lit(reason(cause))}); check the "
                              "credentials (AWS_ACCESS_KEY_ID/AWS_PROFILE, GOOGLE_APPLICATION_CREDENTIALS, the "
                              f"pod's service account) or pass another {{{param}}}", param) from None
        if isinstance(cause, FileNotFoundError):
            raise ConfigError(f"{{{param}}} {lit(url)}: bucket {lit(bucket)} does not exist; {fix}", param) from None
        endpoint = os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL_S3")
        where = f" (endpoint {endpoint})" if endpoint else ""
        raise ConfigError(f"{err.template}{lit(where)}; check the URL and the endpoint, or pass a local "
                          f"{{{param}}}", param) from None
    return Url(url)


# ---- the local cache -------------------------------------------------------------------------------------

_cache: Path | None = None


def cache_dir() -> Path:
    """This process's local cache for downloads (``DDP_RECIPES_CACHE_DIR``, else a temp folder removed at
    exit)."""
    global _cache
    if _cache is None or not _cache.is_dir():
        root = os.environ.get(CACHE_ENV)
        if root:
            _cache = Path(root) / f"pid-{os.getpid()}"
            _cache.mkdir(parents=True, exist_ok=True)
        else:
            _cache = Path(tempfile.mkdtemp(prefix="ddp-recipes-cache-"))
        atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    return _cache
