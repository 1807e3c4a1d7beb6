"""The converter's source side: an ImageFolder's classes and files, read the way ``--data imagefolder`` reads
them (torchvision's ``find_classes`` and ``make_dataset``), and the per-file work litdata's workers do.

A sample is the file's encoded bytes as on disk (the stream is as small as the folder; decoding stays in the
training loader), its class index and its path relative to SRC. Each file is decoded in full once here, so a
corrupt one (or one the loader would refuse, :mod:`ddp_recipes.data.pixels`) is named and left out now, not at
epoch 37.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddp_recipes.data.pixels import as_rgb
from ddp_recipes.data.unreadable import unreadable
from ddp_recipes.errors import DataError, MissingDataError, lit

PROG = "python -m ddp_recipes.data.convert"
SPLITS = ("train", "val")


@dataclass(frozen=True)
class Split:
    """One split of SRC: its litdata inputs (``[absolute path, label, path relative to SRC]`` lists: litdata's
    checkpoint compares them after a JSON round trip, which a tuple does not survive) and what identifies them."""

    name: str
    items: list[list[Any]]
    fingerprint: str  # of the files (names, sizes, mtimes) and the settings that shape the chunks


@dataclass(frozen=True)
class Source:
    """SRC as the converter reads it: the class names in ImageFolder order and the splits found."""

    root: Path
    classes: list[str]
    splits: list[Split]


def read_source(src: str, settings: dict[str, Any]) -> Source:
    """SRC's classes (from ``SRC/train``) and the image files of ``SRC/train`` and, when present, ``SRC/val``;
    a :class:`DataError` naming ``{src}`` when the folder is not an ImageFolder or the splits disagree.
    ``settings`` (workers, chunk size, litdata version) go into each split's fingerprint."""
    from torchvision.datasets.folder import IMG_EXTENSIONS, find_classes, make_dataset

    root = Path(src).expanduser().absolute()
    if not (root / "train").is_dir():
        where = "does not exist" if not root.exists() else "has no train/ folder"
        raise MissingDataError(f"{{src}} {lit(root)} {where}; pass an ImageFolder: SRC/train/<class>/<image> "
                               "(and SRC/val/<class>/<image>)", "src")
    classes = _classes(root / "train", find_classes)
    splits = []
    for name in SPLITS:
        folder = root / name
        if not folder.is_dir():
            continue
        if name != "train" and (theirs := _classes(folder, find_classes)) != classes:
            odd = sorted(set(theirs) ^ set(classes)) or ["(the same names in another order)"]
            raise DataError(f"{{src}} {lit(root)}: {name}/ has other class folders than train/ (differ: "
                            f"{lit(', '.join(odd[:5]))}); give both splits the same class folders", "src")
        try:
            found = make_dataset(str(folder), {c: i for i, c in enumerate(classes)}, extensions=IMG_EXTENSIONS)
        except FileNotFoundError as err:  # a class folder with no image file
            raise DataError(f"{{src}} {lit(root)}: {lit(str(err).splitlines()[0])}; put images in every class "
                            "folder or remove the empty one", "src") from None
        items = [[path, label, Path(path).relative_to(root).as_posix()] for path, label in found]
        splits.append(Split(name, items, _fingerprint(root, items, settings)))
    return Source(root, classes, splits)


def _classes(folder: Path, find_classes: Any) -> list[str]:
    try:
        return list(find_classes(str(folder))[0])
    except FileNotFoundError:
        raise MissingDataError(f"{{src}} {lit(folder.parent)}: {folder.name}/ has no class folders; pass an "
                               "ImageFolder: SRC/train/<class>/<image>", "src") from None


def _fingerprint(root: Path, items: list[list[Any]], settings: dict[str, Any]) -> str:
    # A file replaced in SRC (another size or mtime), another --workers or --chunk-bytes: the staged chunks no
    # longer describe this conversion, and litdata's checkpoint would refuse them, so the split starts over.
    files = [(rel, label, *_stat(path)) for path, label, rel in items]
    text = json.dumps([str(root), settings, files], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def _stat(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns


def encode(item: list[Any], corrupt_log: str) -> dict[str, Any] | None:
    """litdata's per-file function (run in its workers): the sample, or None for a file no decoder reads (a
    raising file stops litdata's whole job). A corrupt file is named on stderr and logged under ``corrupt_log``,
    which survives a kill, so a resumed conversion still reports it."""
    path, label, rel = item
    with open(path, "rb") as f:
        data = f.read()
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as image:
            image.load()  # the whole decode: verify() passes a truncated JPEG
            as_rgb(image)  # the training loader's conversion: a mode it refuses is refused now
    except (OSError, SyntaxError, ValueError) as err:  # what the recipe's loader names (data/unreadable.py)
        named = str(unreadable(rel, None, err))
        print(f"{PROG}: corrupt file: {named}", file=sys.stderr, flush=True)
        os.makedirs(corrupt_log, exist_ok=True)
        with open(os.path.join(corrupt_log, f"worker-{os.getpid()}.txt"), "a", encoding="utf-8") as log:
            log.write(named + "\n")
        return None
    return {"image": data, "label": int(label), "path": rel}


def corrupt_files(corrupt_log: Path) -> list[str]:
    """The corrupt files the workers logged (each once, sorted): ``"train/c1/x.jpg (why)"``."""
    if not corrupt_log.is_dir():
        return []
    lines = {line for log in corrupt_log.glob("worker-*.txt") for line in log.read_text("utf-8").splitlines()}
    return sorted(line for line in lines if line)
