"""The error policy of a bucket's operations: the client libraries (botocore, gcsfs) retry a few times on
their own; what still fails with a transient error (timeout, 5xx, throttling) is retried here with
exponential backoff and reported in one line (on rank 0), and anything else (a missing bucket, bad
credentials) fails at once, as a :class:`StorageError` naming the flag."""

from __future__ import annotations

import os
import random
import re
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

from ddp_recipes.errors import ConfigError, lit
from ddp_recipes.extras import install_hint

T = TypeVar("T")

# Backoff of the transient-error retries: 0.5, 1, 2, 4, 8, 16, 16... s (+-25 %), ATTEMPTS tries in all.
ATTEMPTS = int(os.environ.get("DDP_RECIPES_STORAGE_ATTEMPTS", "8"))
BASE_DELAY_S = float(os.environ.get("DDP_RECIPES_STORAGE_BASE_DELAY_S", "0.5"))
MAX_DELAY_S = 16.0
# The package that speaks each protocol, and how to install it (s3fs comes with the pack's `cloud` extra).
PACKAGES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs"}
CLOUD_EXTRA = install_hint("cloud", "s3fs")
_TRANSIENT_TEXT = re.compile(r"\b(429|500|502|503|504)\b|SlowDown|Throttl|ServiceUnavailable|InternalError|"
                             r"RequestTimeout|reduce your request rate|timed? ?out|Connection (reset|refused|aborted)",
                             re.IGNORECASE)


class StorageError(ConfigError):
    """An object-store operation that failed for good (after the retries, or not retryable)."""


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


def reason(err: BaseException) -> str:
    """The first line of an error, at most 160 characters (its type when it says nothing)."""
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
                raise StorageError(f"{{{param}}}: {lit(what)} failed{again} ({lit(reason(err))})", param) from err
            if _abandoned():
                raise StorageError(f"{{{param}}}: {lit(what)} given up ({lit(reason(err))}): the process that started "
                                   "this one has exited", param) from err
            delay = min(MAX_DELAY_S, BASE_DELAY_S * 2 ** (attempt - 1)) * random.uniform(0.75, 1.25)
            if attempt == 1 and _reporting_rank():
                print(f"storage: {what}: {reason(err)}; retrying with backoff (up to {attempts} attempts)",
                      file=sys.stderr, flush=True)
            time.sleep(delay)
        else:
            if attempt > 1 and _reporting_rank():
                print(f"storage: {what}: done after {attempt} attempts", file=sys.stderr, flush=True)
            return result
    raise AssertionError("unreachable")


def _abandoned() -> bool:
    """Whether this is a multiprocessing child (a loader worker) whose parent has exited: nobody waits for what it
    reads, so it stops retrying instead of logging for minutes as an orphan."""
    import multiprocessing

    parent = multiprocessing.parent_process()
    return parent is not None and not parent.is_alive()


def _reporting_rank() -> bool:
    """Whether this process reports retries: rank 0 only (one that gives up still fails loudly); read without
    importing Lightning (the doctor resolves URLs without it)."""
    module = sys.modules.get("lightning_utilities.core.rank_zero")
    rank = getattr(getattr(module, "rank_zero_only", None), "rank", None)
    if rank is None:
        rank = next((os.environ[k] for k in ("RANK", "LOCAL_RANK", "SLURM_PROCID") if k in os.environ), 0)
    return str(rank) == "0"
