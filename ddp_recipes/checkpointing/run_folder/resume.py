"""Which checkpoint a run continues from: decided once, on rank 0, inside the ranks; loaded once, by every rank
(Lightning's restore). The route: docs/architecture.md#the-resume-route; the folder's rules: ``ownership.py``.

Before any rank starts a recipe opens ``--resume`` (:func:`open_resume`) from headers and manifests only and
refuses what cannot run. Lightning resolves ``ckpt_path`` in every rank before the process group exists, each
from its own view of the folder; here ``"last"`` is only noted then and decided in ``resume_start``, with the
group up on every launcher: rank 0 decides (:func:`decide`), broadcasts, every other rank checks it reads that
very checkpoint (its pre-launch header) or fails every rank in one line, rank 0 records the run (:func:`agree`).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from ddp_recipes.checkpointing import files
from ddp_recipes.checkpointing.checkpoint import read_checkpoint, run_of
from ddp_recipes.checkpointing.last import LastCheckpoint
from ddp_recipes.checkpointing.run_folder import ownership
from ddp_recipes.checkpointing.run_folder.output_dir import settle_output_dir
from ddp_recipes.checkpointing.run_folder.ownership import Found, check_unreadable, newest_of_run, set_aside_unreadable
from ddp_recipes.config.run_config import RunConfig
from ddp_recipes.config.world import will_be_global_zero
from ddp_recipes.errors import CheckpointError, ConfigError, lit
from ddp_recipes.lightning_seam.connectors import install_checkpoint_route
from ddp_recipes.lightning_seam.reach import last_checkpoints_of
from ddp_recipes.storage import Url, location, same_path
from ddp_recipes.storage.retry import StorageError
from ddp_recipes.storage.store import check_store


def open_resume(cfg: RunConfig, training: bool = True, debugging: bool = False
                ) -> tuple[str | None, dict[str, Any] | None]:
    """Before any rank starts: settle the run's output folder (:func:`settle_output_dir`) and return the
    checkpoint ``--resume`` names with its header (tensors unread), or (None, None) for a fresh start; a folder
    a live run holds is refused here for ``--resume auto`` (on the process that will be rank 0, for a run that
    trains and is no ``fast_dev_run``), the other runs' folders by :func:`refuse_other_runs`, after the run's
    input checks. ``training`` False (``--test-only``) only reads."""
    settle_output_dir(cfg, create=training)
    resume = None if cfg.resume in (None, "none") else cfg.resume
    if resume == "auto":  # a missing bucket or a refused credential fails here, not as "no checkpoint"
        check_store(cfg.output_dir, "output_dir")
        found = ownership.output_survey(cfg.output_dir)
        if training and not debugging and will_be_global_zero():
            ownership.refuse_live(found)
        newest = newest_of_run(found, keep=training)
        return (newest.path, newest.header or read_checkpoint(newest.path)) if newest else (None, None)
    if resume is None:
        return None, None
    return resume, read_checkpoint(resolve_resume(resume))


def refuse_other_runs(cfg: RunConfig, resume: str | None, header: dict[str, Any] | None) -> None:
    """A new run (``--resume none``) into a folder holding a run's checkpoints, or ``--resume PATH`` of another
    run into it, or any launch into a folder a live run holds: one line. Checked on the process that will be
    rank 0 after every other check of the run's input (so a bad flag is named first), before any rank starts;
    ``--resume auto`` was checked when it was opened (:func:`open_resume`)."""
    if cfg.resume == "auto" or not will_be_global_zero():
        return
    found = ownership.output_survey(cfg.output_dir)
    ownership.refuse_live(found)
    if resume is None:
        ownership.refuse_new_run(found)
    else:
        given = Found(resume, int(header.get("global_step", 0)), int(header.get("epoch", 0)), run_of(header))
        ownership.refuse_foreign_checkpoint(found, given)


def resolve_resume(resume: str) -> str:
    """``--resume PATH``, which must exist (one line naming ``--resume`` otherwise)."""
    try:
        files.resolve(resume)  # raises naming --resume when there is nothing there
    except StorageError as err:  # refused, or the store is down: about --resume, not --output-dir
        raise err.renamed(output_dir="resume") from err.__cause__
    return resume


# ---- the decision in the ranks -----------------------------------------------------------------------------

class Continue(str):
    """``ckpt_path="last"`` of ``--resume auto``, with the checkpoint this process opened before the launch
    (``expected``, whose ``header`` it read), which rank 0's decision must be."""

    def __new__(cls, expected: str | None = None, header: dict[str, Any] | None = None) -> Continue:
        value = super().__new__(cls, "last")
        value.expected = expected
        value.seen = (int(header.get("global_step", 0)), run_of(header)) if expected and header else None
        return value


class RunCheckpointRoute:
    """Lightning's ``ckpt_path``, with ``"last"`` decided on rank 0 (module docstring): the newest complete
    checkpoint of the folder's run among :class:`LastCheckpoint`'s folder, Lightning's SLURM ``hpc_ckpt_N`` and
    every ModelCheckpoint's last files; none yet is a fresh start, as Lightning does."""

    def parse(self, trainer: L.Trainer, state_fn: TrainerFn, ckpt_path: Any, default: Callable[[Any], Any]) -> Any:
        """The path Lightning's ``_parse_ckpt_path`` would give, but ``"last"`` as above (``default``: Lightning's)."""
        if ckpt_path != "last":
            with warnings.catch_warnings():
                if sum(not isinstance(c, LastCheckpoint) for c in trainer.checkpoint_callbacks) == 1:
                    # Lightning counts LastCheckpoint among "multiple ModelCheckpoint callbacks" and warns that
                    # "best" is the first one's: with one ModelCheckpoint of the user's (or Lightning's default),
                    # that one is the first (build_trainer puts LastCheckpoint last), so nothing is ambiguous.
                    warnings.filterwarnings("ignore", message=r".*multiple `ModelCheckpoint` callbacks")
                return default(ckpt_path)
        if _last_checkpoint(trainer) is not None:
            return ckpt_path if isinstance(ckpt_path, Continue) else Continue()  # decided in resume
        fitting = state_fn == TrainerFn.FITTING
        survey = _survey(trainer, None, ownership.LIBRARY)
        found = newest_of_run(survey, ownership.LIBRARY, keep=fitting)
        if found is not None and survey.unreadable and fitting and trainer.is_global_zero:
            set_aside_unreadable(survey)  # before a ModelCheckpoint's save writes over the bytes
        if found is None:
            rank_zero_info('ckpt_path="last": no checkpoint yet; starting from the beginning')
        return found.path if found is not None else None

    def resume(self, trainer: L.Trainer, checkpoint_path: Any) -> Any:
        """The file every rank loads: rank 0's decision where the run continues (:func:`agree`)."""
        last = _last_checkpoint(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if last is not None and (fitting or isinstance(checkpoint_path, Continue)):
            return agree(trainer, last, checkpoint_path, fitting)
        return checkpoint_path


def find_last_checkpoint(trainer: L.Trainer) -> None:
    """Route ``trainer``'s ``ckpt_path`` through :class:`RunCheckpointRoute`."""
    install_checkpoint_route(trainer, RunCheckpointRoute())


def _last_checkpoint(trainer: L.Trainer) -> LastCheckpoint | None:
    return next((c for c in trainer.callbacks if isinstance(c, LastCheckpoint) and c.dirpath is not None), None)


def _survey(trainer: L.Trainer, last: LastCheckpoint | None, words: ownership.Words) -> ownership.Survey:
    """The run's checkpoint folder (LastCheckpoint's, else the first ModelCheckpoint's), with Lightning's
    ``hpc_ckpt_N`` in ``default_root_dir`` and the last files of every ModelCheckpoint."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    models = [c for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint) and c.dirpath]
    folder = last.dirpath if last is not None else (location(models[0].dirpath) if models else None)
    extra: list[Path] = []
    root = location(trainer.default_root_dir)
    if not isinstance(root, Url):
        extra += [p for p in sorted(root.glob("hpc_ckpt_*.ckpt")) if p.is_file()]
    others: list[Url] = []
    for callback in models:
        where = location(callback.dirpath)
        if isinstance(where, Url):
            others.append(where)
        else:
            extra += [Path(p) for p in sorted(last_checkpoints_of(callback, trainer))]
    if folder is None:
        return ownership.Survey(root, checkpoints=[ownership.facts(p) for p in extra])
    found = ownership.survey(folder, extra=extra, asked=words.asked)
    for where in dict.fromkeys(others):
        if str(where).rstrip("/") != str(folder).rstrip("/"):
            found.checkpoints += [c for c in ownership.survey(where, asked=words.asked).checkpoints
                                  if c.name.startswith("last")]
    return found


def decide(trainer: L.Trainer, last: LastCheckpoint, request: Any, fitting: bool) -> dict[str, Any]:
    """Rank 0's decision for ``request`` (None: a fresh start; a :class:`Continue`; a checkpoint path)."""
    words = last.words
    found = _survey(trainer, last, words)
    debugging = bool(trainer.fast_dev_run)
    if isinstance(request, Continue):
        chosen = newest_of_run(found, words, keep=fitting and not debugging)
        if chosen is not None and request.expected not in (None, chosen.path):
            opened = next((c for c in found.checkpoints if c.path == request.expected), None)
            if opened is None or (opened.step, opened.run_id) != (chosen.step, chosen.run_id):
                raise CheckpointError(f"the newest checkpoint of the run in {lit(found.folder)} changed while the run "
                                      f"started (it was {lit(request.expected)}, it is now {lit(chosen.path)}); run "
                                      "it again")
            chosen = opened  # as new as the one found (another callback's last file): the one the recipe opened
        if chosen is None:
            rank_zero_info(f"{words.asked}: no checkpoint of this run yet; starting from the beginning")
        run_id = (chosen.run_id if chosen is not None else None) or found.owner() or ownership.new_run_id()
    elif not request:
        chosen, run_id = None, ownership.new_run_id()
        if fitting and not debugging:
            ownership.refuse_new_run(found, words)
    else:
        try:
            chosen = ownership.facts(os.fspath(request))
        except ConfigError:
            raise
        except Exception as err:
            asked = "{resume}" if words.parent else "ckpt_path"
            raise CheckpointError(f"{asked} {lit(request)} is not a readable checkpoint ({type(err).__name__})"
                                  ) from None
        if fitting and not debugging:
            ownership.refuse_foreign_checkpoint(found, chosen, words)
        run_id = chosen.run_id or found.owner() or ownership.new_run_id()
    if found.unreadable and chosen is not None and fitting and not debugging:
        check_unreadable(found, chosen, words)
        set_aside_unreadable(found)  # before this run's first save could write over the bytes
    # run_id: the run this fit is (and records); ckpt_run: what the checkpoint itself records, which every rank
    # compares with its own read of the file (None for a checkpoint without a run id, plain Lightning's included).
    return {"path": chosen and chosen.path, "step": chosen and chosen.step, "run_id": run_id,
            "ckpt_run": chosen and chosen.run_id, "folder": str(last.dirpath), "free": not found.holds_a_run()}


def agree(trainer: L.Trainer, last: LastCheckpoint, request: Any, fitting: bool) -> str | None:
    """Steps 1-4 of the module docstring; returns the checkpoint every rank loads (None: fresh)."""
    check_checkpoint_names(trainer.callbacks, last)  # the dirpaths are resolved now (ModelCheckpoint.setup)
    decision: dict[str, Any] | None = None
    failure: BaseException | None = None
    if trainer.is_global_zero:
        try:
            decision = decide(trainer, last, request, fitting)
        except ConfigError as err:
            decision = {"error": (type(err).__name__, err.template, err.param)}
        except Exception as err:  # a bug: rank 0 raises it, the other ranks must not wait in the broadcast
            failure, decision = err, {"error": ("RuntimeError",
                                                f"rank 0 failed to decide the checkpoint ({err!r})", None)}
    decision = trainer.strategy.broadcast(decision)
    if failure is not None:
        raise failure
    if "error" in decision:
        kind, template, param = decision["error"]
        if kind == "RuntimeError":
            raise RuntimeError(template)
        error = (CheckpointError if kind == "CheckpointError" else ConfigError)(template, param)
        error.agreed = True  # the same on every rank: rank 0 prints it
        raise error
    problem = None if trainer.is_global_zero else _check_same(decision, trainer.global_rank, request)
    problems = [p for p in _gather(problem) if p]
    if problems:
        words = last.words
        asked = words.asked if isinstance(request, Continue) else "{resume}" if words.parent else "ckpt_path"
        where = "{output_dir}" if words.parent else "checkpoint_dir"
        error = CheckpointError(f"{asked}: {problems[0]}: every rank must read the same checkpoints: put {where} on a "
                                "filesystem every node shares, or on object storage (s3://...)")
        error.agreed = True
        raise error
    last.dirpath = location(decision["folder"])
    last.run_id = decision["run_id"]
    if fitting and not trainer.fast_dev_run:
        _claim_on_rank_0(trainer, last, decision.get("free", False))
    return decision["path"]


def _claim_on_rank_0(trainer: L.Trainer, last: LastCheckpoint, free: bool = False) -> None:
    """Rank 0 records the run in its folder; its outcome is broadcast, so a refusal there (claimed meanwhile,
    a read-only folder, a denied bucket) stops every rank at once instead of leaving the others waiting in
    DDP's set-up for the collective timeout. Collective (once per fit)."""
    failure: BaseException | None = None
    told: str | None = None
    if trainer.is_global_zero:
        try:
            ownership.claim(last.dirpath, last.run_id, free)
        except Exception as err:
            failure, told = err, f"{type(err).__name__}: {err}"
    told = trainer.strategy.broadcast(("claim", told))[1]
    if failure is not None:
        raise failure
    if told is not None:
        error = CheckpointError(f"rank 0 could not record the run in {lit(last.dirpath)} ({lit(told)}); "
                                "every rank stops")
        error.agreed = True  # rank 0 prints its own error
        raise error


def check_checkpoint_names(callbacks: list[Any], last: LastCheckpoint) -> None:
    """A user's ModelCheckpoint must not write the pack's file names (``last.ckpt``, a recipe's ``best.ckpt``)
    in the pack's checkpoint folder: its saves would replace the checkpoint a resume continues from. Checked
    when the trainer is built (dirpaths given) and once ModelCheckpoint has resolved the others."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    if last.dirpath is None:
        return
    models = [c for c in callbacks if isinstance(c, ModelCheckpoint) and c.dirpath]
    here = [c for c in models if same_path(location(c.dirpath), last.dirpath)]
    taken = {"last", *(c.filename for c in here if getattr(c, "pack_owned", False))}
    for callback in here:
        if getattr(callback, "pack_owned", False):
            continue
        last_name = callback.CHECKPOINT_NAME_LAST if callback.save_last else None
        name = last_name if last_name in taken else callback.filename if callback.filename in taken else None
        if name is None:
            continue
        setting = "save_last=True" if name == last_name else f"filename={name!r}"
        where = "{callbacks}" if last.words.parent else "callbacks:"
        whose = "the recipe's" if last.words.parent else "the pack's"
        fix = "give it another dirpath" + (", or save_last=False" if name == last_name else ", or another filename")
        if not last.words.parent:
            fix += ", or move the pack's with build_trainer(checkpoint_dir=...)"
        raise ConfigError(f"{where} ModelCheckpoint({setting}) would write {name}.ckpt in {lit(last.dirpath)}, over "
                          f"{whose} own {name}.ckpt (what {last.words.resume} continues from): {fix}", "callbacks")


def _check_same(decision: dict[str, Any], rank: int, request: Any = None) -> str | None:
    """None when this rank reads rank 0's checkpoint as rank 0 does; else what it reads instead. The header this
    process read before the launch (``request``: a :class:`Continue`) is its read of that path."""
    path = decision["path"]
    if path is None:
        return None
    if isinstance(request, Continue) and request.seen is not None and request.expected == path:
        mine = Found(path, request.seen[0], 0, request.seen[1])
    else:
        try:
            mine = ownership.facts(path)
        except Exception as err:
            reason = "no such file" if isinstance(err, FileNotFoundError) else type(err).__name__
            return (f"rank 0 resumes from {lit(path)} (step {decision['step']}), which rank {rank} cannot read "
                    f"({reason})")
    if (mine.step, mine.run_id) != (decision["step"], decision["ckpt_run"]):
        return (f"rank 0 resumes from {lit(path)} (step {decision['step']} of run {decision['ckpt_run']}), which rank "
                f"{rank} reads as step {mine.step} of run {mine.run_id}")
    return None


def _gather(obj: Any) -> list[Any]:
    """Every rank's ``obj`` on every rank (``[obj]`` without a process group). Collective."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
