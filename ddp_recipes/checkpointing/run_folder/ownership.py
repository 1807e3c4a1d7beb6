"""A checkpoint folder belongs to one run: a new run never touches another run's checkpoints, and continuing
(``--resume auto``, ``trainer.fit(..., ckpt_path="last")``) takes only the folder's own run's.

A run is named by a run id, made when it starts fresh and kept by every continuation of it (a resume, a
preemption, a requeue). The id is recorded twice:

* in the folder: ``<checkpoint folder>/run.json`` (``{"format", "run_id", "started"}``), written once by
  rank 0 when the run first trains there (:func:`claim`);
* in every checkpoint the run writes, under ``checkpoint["ddp_recipes_run"]`` (and on an object store in its
  manifest too), so a checkpoint says whose it is wherever it is copied.

The rules, decided on rank 0 (:mod:`~ddp_recipes.checkpointing.run_folder.rank0_decision` sends the decision to
every rank; a recipe checks them once before it launches, :func:`refuse_other_runs`):

* a new run into a folder that holds a run (a record, or any complete checkpoint) is refused in one line
  naming the run found and the two ways on (:func:`refuse_new_run`);
* continuing takes the newest checkpoint of the folder's run (:meth:`Survey.owner`, and
  :func:`~ddp_recipes.checkpointing.run_folder.resume_choice.newest_of_run`): the record's id, else
  the one id its checkpoints carry; any other run's checkpoint is skipped with a warning whatever its step
  count, and a folder whose checkpoints name several runs and which has no record is refused;
* a checkpoint given by path continues its own run; into a folder that holds another run it is refused
  (:func:`refuse_foreign_checkpoint`).

A checkpoint or folder may carry no run id (plain Lightning's checkpoints, a folder with no ``run.json``):
a folder with no record whose checkpoints carry no id is continued from its newest complete checkpoint, and
once a folder has a recorded run its id-less checkpoints are skipped.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ddp_recipes.checkpointing import files
from ddp_recipes.checkpointing.checkpoint import CHECKPOINT_DIR, plain_data, run_of, unreadable_because
from ddp_recipes.config.run_config import RunConfig
from ddp_recipes.config.world import will_be_global_zero
from ddp_recipes.errors import CheckpointError, lit
from ddp_recipes.storage import Url, location, same_path
from ddp_recipes.storage.store import listing, read_bytes, size, write_new

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

    @property
    def name(self) -> str:
        return self.path.rstrip("/").rsplit("/", 1)[-1]

    def describe(self) -> str:
        return f"{self.name} at step {self.step}, epoch {self.epoch}"


def facts(path: str | os.PathLike) -> Found:
    """A checkpoint's step, epoch and run, read without loading its tensors (a local file mapped, a URL from
    its manifest); raises if it is not a readable checkpoint."""
    path = os.fspath(path)
    entry = files.manifest(path)
    if entry is not None:
        return _from_manifest(path, entry)
    with plain_data():  # a file alone, or a bucket's object without a manifest: its header
        checkpoint = torch.load(files.fetch(path), map_location="cpu", weights_only=True, mmap=True)
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise ValueError("not a Lightning checkpoint")
    return Found(path, int(checkpoint.get("global_step", 0)), int(checkpoint.get("epoch", 0)), run_of(checkpoint))


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
        # an unreadable checkpoint is a run's too: a new run would overwrite the bytes someone may yet restore
        return self.record is not None or bool(self.checkpoints) or bool(self.unreadable)

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


def ended_before_its_first_checkpoint(found: Survey, words: Words = RECIPE) -> str | None:
    """The recorded run's id when every launch of it failed before its first optimizer step and it holds no
    checkpoint (a recipe's ``attempts/`` records, each with its run id and how it ended: a bad image, a crash in
    set-up, Ctrl+C): a new run may take the folder, since nothing there can be continued. None otherwise: a run
    still going or killed (no record of its end: it may be training yet), one that trained or finished (its
    checkpoints may have been moved, its summary is still there), or no attempt records (outside a recipe)."""
    run_id = found.recorded_run
    if not run_id or found.checkpoints or found.unreadable or not words.parent:
        return None
    attempts = found.folder.parent / ATTEMPTS_DIR
    try:
        names = [n for n in map(str, listing(attempts)) if n.endswith(".json")]
        records = [json.loads(read_bytes(attempts / n).decode()) for n in names]
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    mine = [r for r in records if isinstance(r, dict) and r.get("run_id") == run_id]
    # failed, and before its first optimizer step: a run that trained (and whose checkpoints are gone) keeps it
    failed = all(str(r.get("ended") or "").startswith("error") and not r.get("last_step") for r in mine)
    return run_id if mine and failed else None


ATTEMPTS_DIR = "attempts"  # a recipe's attempt records (train/attempts.py), beside its checkpoint folder


def refuse_new_run(found: Survey, words: Words = RECIPE) -> None:
    """A new run must not start in a folder that holds a run: raise naming the run found and the ways on. A
    run that ended before its first checkpoint holds nothing to protect (:func:`ended_before_its_first_checkpoint`)."""
    if found.holds_a_run() and not ended_before_its_first_checkpoint(found, words):
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


def refuse_other_runs(cfg: RunConfig, resume: str | None, checkpoint: dict[str, Any] | None) -> None:
    """The output folder belongs to one run: a new run (``--resume none``) into a folder that holds a run, or
    ``--resume PATH`` of another run into it, fails in one line. Checked on the process that will be rank 0,
    after every other check of the run's input and before any other rank starts, so the refusal is one line
    and nothing is launched; rank 0 checks again once the process group is up
    (:mod:`~ddp_recipes.checkpointing.run_folder.rank0_decision`), for every rank and for a folder that
    changed meanwhile."""
    if not will_be_global_zero():
        return
    found = output_survey(cfg.output_dir)
    if cfg.resume in (None, "none"):
        refuse_new_run(found)
    elif resume and cfg.resume != "auto":
        given = Found(resume, int(checkpoint.get("global_step", 0)), int(checkpoint.get("epoch", 0)),
                      run_of(checkpoint))
        refuse_foreign_checkpoint(found, given)

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


def claim(folder: str | os.PathLike, run_id: str, replaces: str | None = None) -> None:
    """Record ``run_id`` as the folder's run (rank 0, once training starts there). A folder another run
    recorded meanwhile (two runs started into one folder at the same moment) is an error, never overwritten;
    ``replaces``: the id of a run that ended before its first checkpoint, whose record this one takes over."""
    where = location(folder)
    record = read_record(where)
    if record is not None and record.get("run_id") == run_id:
        return
    if record is not None and record.get("format") != "unreadable" and record.get("run_id") != (replaces or object()):
        raise CheckpointError(f"{lit(where)} was claimed by run {record.get('run_id')} while this run started; "
                              "run it with another output folder")
    payload = (json.dumps({"format": FORMAT, "run_id": run_id,
                           "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}, indent=2) + "\n").encode()
    try:
        write_new(where / RUN_FILE, payload, replace=record is not None)  # unreadable, or a run with nothing saved
    except FileExistsError:
        raise CheckpointError(f"{lit(where)} was claimed by another run while this run started; run it with "
                              "another output folder") from None
