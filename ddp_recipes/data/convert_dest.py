"""The converter's destination side: what DEST already holds, publishing a staged split, and ``classes.json``.

DEST (local or a bucket prefix) holds only what the converter writes; anything else means DEST is someone else's
folder, refused, never overwritten. Publishing order makes a stop anywhere safe: a split's chunks, then its
``index.json``, then ``classes.json`` last; a split counts as converted only when ``classes.json`` lists it and its
index is there.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

from ddp_recipes.data.convert_source import SPLITS, Source
from ddp_recipes.errors import DataError, lit
from ddp_recipes.storage import Url, absolute, is_url
from ddp_recipes.storage.store import check_store, listing, put_file, read_bytes, remove, size, write_json_atomic

CLASSES_FILE = "classes.json"
FORMAT = "ddp-recipes imagefolder stream"  # classes.json's mark: this converter wrote the folder
STAGING = ".staging"  # a local DEST's default staging folder
SPLIT_FILES = ("chunk-*.bin", "index.json")


@dataclass
class Dest:
    """DEST as found: where it is, its ``classes.json`` (None before the first split is published) and the
    splits already converted there."""

    where: Path | Url
    record: dict[str, Any] | None
    done: set[str] = field(default_factory=set)

    def samples(self, split: str) -> int:
        return int(self.record["splits"][split]["samples"]) if self.record else 0


def inspect_dest(dest: str, source: Source, staging: Path | None = None) -> Dest:
    """DEST checked before anything is written: its store reachable, and nothing in it this converter did not
    write (a :class:`DataError` naming ``{dest}``). A split folder is ours when ``classes.json`` lists it or
    ``staging`` holds its fingerprint (a publish that stopped before ``classes.json``)."""
    where = absolute(dest)
    if isinstance(where, Path):
        if where.exists() and not where.is_dir():
            raise DataError(f"{{dest}} {lit(where)} is a file; pass a folder (new or empty) or a bucket URL", "dest")
        if where == source.root or source.root in where.parents or where in source.root.parents:
            raise DataError(f"{{dest}} {lit(where)} overlaps SRC {lit(source.root)}; pass a folder outside SRC",
                            "dest")
    check_store(where, "dest")
    names = listing(where)
    foreign = [n for n in names if n not in (*SPLITS, CLASSES_FILE, STAGING)]
    record = _read_record(where) if CLASSES_FILE in names else None
    if record is None and CLASSES_FILE in names:
        foreign.append(CLASSES_FILE)
    listed = (record or {}).get("splits", {})
    for split in set(SPLITS) & set(names):
        files = listing(where / split)
        ours = split in listed or bool(staging and (staging / f"{split}.fingerprint").is_file())
        foreign += [f"{split}/{n}" for n in files if not ours or not any(fnmatch(n, p) for p in SPLIT_FILES)]
    if foreign:
        shown = ", ".join(sorted(foreign)[:4]) + (f" and {len(foreign) - 4} more" if len(foreign) > 4 else "")
        raise DataError(f"{{dest}} {lit(where)} holds files this converter did not write ({lit(shown)}); pass a "
                        "new or empty DEST (nothing was changed there)", "dest")
    if record is not None and record["classes"] != source.classes:
        raise DataError(f"{{dest}} {lit(where)} holds a conversion of other classes ({len(record['classes'])}: "
                        f"{lit(', '.join(record['classes'][:4]))}...) than SRC's {len(source.classes)}; pass "
                        "another DEST", "dest")
    done = {s for s in listed if size(where / s / "index.json") is not None and not missing_chunks(where / s)}
    return Dest(where, record, done)


def missing_chunks(split: Path | Url) -> list[str]:
    """The chunks ``split/index.json`` names that ``split`` does not hold (one listing), and in a local split the
    ones cut short (``"chunk-0-3.bin (100 of 3980510 bytes)"``), which a reader would only meet mid-epoch."""
    try:
        index = json.loads(read_bytes(split / "index.json"))
        named = {c["filename"]: int(c.get("chunk_bytes", -1)) for c in index["chunks"]}
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return ["index.json (not litdata's index)"]
    there = set(listing(split))
    wrong = [name for name in named if name not in there]
    if isinstance(split, Path):  # a bucket's objects are whole or absent (a PUT is atomic)
        for name, expected in named.items():
            if name in there and expected >= 0 and (found := (split / name).stat().st_size) != expected:
                wrong.append(f"{name} ({found} of {expected} bytes)")
    return wrong


def _read_record(where: Path | Url) -> dict[str, Any] | None:
    try:
        record = json.loads(read_bytes(where / CLASSES_FILE))
    except (ValueError, UnicodeDecodeError):
        return None
    ours = isinstance(record, dict) and record.get("format") == FORMAT and isinstance(record.get("classes"), list)
    return record if ours else None


def publish(staged: Path, target: Path | Url) -> int:
    """Put the staged split ``staged`` at ``target``: chunks (renamed on the same file system, else uploaded),
    then ``index.json``; returns its sample count. Rerun after a stop, it finishes the job."""
    index = json.loads((staged / "index.json").read_text("utf-8"))
    chunks = [c["filename"] for c in index["chunks"]]
    wanted = {*chunks, "index.json"}
    for name in listing(target):  # an earlier attempt's chunks (other workers, other sizes): nothing names them
        if name not in wanted:
            remove(target / name)
    rename = isinstance(target, Path) and _same_device(staged, target)
    if rename:
        target.mkdir(parents=True, exist_ok=True)
    for name in chunks:
        source = staged / name
        if not source.exists():
            if size(target / name) is None:
                raise DataError(f"{{staging}} {lit(staged)} lost {lit(name)} before it reached DEST; delete "
                                f"{lit(staged)} and rerun", "staging")
            continue  # moved there by the stopped attempt
        if rename:
            os.replace(source, target / name)
        else:
            put_file(source, target / name)
    put_file(staged / "index.json", target / "index.json")  # a copy: the staged index still says "staged"
    return sum(int(c["chunk_size"]) for c in index["chunks"])


def _same_device(a: Path, b: Path) -> bool:
    b_existing = next(p for p in (b, *b.parents) if p.exists())
    return os.stat(a).st_dev == os.stat(b_existing).st_dev


def write_record(dest: Dest, source: Source, splits: dict[str, dict[str, Any]], litdata_version: str) -> None:
    """``classes.json``, last: the class list once, and per split its sample count and the corrupt files left
    out; splits converted by an earlier run keep their entries."""
    record = {
        "format": FORMAT,
        "classes": source.classes,
        "splits": {**(dest.record or {}).get("splits", {}), **splits},
        "sample": {"image": "the source file's bytes, as encoded on disk", "label": "class index into classes",
                   "path": "the file's path relative to SRC"},
        "litdata": litdata_version,
    }
    write_json_atomic(dest.where / CLASSES_FILE, record)


def default_staging(where: Path | Url) -> Path:
    """A local DEST stages inside itself (renames, no copy); a bucket DEST in the system temp folder, under a
    name made from its URL, so that a rerun finds what a stopped run staged."""
    if not is_url(where):
        return Path(where) / STAGING
    import hashlib
    import tempfile

    return Path(tempfile.gettempdir()) / "ddp-recipes-convert" / hashlib.sha256(str(where).encode()).hexdigest()[:16]


def clear_staged(staging: Path, split: str) -> None:
    """Remove one split's staged files once ``classes.json`` lists it, and the staging folder once empty."""
    for path in (staging / split, staging / f"{split}.corrupt"):
        shutil.rmtree(path, ignore_errors=True)
    (staging / f"{split}.fingerprint").unlink(missing_ok=True)
    left = [p for p in staging.iterdir() if p.name != ".cache"] if staging.is_dir() else []
    if not left:
        shutil.rmtree(staging, ignore_errors=True)
