"""Where a run's files go when ``--output-dir`` is a URL (``s3://bucket/run``, ``gs://...``, any fsspec URL).

Local paths stay :class:`pathlib.Path`; a URL becomes a :class:`Url`, a ``str`` that joins with ``/`` as a
Path does, so code that writes ``out / "summary.json"`` serves both (``Path("s3://b/x")`` would collapse
the double slash into a local folder named ``s3:``). Every operation on a URL goes through
:func:`retrying`: the client libraries (botocore, gcsfs) retry a few times on their own; what still fails
with a transient error (timeout, 5xx, throttling) is retried here with exponential backoff and reported in
one line (on rank 0), and anything else (a missing bucket, bad credentials) fails at once. :func:`check_store` proves
a URL usable before training starts.

Downloads land in a per-process local cache (``DDP_RECIPES_CACHE_DIR``, else a temp folder removed at
exit): a new node starts with an empty one, so nothing is ever read from a previous node's disk.
"""

from __future__ import annotations

import atexit
import os
import random
import re
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from ddp_recipes.errors import ConfigError, lit

T = TypeVar("T")

CACHE_ENV = "DDP_RECIPES_CACHE_DIR"
# Backoff of the transient-error retries: 0.5, 1, 2, 4, 8, 16, 16... s (+-25 %), ATTEMPTS tries in all.
ATTEMPTS = int(os.environ.get("DDP_RECIPES_STORAGE_ATTEMPTS", "8"))
BASE_DELAY_S = float(os.environ.get("DDP_RECIPES_STORAGE_BASE_DELAY_S", "0.5"))
MAX_DELAY_S = 16.0
# The package that speaks each protocol, and how to install it (s3fs comes with the pack's `cloud` extra).
PACKAGES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs"}
CLOUD_EXTRA = "pip install 'ddp-recipes[cloud]'"
_TRANSIENT_TEXT = re.compile(r"\b(429|500|502|503|504)\b|SlowDown|Throttl|ServiceUnavailable|InternalError|"
                             r"RequestTimeout|reduce your request rate|timed? ?out|Connection (reset|refused|aborted)",
                             re.IGNORECASE)


class StorageError(ConfigError):
    """An object-store operation that failed for good (after the retries, or not retryable)."""


class Url(str):
    """A URL that joins like a Path: ``Url("s3://b/run") / "checkpoints"`` is ``s3://b/run/checkpoints``."""

    def __truediv__(self, part: str | os.PathLike) -> Url:
        return Url(self.rstrip("/") + "/" + os.fspath(part).lstrip("/"))

    @property
    def name(self) -> str:
        return self.rstrip("/").rsplit("/", 1)[-1]

    @property
    def parent(self) -> Url:
        protocol, _, rest = self.partition("://")
        head, _, _ = rest.rstrip("/").rpartition("/")
        return Url(f"{protocol}://{head or rest}")


def is_url(path: Any) -> bool:
    """True for a remote fsspec URL (``s3://``, ``gs://``, ``memory://``...); False for local paths and ``file://``."""
    text = os.fspath(path) if isinstance(path, str | os.PathLike) else ""
    protocol, sep, _ = text.partition("://")
    return bool(sep) and bool(re.fullmatch(r"[a-z][a-z0-9+.-]*", protocol)) and protocol not in ("file", "local")


def location(path: str | os.PathLike) -> Path | Url:
    """``path`` as a :class:`Url` when it is one, else a :class:`~pathlib.Path` (``file://`` stripped)."""
    text = os.fspath(path)
    if is_url(text):
        return Url(text)
    return Path(text.removeprefix("file://"))


def filesystem(url: str, param: str = "output_dir") -> tuple[Any, str]:
    """(fsspec filesystem, path inside it) of ``url``; a missing client package is a one-line error naming
    the pip extra."""
    import fsspec

    try:
        return fsspec.core.url_to_fs(url)
    except ImportError:
        protocol = url.partition("://")[0]
        package = PACKAGES.get(protocol, f"the fsspec package for {protocol}://")
        how = CLOUD_EXTRA if package == "s3fs" else f"pip install {package}"
        raise ConfigError(f"{{{param}}} {lit(url)} needs {package}, which is not installed: {how}", param) from None
    except ValueError as err:  # an unknown protocol
        raise ConfigError(f"{{{param}}} {lit(url)}: {lit(str(err).splitlines()[0])}; pass a local folder or an "
                          "fsspec URL such as s3://bucket/prefix", param) from None


def is_transient(err: BaseException) -> bool:
    """A timeout, a dropped connection, a 5xx or a throttling answer: worth trying again. Not a missing
    bucket or object, not a refused credential."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, FileNotFoundError | PermissionError | IsADirectoryError | NotADirectoryError):
            return False
        if isinstance(err, TimeoutError | ConnectionError):
            return True
        status = _status(err)
        if status is not None:
            return status == 429 or status >= 500
        name = type(err).__name__
        if "Timeout" in name or "Connection" in name or name in ("IncompleteRead", "ClientPayloadError"):
            return True
        if _TRANSIENT_TEXT.search(str(err)):
            return True
        err = err.__cause__ or err.__context__
    return False


def _status(err: BaseException) -> int | None:
    response = getattr(err, "response", None)  # botocore's ClientError
    if isinstance(response, dict):
        code = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
        return int(code) if isinstance(code, int) else None
    code = getattr(err, "code", None) if type(err).__name__ == "HttpError" else None  # gcsfs
    return code if isinstance(code, int) else None


def _reason(err: BaseException) -> str:
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return text[:160]


def retrying(what: str, call: Callable[[], T], *, param: str = "output_dir", attempts: int | None = None) -> T:
    """``call()``, retried with exponential backoff while it fails with a transient error (one line on
    stderr when the first retry starts); any other error, or the last transient one, is a
    :class:`StorageError` naming ``param``."""
    attempts = attempts or ATTEMPTS
    for attempt in range(1, attempts + 1):
        try:
            result = call()
        except ConfigError:
            raise
        except Exception as err:  # the client libraries raise OSError, their own errors, or aiohttp's
            if not is_transient(err) or attempt == attempts:
                again = f" after {attempt} attempts" if attempt > 1 else ""
                raise StorageError(f"{{{param}}}: {lit(what)} failed{again} ({lit(_reason(err))})", param) from err
            delay = min(MAX_DELAY_S, BASE_DELAY_S * 2 ** (attempt - 1)) * random.uniform(0.75, 1.25)
            if attempt == 1 and _reporting_rank():
                print(f"storage: {what}: {_reason(err)}; retrying with backoff (up to {attempts} attempts)",
                      file=sys.stderr, flush=True)
            time.sleep(delay)
        else:
            if attempt > 1 and _reporting_rank():
                print(f"storage: {what}: done after {attempt} attempts", file=sys.stderr, flush=True)
            return result
    raise AssertionError("unreachable")


def _reporting_rank() -> bool:
    """Whether this process reports retries: rank 0 only (every rank reads the store; one that gives up
    still fails loudly). Lightning's rank once it is known, else the launcher's variables; read without
    importing Lightning (the doctor resolves URLs without it)."""
    module = sys.modules.get("lightning_utilities.core.rank_zero")
    rank = getattr(getattr(module, "rank_zero_only", None), "rank", None)
    if rank is None:
        rank = next((os.environ[k] for k in ("RANK", "LOCAL_RANK", "SLURM_PROCID") if k in os.environ), 0)
    return str(rank) == "0"


# ---- operations on URLs ----------------------------------------------------------------------------------


def put_bytes(url: str, data: bytes) -> None:
    """Write ``data`` as the object ``url`` in one request: readers see the old object or the new one."""
    fs, path = filesystem(url)
    retrying(f"upload of {url}", lambda: fs.pipe_file(path, data))


def put_file(local: str | os.PathLike, url: str) -> None:
    """Upload the local file to ``url`` (multipart for big files: the object appears only when complete)."""
    fs, path = filesystem(url)
    retrying(f"upload of {url}", lambda: fs.put_file(os.fspath(local), path))


def read_bytes(url: str) -> bytes:
    fs, path = filesystem(url)
    return retrying(f"read of {url}", lambda: fs.cat_file(path))


def size(url: str) -> int | None:
    """The object's size in bytes, None when there is no such object."""
    fs, path = filesystem(url)

    def info() -> int | None:
        fs.invalidate_cache(path)  # another process (the previous node) wrote it
        try:
            return int(fs.info(path)["size"])
        except FileNotFoundError:
            return None

    return retrying(f"lookup of {url}", info)


def listing(url: str) -> list[str]:
    """The names (not paths) of the entries directly under the folder ``url``; [] when there is none."""
    fs, path = filesystem(url)

    def ls() -> list[str]:
        fs.invalidate_cache(path)
        try:
            return sorted(os.path.basename(p.rstrip("/")) for p in fs.ls(path, detail=False))
        except FileNotFoundError:
            return []

    return retrying(f"listing of {url}", ls)


def remove(url: str) -> None:
    """Delete the object ``url`` if it is there."""
    fs, path = filesystem(url)

    def rm() -> None:
        try:
            fs.rm_file(path)
        except FileNotFoundError:
            pass

    retrying(f"delete of {url}", rm)


def download(url: str, dest: str | os.PathLike) -> Path:
    """Copy the object ``url`` to the local file ``dest`` (through a temp name: a cut download is never
    taken for a whole one)."""
    fs, path = filesystem(url)
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.part-{os.getpid()}")
    try:
        retrying(f"download of {url}", lambda: fs.get_file(path, os.fspath(tmp)))
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


def check_store(url: str, param: str = "output_dir") -> Url:
    """Prove that ``url`` can be written before anything runs: the bucket (or container) exists and a probe
    object can be written and deleted. A missing bucket or a refused credential is one line naming
    ``param``; transient errors are retried."""
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
            raise ConfigError(f"{{{param}}} {lit(url)}: access denied ({lit(_reason(cause))}); check the "
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
