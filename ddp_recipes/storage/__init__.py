"""Where a run's files go: a local folder or a bucket (``s3://bucket/run``, ``gs://...``, any fsspec URL).

Local paths stay :class:`pathlib.Path`; a URL becomes a :class:`Url`, a ``str`` that joins with ``/`` as a
Path does, so ``out / "summary.json"`` serves both (``Path("s3://b/x")`` would collapse the double slash).
Every file operation goes through :mod:`ddp_recipes.storage.store`.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any


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


def absolute(path: str | os.PathLike) -> Path | Url:
    """:func:`location` made absolute: a local path from the working directory, a URL as it is."""
    where = location(path)
    return where if isinstance(where, Url) else Path(os.path.abspath(where))


def same_path(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether ``a`` and ``b`` name one place: local paths once resolved (symlinks followed), URLs as text (a
    trailing ``/`` aside); a local path is never a URL's place."""
    a, b = absolute(a), absolute(b)
    if isinstance(a, Url) or isinstance(b, Url):
        return str(a).rstrip("/") == str(b).rstrip("/")
    return os.path.realpath(a) == os.path.realpath(b)
