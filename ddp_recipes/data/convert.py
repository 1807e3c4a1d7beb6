"""`python -m ddp_recipes.data.convert SRC DEST`: an ImageFolder made into a streamable dataset (litdata's).

    python -m ddp_recipes.data.convert /data/imagenet /data/imagenet-stream
    python -m ddp_recipes.data.convert /data/imagenet s3://bucket/imagenet --workers 16

Each split is written by ``litdata.optimize`` into a local staging folder with its checkpoints on (a stopped
conversion continues), then published to DEST; ``DEST/classes.json`` comes last. docs/streaming.md has the format.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stdout
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any

from ddp_recipes.config.cli import build_parser, fail, opt
from ddp_recipes.data.convert_dest import clear_staged, default_staging, inspect_dest, publish, write_record
from ddp_recipes.data.convert_source import PROG, Split, corrupt_files, encode, read_source
from ddp_recipes.data.encoded import JPEG_SUFFIXES
from ddp_recipes.data.litdata_lib import import_litdata
from ddp_recipes.errors import ConfigError, DataError, flag, lit
from ddp_recipes.storage import absolute

# Sizes as litdata reads them: KB/MB/GB are powers of 1000; the binary spellings are accepted too.
UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


@dataclass
class ConvertConfig:
    """The converter's operands and flags; ``__post_init__`` checks each, naming it."""

    src: str = opt("", "the ImageFolder: SRC/train/<class>/<image> and, when present, SRC/val/<class>/<image>",
                   positional=True, metavar="SRC")
    dest: str = opt("", "a new or empty local folder, or an fsspec URL such as s3://bucket/prefix",
                    positional=True, metavar="DEST")
    chunk_bytes: str = opt("4MB", "size of one chunk file, e.g. 4MB (powers of 1000) or 4MiB; the pack reads a "
                                  "sample by reading its chunk, so larger chunks read slower (docs/streaming.md)")
    workers: int | None = opt(None, "conversion processes (default: the CPU count); changing it restarts a "
                                    "stopped split")
    staging: str | None = opt(None, "local folder chunks are written to first (default: DEST/.staging for a "
                                    "local DEST, else a folder named after DEST in the system temp folder); a "
                                    "stopped conversion continues from it")
    skip_corrupt: bool = opt(False, "leave out files no decoder reads (each named, and listed in classes.json) "
                                    "instead of refusing to publish the dataset")
    chunk_size: int = field(init=False, default=0)  # chunk_bytes in bytes

    def __post_init__(self) -> None:
        text = self.chunk_bytes.strip().lower().replace(" ", "")
        unit = next((u for u in sorted(UNITS, key=len, reverse=True) if text.endswith(u)), None)
        number = text[: -len(unit)] if unit else ""
        if unit is None or not number.isdigit() or int(number) * UNITS[unit] < 1024:
            raise ConfigError(f"{{chunk_bytes}} must be a size of at least 1KB such as 64MB or 256MiB (got "
                              f"{lit(repr(self.chunk_bytes))})")
        self.chunk_size = int(number) * UNITS[unit]
        if self.workers is None:
            self.workers = os.cpu_count() or 1
        if self.workers < 1:
            raise ConfigError(f"{{workers}} must be >= 1 (got {self.workers})")
        if not self.src or not self.dest:
            raise ConfigError("give both SRC and DEST", "src")


@dataclass
class Staged:
    """A split written to the staging folder: where, its corrupt files and how long it took."""

    folder: Path
    corrupt: list[str]
    seconds: float


def main(argv: list[str] | None = None) -> int:
    """Convert SRC into DEST: 0 when DEST holds every split, 2 (one line naming the operand or flag) on bad
    input, a foreign DEST, a missing bucket or extra, or corrupt files without ``--skip-corrupt``."""
    parser = build_parser(ConvertConfig, prog=PROG, description=__doc__.splitlines()[0])
    try:
        cfg = ConvertConfig(**vars(parser.parse_args(argv)))
        return convert(cfg, import_litdata())
    except ConfigError as err:
        fail(err.render(_spelling).strip().splitlines()[0], PROG)


def _spelling(param: str) -> str:
    """SRC and DEST are operands, spelled as the usage line spells them; the rest are flags."""
    return {"src": "SRC", "dest": "DEST"}.get(param, flag(param))


def convert(cfg: ConvertConfig, litdata: ModuleType) -> int:
    """Stage every split not yet at DEST, then (no corrupt file, or ``skip_corrupt``) publish them and write
    ``classes.json``; every check comes before the first write."""
    settings = {"workers": cfg.workers, "chunk_size": cfg.chunk_size, "litdata": litdata.__version__}
    source = read_source(cfg.src, settings)
    where = absolute(cfg.dest)
    staging = Path(cfg.staging).expanduser().absolute() if cfg.staging else default_staging(where)
    if cfg.staging and isinstance(where, Path) and (staging == where or where in staging.parents):
        # DEST holds only what the converter publishes: a folder of the user's inside it would be "foreign"
        # to the rerun that should continue the stopped conversion.
        raise ConfigError(f"{{staging}} {lit(staging)} is inside DEST {lit(where)}; pass a folder outside it, or "
                          "leave --staging out (a local DEST stages in DEST/.staging)")
    dest = inspect_dest(cfg.dest, source, staging)
    todo = [s for s in source.splits if s.name not in dest.done]
    for split in source.splits:
        if split.name in dest.done:
            print(f"{split.name}: already converted ({dest.samples(split.name)} samples in "
                  f"{dest.where / split.name}); nothing to do", flush=True)
    if not todo:
        return 0
    staged = {split.name: stage(split, staging, cfg, litdata) for split in todo}
    corrupt = [name for s in staged.values() for name in s.corrupt]
    if corrupt and not cfg.skip_corrupt:
        shown = "; ".join(corrupt[:3]) + (f"; and {len(corrupt) - 3} more (named above)" if len(corrupt) > 3 else "")
        raise DataError(f"{{src}} {lit(source.root)} holds {len(corrupt)} file(s) no decoder reads: {lit(shown)}; "
                        "remove or replace them, or pass {skip_corrupt} to leave them out (listed in "
                        f"classes.json); the rest is converted and waits in {lit(staging)}", "src")
    entries = {}
    for split in todo:
        samples = publish(staged[split.name].folder, dest.where / split.name)
        entries[split.name] = {"samples": samples, "files": len(split.items), "corrupt": staged[split.name].corrupt,
                               "not_jpeg": not_jpeg(split, staged[split.name].corrupt)}
        print(f"{split.name}: {samples} samples, {len(source.classes)} classes, "
              f"{len(staged[split.name].corrupt)} corrupt file(s) left out -> {dest.where / split.name} "
              f"({staged[split.name].seconds:.1f}s)", flush=True)
    write_record(dest, source, entries, litdata.__version__)
    for split in todo:
        clear_staged(staging, split.name)
    if corrupt:
        print(f"{len(corrupt)} corrupt file(s) left out, listed in {dest.where / 'classes.json'}:", flush=True)
        for name in corrupt:
            print(f"  {name}", flush=True)
    print(f"done: {dest.where} ({', '.join(s.name for s in source.splits)}; classes.json)", flush=True)
    return 0


def not_jpeg(split: Split, corrupt: list[str]) -> int:
    """The published files not named .jpg/.jpeg: ``--decode gpu`` warns about them before training, as it does
    for a folder (nvJPEG refuses them; each is decoded on the CPU)."""
    left_out = {line.rsplit(" (", 1)[0] for line in corrupt}  # "train/c1/x.png (why)"
    return sum(1 for _, _, rel in split.items if not rel.lower().endswith(JPEG_SUFFIXES) and rel not in left_out)


def stage(split: Split, staging: Path, cfg: ConvertConfig, litdata: ModuleType) -> Staged:
    """Write ``split`` to ``staging/<name>`` with ``litdata.optimize``: kept when a complete one with the same
    fingerprint is there, continued from litdata's checkpoints when a stopped one is, restarted when SRC or
    the settings changed."""
    folder, log = staging / split.name, staging / f"{split.name}.corrupt"
    mark = staging / f"{split.name}.fingerprint"
    same = mark.is_file() and mark.read_text("utf-8") == split.fingerprint
    started = time.monotonic()
    if same and (folder / "index.json").is_file():
        print(f"{split.name}: staged already in {folder}", flush=True)
        return Staged(folder, corrupt_files(log), 0.0)
    if not same:
        shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(log, ignore_errors=True)
        staging.mkdir(parents=True, exist_ok=True)
        mark.write_text(split.fingerprint, "utf-8")
    again = (folder / ".checkpoints").is_dir()
    print(f"{split.name}: {len(split.items)} files -> {folder}" + (" (continuing a stopped conversion)" * again),
          flush=True)
    # litdata's progress bar is on stderr; its stdout is a dozen set-up lines per split and an advertisement.
    with _litdata_env(staging / ".cache"), open(os.devnull, "w") as quiet, redirect_stdout(quiet):
        litdata.optimize(fn=partial(encode, corrupt_log=str(log)), inputs=split.items, output_dir=str(folder),
                         chunk_bytes=cfg.chunk_size, num_workers=cfg.workers, keep_data_ordered=True,
                         reorder_files=False, use_checkpoint=True, start_method=_start_method())
    return Staged(folder, corrupt_files(log), time.monotonic() - started)


@contextmanager
def _litdata_env(cache: Path) -> Iterator[None]:
    # optimize() empties its cache folders first, by default the machine-wide $TMPDIR/chunks and $TMPDIR/data;
    # it also sets DATA_OPTIMIZER_NUM_WORKERS. The process's environment is put back after.
    saved = dict(os.environ)
    os.environ["DATA_OPTIMIZER_CACHE_FOLDER"] = str(cache / "chunks")
    os.environ["DATA_OPTIMIZER_DATA_CACHE_FOLDER"] = str(cache / "data")
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _start_method() -> Any:
    # fork: the workers inherit the loaded modules (torch, PIL) instead of importing them again; where fork
    # is not offered (Windows) or unsafe (macOS), litdata's default.
    return "fork" if sys.platform.startswith("linux") and "fork" in multiprocessing.get_all_start_methods() else None


if __name__ == "__main__":
    raise SystemExit(main())
