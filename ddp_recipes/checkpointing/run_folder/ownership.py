"""A checkpoint folder belongs to one run: a new run never touches another run's checkpoints, and continuing
(``--resume auto``, ``trainer.fit(..., ckpt_path="last")``) takes only the folder's own run's.

The run id is in ``run.json`` (:func:`claim`, by rank 0 at each start) and in every checkpoint. The rule is the
README's sentence (docs/resume-and-preemption.md spells it out): :func:`refuse_new_run`, :func:`newest_of_run`,
:func:`refuse_live` (two launches at once are told apart by the record's exclusive create, on a filesystem: a
bucket's last writer wins). Id-less checkpoints (plain Lightning's) continue from the newest.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from ddp_recipes.checkpointing import files
from ddp_recipes.checkpointing.checkpoint import CHECKPOINT_DIR, load_header, run_of, unreadable_because
from ddp_recipes.errors import CheckpointError, lit
from ddp_recipes.storage import Url, location, same_path
from ddp_recipes.storage.store import read_bytes, renames, size, write_new

RUN_FILE = "run.json"
FORMAT = "ddp-recipes-run/1"


@dataclass(frozen=True)
class Words:
    """How messages name the folder and the ways on, in the vocabulary of the path the user is on."""

    folder: str      # the folder as a parameter, e.g. "{output_dir}" (the CLI renders --output-dir)
    resume: str      # how to continue the folder's run
    resume_path: str  # how to continue from one given checkpoint
    another: str     # what to pass instead, for another folder
    asked: str       # the request, as warnings name it
    parent: bool     # whether ``folder`` names the checkpoint folder's parent (a recipe's output dir)


RECIPE = Words(folder="{output_dir}", resume="{resume} auto", resume_path="{resume} PATH", another="{output_dir}",
               asked="--resume auto", parent=True)
LIBRARY = Words(folder="checkpoint folder", resume='trainer.fit(..., ckpt_path="last")',
                resume_path="trainer.fit(..., ckpt_path=PATH)", another="default_root_dir or checkpoint_dir",
                asked='ckpt_path="last"', parent=False)


def new_run_id() -> str:
    """A new run's id: 12 hex digits (48 random bits)."""
    return uuid.uuid4().hex[:12]


@dataclass(frozen=True)
class Found:
    """One complete checkpoint of a folder: where, its position, and whose it is."""

    path: str
    step: int
    epoch: int
    run_id: str | None
    header: dict[str, Any] | None = field(default=None, compare=False, repr=False)  # the file's, tensors unread

    @property
    def name(self) -> str:
        return self.path.rstrip("/").rsplit("/", 1)[-1]

    def describe(self) -> str:
        return f"{self.name} at step {self.step}, epoch {self.epoch}"


def facts(path: str | os.PathLike) -> Found:
    """A checkpoint's step, epoch and run, read without loading its tensors (a local file mapped: its header
    is kept; a URL from its manifest); raises if it is not a readable checkpoint."""
    path = os.fspath(path)
    entry = files.manifest(path)
    if entry is not None:
        return _from_manifest(path, entry)
    checkpoint = load_header(files.fetch(path))  # a file alone, or a bucket's object without a manifest
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise ValueError("not a Lightning checkpoint")
    return Found(path, int(checkpoint.get("global_step", 0)), int(checkpoint.get("epoch", 0)), run_of(checkpoint),
                 checkpoint)


def _from_manifest(path: str, entry: dict[str, Any]) -> Found:
    return Found(path, int(entry.get("global_step", 0)), int(entry.get("epoch", 0)), entry.get("run_id") or None)


@dataclass
class Survey:
    """What a checkpoint folder holds: its run record and its complete checkpoints."""

    folder: Path | Url
    record: dict[str, Any] | None = None
    checkpoints: list[Found] = field(default_factory=list)
    unreadable: list[tuple[str, str]] = field(default_factory=list)  # (path, what is wrong) of files that fail

    @property
    def recorded_run(self) -> str | None:
        return (self.record or {}).get("run_id")

    @property
    def run_ids(self) -> list[str]:
        """The distinct run ids the checkpoints carry, the newest checkpoint's first."""
        ordered = sorted(self.checkpoints, key=newest_key, reverse=True)
        return list(dict.fromkeys(c.run_id for c in ordered if c.run_id))

    def owner(self) -> str | None:
        """The folder's run: the record's id, else the one id its checkpoints carry (None: none recorded)."""
        if self.recorded_run:
            return self.recorded_run
        ids = self.run_ids
        return ids[0] if len(ids) == 1 else None

    def holds_a_run(self) -> bool:
        """Whether it holds checkpoints (an unreadable one too: its bytes may yet be restored). A folder whose
        runs left none holds nothing to continue or lose."""
        return bool(self.checkpoints) or bool(self.unreadable)

    def describe(self, run_id: str | None = None) -> str:
        """"run 3f2a9c1e7b40 (last.ckpt at step 189, epoch 3)" for ``run_id`` (default: the owner's)."""
        run_id = run_id or self.owner()
        mine = [c for c in self.checkpoints if c.run_id == run_id] if run_id else list(self.checkpoints)
        newest = max(mine, key=newest_key, default=None)
        where = (newest.describe() if newest is not None else
                 f"an unreadable {file_name(self.unreadable[0][0])}" if self.unreadable else "no checkpoint yet")
        if run_id is None:
            return f"a run of an earlier ddp-recipes, which recorded no run id ({where})"
        started = (self.record or {}).get("started") if run_id == self.recorded_run else None
        return f"run {run_id} ({where}{', started ' + started if started else ''})"


def survey(folder: str | os.PathLike, extra: list[Path] | None = None, asked: str = "--resume auto") -> Survey:
    """Read ``folder`` (a checkpoint folder, local or URL): its ``run.json`` and every complete checkpoint in
    it (:func:`~ddp_recipes.checkpointing.files.saved_in`), plus the local ``extra`` files (Lightning's
    ``hpc_ckpt_N``, a ModelCheckpoint's last files elsewhere). Unreadable files are skipped with a one-line
    warning each."""
    where = location(folder)
    found = Survey(where, record=read_record(where))
    for path, entry in files.saved_in(where, extra, asked=asked):
        if entry is not None:
            found.checkpoints.append(_from_manifest(os.fspath(path), entry))
            continue
        try:
            found.checkpoints.append(facts(path))
        except Exception as err:  # truncated zip, garbage, not a checkpoint: never taken, never overwritten
            found.unreadable.append((os.fspath(path), unreadable_because(path, err)))
    return found


def file_name(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]


def newest_key(found: Found) -> tuple[int, int, tuple[int, int, str]]:
    """The order of "newest": optimizer steps, then epochs, then last.ckpt, the newest hpc_ckpt_N, the name.
    It reads what the files say, not their write times (every rank reads the same answer)."""
    name = found.name
    number = name.removesuffix(".ckpt").removeprefix("hpc_ckpt_")
    if name == "last.ckpt":
        tie = (2, 0, name)
    elif name.startswith("hpc_ckpt_") and number.isdigit():
        tie = (1, int(number), name)
    else:
        tie = (0, 0, name)
    return found.step, found.epoch, tie


def folder_text(found: Survey, words: Words) -> str:
    shown = found.folder.parent if words.parent else found.folder
    return f"{words.folder} {lit(shown)}"


ATTEMPTS_DIR = "attempts"  # a recipe's attempt records (train/attempts.py), beside its checkpoint folder


def newest_of_run(found: Survey, words: Words = RECIPE, keep: bool = True) -> Found | None:
    """The checkpoint continuing the folder's run takes: the newest of the owner's (the rules:
    :mod:`~ddp_recipes.checkpointing.run_folder.ownership`; by optimizer step, ties to last.ckpt, then the
    newest hpc_ckpt_N); None when it has none yet. Other runs' checkpoints are skipped with one warning each."""
    owner = found.owner()
    if owner is None and len(found.run_ids) > 1:
        runs = "; ".join(found.describe(run_id) for run_id in found.run_ids)
        raise CheckpointError(f"{folder_text(found, words)} holds the checkpoints of {len(found.run_ids)} runs "
                              f"({runs}) and no {RUN_FILE} saying whose folder it is; pass the one to continue with "
                              f"{words.resume_path}, or pass another {words.another}")
    if owner is None:  # no record and no run id on any checkpoint: every checkpoint is the run's
        mine = list(found.checkpoints)
    else:
        mine = [c for c in found.checkpoints if c.run_id == owner]
        for other in found.checkpoints:
            if other.run_id != owner:
                whose = f"run {other.run_id}" if other.run_id else "a run of an earlier ddp-recipes (no run id)"
                _said_once(f"{words.asked}: skipping {other.path} ({other.describe()}): it belongs to {whose}, "
                           f"not to this folder's run {owner}")
    newest = max(mine, key=newest_key, default=None)
    check_unreadable(found, newest, words, keep)
    return newest


def check_unreadable(found: Survey, newest: Found | None, words: Words = RECIPE, keep: bool = True) -> None:
    """Continuing a folder that holds an unreadable checkpoint file (cut by a full disk or a broken copy): with
    a readable checkpoint of the run to continue from, say which, and with ``keep`` (a fit: its saves would
    write over it) that the caller sets the file aside (:func:`set_aside_unreadable`); with none, refuse in one
    line naming the file and the ways on, instead of starting from step 0 over it."""
    if not found.unreadable:
        return
    path, why = found.unreadable[0]
    more = f" (and {len(found.unreadable) - 1} more)" if len(found.unreadable) > 1 else ""
    if newest is None:
        raise CheckpointError(f"{lit(path)}{more} {why} and the run in "
                              f"{folder_text(found, words)} has no other; nothing was changed: restore it from a "
                              f"copy, continue from another checkpoint with {words.resume_path}, or start a new run "
                              f"with another {words.another}", "output_dir" if words.parent else None)
    if keep and not renames(path):
        raise CheckpointError(f"{lit(path)}{more} {why}; nothing was changed: restore "
                              f"it, or continue from {newest.name} with {words.resume_path}")
    kept = f"the file is kept as {file_name(path)}{UNREADABLE}" if keep else "the file is left as it is"
    _said_once(f"{words.asked}: {path}{more} {why}; continuing from {newest.describe()}; {kept}")


UNREADABLE = ".unreadable"  # the suffix an unreadable checkpoint is kept under (never a *.ckpt, never taken)


def set_aside_unreadable(found: Survey) -> None:
    """Rank 0, once continuing from another checkpoint is decided: each unreadable local checkpoint file gets
    a name no save writes (``last.ckpt.unreadable``, ``.unreadable-2``, ...), so its bytes stay for whoever
    may restore them."""
    for path, _ in found.unreadable:
        target, n = Path(path + UNREADABLE), 1
        while target.exists():
            n += 1
            target = Path(f"{path}{UNREADABLE}-{n}")
        os.replace(path, target)


def _said_once(message: str) -> None:
    """A warning of the folder's state, once per process: the recipe reads the folder before the ranks start
    and rank 0 reads it again once the process group is up; the user is told once."""
    if message not in _SAID:
        _SAID.add(message)
        rank_zero_warn(message)


_SAID: set[str] = set()


def refuse_new_run(found: Survey, words: Words = RECIPE) -> None:
    """A new run must not start in a folder holding a run's checkpoints: raise naming the run and the ways on."""
    if found.holds_a_run():
        raise CheckpointError(f"{folder_text(found, words)} holds {found.describe()}: a new run there would overwrite "
                              f"its checkpoints; continue it with {words.resume}, or pass another {words.another}",
                              "output_dir" if words.parent else None)


def refuse_foreign_checkpoint(found: Survey, checkpoint: Found, words: Words = RECIPE) -> None:
    """Continuing ``checkpoint`` in a folder that holds another run is refused (a checkpoint of the folder
    itself, or of the same run elsewhere, is fine)."""
    inside = same_path(location(checkpoint.path).parent, found.folder)
    if inside or not found.holds_a_run():
        return
    owner = found.owner()
    if owner is not None and owner == checkpoint.run_id:
        return
    if owner is None and checkpoint.run_id is None and not found.run_ids:
        return  # neither side records a run: nothing tells two runs apart, so the checkpoint may continue
    whose = f"run {checkpoint.run_id}'s" if checkpoint.run_id else "an unrecorded run's"
    raise CheckpointError(f"{folder_text(found, words)} holds {found.describe()}, and {lit(checkpoint.path)} is "
                          f"{whose} checkpoint: continuing it there would mix two runs; pass another {words.another} "
                          f"to continue it, or {words.resume} to continue the folder's own run")



# ---- a recipe's output folder ----------------------------------------------------------------------------

def output_survey(output_dir: str | os.PathLike) -> Survey:
    """What a recipe's output folder holds (:func:`survey`):
    ``checkpoints/`` (last, best, the recipe's others) and Lightning's SLURM ``hpc_ckpt_*.ckpt`` beside it."""
    out = location(output_dir)
    return survey(out / CHECKPOINT_DIR, extra=files.loose(out, "hpc_ckpt_*.ckpt"))


# ---- the record ------------------------------------------------------------------------------------------

def read_record(folder: Path | Url) -> dict[str, Any] | None:
    """``run.json`` of ``folder``, or None (none there; one that does not parse counts as a record of no id)."""
    target = folder / RUN_FILE
    try:
        if size(target) is None:
            return None
        record = json.loads(read_bytes(target).decode())
    except (OSError, ValueError, UnicodeDecodeError):
        return {"format": "unreadable"}
    return record if isinstance(record, dict) else {"format": "unreadable"}


def live_holder(record: dict[str, Any] | None) -> bool:
    """Whether the process that recorded ``record`` still runs its fit: not released (:func:`release`, at any end
    it lives to see), its pid alive on this host, not this process and not a later one reusing the pid. A holder
    on another host cannot be seen (a pod restarted elsewhere must continue its run)."""
    holder = (record or {}).get("holder")
    if not isinstance(holder, dict) or holder.get("host") != socket.gethostname() or holder.get("pid") == os.getpid():
        return False
    try:
        os.kill(int(holder["pid"]), 0)
    except (ProcessLookupError, KeyError, TypeError, ValueError):
        return False
    except OSError:  # another user's process: it runs
        pass
    # A reused pid (a container restarted on this host) is another process: boot id and start tick, not the clock.
    recorded, now = holder.get("start"), process_start(int(holder["pid"]))
    return recorded is None or now is None or recorded == now


def process_start(pid: int) -> str | None:
    """Which process ``pid`` is: ``"<boot id>:<start tick>"`` where /proc says (Linux), unique for as long as the
    host runs; else None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        ticks = stat[stat.rindex(")") + 2:].split()[19]  # field 22, starttime; the name may hold spaces
        return f"{Path('/proc/sys/kernel/random/boot_id').read_text().strip()}:{int(ticks)}"
    except (OSError, ValueError, IndexError):
        return None


def refuse_live(found: Survey, words: Words = RECIPE) -> None:
    """Any launch into a folder a live run holds (:func:`live_holder`) is refused naming it and the way on."""
    if live_holder(found.record):
        holder = found.record["holder"]
        raise CheckpointError(f"{folder_text(found, words)} is held by run {found.record.get('run_id')}, running now "
                              f"(pid {holder['pid']} on {holder.get('host')}): pass another {words.another}, or run "
                              "this once it has ended", "output_dir" if words.parent else None)


def claim(folder: str | os.PathLike, run_id: str, free: bool = False) -> None:
    """Record ``run_id`` as the folder's run, held by this process (rank 0, each time training starts there).
    A folder another run recorded is an error, never overwritten, unless it is ``free`` (it holds no
    checkpoint) and its run no longer runs (:func:`live_holder`): that record is kept as ``run-<id>.json``."""
    where = location(folder)
    record = read_record(where)
    ours = record is not None and record.get("run_id") == run_id
    refuse_live(Survey(where, record), LIBRARY)
    if record is not None and not ours and record.get("format") != "unreadable":
        if not free:
            raise CheckpointError(f"{lit(where)} was claimed by run {record.get('run_id')} while this run started; "
                                  "run it with another output folder")
        try:  # the earlier run's record stays, under its own name
            write_new(where / f"run-{record.get('run_id')}.json", read_bytes(where / RUN_FILE))
        except FileExistsError:
            raise CheckpointError(f"{lit(where)} was claimed by another run while this run started; run it with "
                                  "another output folder") from None
    started = (record or {}).get("started") if ours else None
    holder = {"host": socket.gethostname(), "pid": os.getpid(), "at": time.time(), "start": process_start(os.getpid())}
    payload = {"format": FORMAT, "run_id": run_id,
               "started": started or time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "holder": holder}
    try:
        write_new(where / RUN_FILE, (json.dumps(payload, indent=2) + "\n").encode(), replace=record is not None)
    except FileExistsError:
        raise CheckpointError(f"{lit(where)} was claimed by another run while this run started; run it with "
                              "another output folder") from None


def release(folder: str | os.PathLike, run_id: str) -> None:
    """Rank 0, at the end of a fit it lives to see: the record it wrote no longer holds the folder. Best
    effort (an unreachable store leaves it held, as a SIGKILL does; this host's next launch sees the pid gone)."""
    where = location(folder)
    try:
        record = read_record(where)
        holder = (record or {}).get("holder") or {}
        if (record or {}).get("run_id") == run_id and (holder.get("pid"), holder.get("host")) == (
                os.getpid(), socket.gethostname()):
            payload = {**record, "holder": None}
            write_new(where / RUN_FILE, (json.dumps(payload, indent=2) + "\n").encode(), replace=True)
    except Exception:  # noqa: BLE001 - never in the way of the fit's own outcome
        pass
