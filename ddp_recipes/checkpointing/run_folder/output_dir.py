"""A recipe run's output folder: ``--output-dir``, or else ``version_N`` under the recipe's default root (a
new N for each new run; the N holding the run ``--resume`` continues), made by the process that will be
rank 0. A run refused before it wrote anything removes the folders it made."""

from __future__ import annotations

from pathlib import Path

from ddp_recipes.checkpointing.run_folder.ownership import output_survey
from ddp_recipes.config.cli import writable_dir
from ddp_recipes.config.run_config import RunConfig
from ddp_recipes.config.world import will_be_global_zero
from ddp_recipes.errors import ConfigError, lit
from ddp_recipes.storage import Url, is_url, location

VERSION = "version_"  # the default output dir: <DEFAULT_OUTPUT_ROOT>/version_N, a new N for each run


def settle_output_dir(cfg: RunConfig, create: bool = True) -> None:
    """``cfg.output_dir`` when ``--output-dir`` was not given: ``<DEFAULT_OUTPUT_ROOT>/version_N``, so two runs
    never share a folder. A new run claims the next N on the process that will be rank 0 (an exclusive mkdir);
    ``--resume auto`` continues the newest N that holds a run, ``--resume PATH`` PATH's N. ``create`` False
    (``--test-only``): a new N is named, not made."""
    _MADE.clear()  # this run's folders only (absolute): an earlier run of this process keeps what it made
    if cfg.output_dir is not None:
        return
    root = Path(cfg.DEFAULT_OUTPUT_ROOT)
    numbers = sorted((int(p.name.removeprefix(VERSION)) for p in root.glob(VERSION + "*")
                      if p.is_dir() and p.name.removeprefix(VERSION).isdigit()), reverse=True)
    chosen: Path | None = None
    if cfg.resume == "auto":
        chosen = next((root / f"{VERSION}{n}" for n in numbers if output_survey(root / f"{VERSION}{n}").holds_a_run()),
                      None)
    elif cfg.resume not in (None, "none"):  # a URL is never inside the local root
        holder = Path(cfg.resume).resolve().parent.parent
        if holder.parent == root.resolve() and holder.name.removeprefix(VERSION).isdigit():
            chosen = root / holder.name
    if chosen is None:
        number = (numbers[0] + 1) if numbers else 0
        if create and will_be_global_zero():
            # runs/<recipe> itself too, where this run made it: a refused first run leaves no empty folder at all
            _MADE.extend(reversed([p.absolute() for p in (root, *root.parents) if not p.exists()]))
            try:
                number = _claim_version(root, number)
            except OSError as err:  # a read-only or foreign working directory: the flag that moves it
                raise ConfigError(f"no {{output_dir}} given, and the default {lit(root / f'{VERSION}{number}')} "
                                  f"cannot be made under {lit(Path.cwd())} ({lit(err.strerror or err)}); pass "
                                  "{output_dir} DIR on a writable disk (or run from a writable folder)",
                                  "output_dir") from None
        chosen = root / f"{VERSION}{number}"
    elif will_be_global_zero():
        asked = "--resume auto" if cfg.resume == "auto" else "--resume"
        print(f"{asked}: continuing the run in {chosen} (--output-dir picks another)", flush=True)
    cfg.output_dir = str(chosen)


def _claim_version(root: Path, number: int) -> int:
    """Make ``root/version_<number>`` (the next free number: an exclusive mkdir) and return its number."""
    root.mkdir(parents=True, exist_ok=True)
    while True:
        try:
            (root / f"{VERSION}{number}").mkdir()
            _MADE.append((root / f"{VERSION}{number}").absolute())
            return number
        except FileExistsError:
            number += 1
        except FileNotFoundError:  # a refused run beside this one removed the empty root it had made
            root.mkdir(parents=True, exist_ok=True)


def output_folder(cfg: RunConfig) -> Path | Url:
    """The run's output folder; the process that will be rank 0 (the one that writes) creates it and proves it
    writable (a URL: its store). The other ranks write nothing there, and take rank 0's folder once the process
    group is up."""
    if will_be_global_zero():
        fresh = not is_url(cfg.output_dir) and not Path(cfg.output_dir).exists()
        folder = writable_dir(cfg.output_dir, "output_dir")
        if fresh:  # a run that fails before writing anything leaves no empty folder behind
            note_made(Path(cfg.output_dir))
        return folder
    return location(cfg.output_dir)


# Folders the current run made (settle_output_dir, output_folder), for discard_unused_output_dirs.
_MADE: list[Path] = []


def note_made(folder: Path) -> None:
    """``folder`` was made by this process for its run: :func:`discard_unused_output_dirs` removes it if empty."""
    _MADE.append(folder.absolute())


def discard_unused_output_dirs() -> None:
    """A run refused before it wrote anything (bad input: one line, exit 2) leaves no empty ``version_N``
    behind it: each folder this process made and nothing wrote into is removed again."""
    while _MADE:
        made = _MADE.pop()
        try:
            made.rmdir()  # only an empty folder: anything written there stays
        except OSError:
            pass
