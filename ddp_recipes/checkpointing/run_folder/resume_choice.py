"""Which checkpoint continues a run: ``--resume auto|PATH`` of a recipe, and the newest checkpoint of a
folder's run that ``--resume auto`` and ``ckpt_path="last"`` both take.

``auto`` takes the newest complete checkpoint of the folder's own run (whose run it is:
:mod:`~ddp_recipes.checkpointing.run_folder.ownership`); another run's checkpoints are skipped with a warning,
and an unreadable file is skipped, or refused when the run has nothing else. ``PATH`` must exist. The recipe
picks before any rank starts; rank 0 picks again once the process group is up and every rank checks that it
reads the same file (:mod:`~ddp_recipes.checkpointing.run_folder.rank0_decision`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from ddp_recipes.checkpointing import files
from ddp_recipes.checkpointing.checkpoint import read_checkpoint
from ddp_recipes.checkpointing.run_folder.output_dir import settle_output_dir
from ddp_recipes.checkpointing.run_folder.ownership import (
    RECIPE,
    RUN_FILE,
    Found,
    Survey,
    Words,
    file_name,
    folder_text,
    newest_key,
    output_survey,
)
from ddp_recipes.config.run_config import RunConfig
from ddp_recipes.errors import CheckpointError, lit
from ddp_recipes.storage.retry import StorageError
from ddp_recipes.storage.store import check_store, renames


def open_resume(cfg: RunConfig, training: bool = True) -> tuple[str | None, dict[str, Any] | None]:
    """The checkpoint ``--resume`` names and its contents ((None, None): start fresh), with the run's output
    folder settled first (``cfg.output_dir``, see :func:`settle_output_dir`). ``training`` False
    (``--test-only``) only reads. Every rank reads the file; rank 0's choice is checked on every rank once the
    process group is up."""
    settle_output_dir(cfg, create=training)
    resume = resolve_resume(cfg.resume, cfg.output_dir, training)
    return resume, read_checkpoint(resume) if resume else None


def resolve_resume(resume: str | None, output_dir: str, training: bool = True) -> str | None:
    """A recipe's ``--resume``: the checkpoint to resume from: None (fresh), the newest complete one of the output
    folder's run for "auto" (None when there is none yet; see :func:`newest_checkpoint`), or PATH, which must
    exist."""
    if not resume or resume == "none":
        return None
    if resume == "auto":
        # A missing bucket or a refused credential fails here, not as "no checkpoint".
        check_store(output_dir, "output_dir")
        return newest_checkpoint(output_dir, training)
    try:
        files.resolve(resume)  # raises naming --resume when there is nothing there
    except StorageError as err:  # refused, or the store is down: about --resume, not --output-dir
        raise err.renamed(output_dir="resume") from err.__cause__
    return resume


def newest_checkpoint(output_dir: str | os.PathLike, training: bool = True) -> str | None:
    """The checkpoint ``--resume auto`` takes in a recipe's output folder: the newest complete one of the
    folder's run (:func:`newest_of_run`: by optimizer step, ties to
    last.ckpt, then the newest hpc_ckpt_N; another run's checkpoints, truncated and unreadable files are
    skipped with one warning each); None when there is none. On a URL: from the manifests of complete
    objects, as the name it was saved under."""
    found = newest_of_run(output_survey(output_dir), keep=training)
    return found.path if found is not None else None


def newest_of_run(found: Survey, words: Words = RECIPE, keep: bool = True) -> Found | None:
    """The checkpoint continuing the folder's run takes: the newest of the owner's (the rules:
    :mod:`~ddp_recipes.checkpointing.run_folder.ownership`); None when it has none yet. Skipped checkpoints of
    other runs are named in one warning each."""
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
