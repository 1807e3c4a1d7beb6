"""The run's position in its epochs, saved in every checkpoint and checked against what the run then does.

An exact resume rests on the checkpoint's counts, Lightning's loop counters and the training loader's skip
agreeing; when they part, a resumed run trains batches twice and ends past its limit with no error (issue #43).
:class:`RunPosition` keeps its own copy and fails loudly, on every rank (Python integers, no collective).
:func:`open_next_epoch` and :func:`reopen_cut_epoch` put right the two restores of Lightning 2.6 that break it.
"""

from __future__ import annotations

import math
from typing import Any

import lightning as L
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from ddp_recipes.checkpointing.checkpoint import TrainerStateCallback
from ddp_recipes.lightning_seam import reach

# ---- two restores Lightning 2.6 gets wrong, put right at the training boundary (ResumeState) ----------


def open_next_epoch(trainer: L.Trainer) -> bool:
    """Resumed from a checkpoint written at an epoch's last batch end, let the next epoch start as every epoch
    does; returns whether it opened the epoch.

    Lightning 2.6 keeps the fit loop's "restarted mid-epoch" stage there, so the next epoch is never started
    (no ``on_train_epoch_start``) and a checkpoint written in it resumed the whole epoch again (issue #43). The
    batch counters are reset too: Lightning resets them only when the restored count reaches this run's epoch
    length, so a longer epoch (another batch or world size) was trained short.
    """
    fit_loop = trainer.fit_loop
    loop = fit_loop.epoch_loop
    if not (fit_loop.restarted_mid_epoch and loop.restarted_on_train_batch_end and loop.batch_progress.is_last_batch):
        return False
    fit_loop.reset_restart_stage()
    loop.batch_progress.increment_completed()  # what the epoch loop's restart would count before resetting
    loop.batch_progress.reset_on_run()
    loop.scheduler_progress.reset_on_run()
    loop.automatic_optimization.optim_progress.reset_on_run()
    loop.val_loop.batch_progress.total.reset()
    loop.reset_restart_stage()  # still restarting: _batches_that_stepped gets the step the checkpoint preceded
    return True


def reopen_cut_epoch(trainer: L.Trainer) -> None:
    """Resumed from a checkpoint written after a fit that stopped inside an epoch (the recipes' ``final.ckpt``),
    continue that epoch at its next batch, as from the ``last.ckpt`` of the same step.

    Lightning 2.6 counts the cut epoch completed and trains the next one short. Here the epoch counters go back to
    "started, not processed" with a mid-epoch restart stage, before the loader is repositioned (it reads them).
    """
    fit_loop = trainer.fit_loop
    loop, progress = fit_loop.epoch_loop, fit_loop.epoch_progress
    batches, done = trainer.num_training_batches, loop.batch_progress.current.completed
    cut = isinstance(batches, int | float) and 0 < done < batches and not loop.batch_progress.is_last_batch
    if (not cut or not loop.restarted_on_last or not reach.restart_stage_none(trainer)
            or progress.current.processed < 1 or progress.current.completed != progress.current.processed):
        return
    for counts in (progress.current, progress.total):
        counts.processed -= 1
        counts.completed -= 1
    reach.restart_mid_epoch(trainer)


_UNKNOWN = -1  # an epoch length that stands for "some epoch had a length not known here"


class RunPositionError(RuntimeError):
    """The resumed run would repeat, skip or overrun training: the checkpoint and the loops disagree."""


def _epoch_steps(batches: Any, accumulate: int) -> int | None:
    """Optimizer steps an epoch of ``batches`` batches makes (the last, partial window steps too)."""
    if not isinstance(batches, int | float) or not math.isfinite(batches) or batches <= 0:
        return None
    return math.ceil(int(batches) / max(1, accumulate))


def _train_loader_position(trainer: L.Trainer) -> tuple[int, int] | None:
    """(epoch, samples skipped by the live iteration, over all ranks) of a resumable training loader."""
    from ddp_recipes.data.resumable import ResumableDataLoader

    loader = trainer.train_dataloader
    if not isinstance(loader, ResumableDataLoader):
        return None
    return int(loader.sampler.epoch), int(loader.sampler.started_at)


def _loader_samples_seen(trainer: L.Trainer) -> int | None:
    from ddp_recipes.data.resumable import ResumableDataLoader

    loader = trainer.train_dataloader
    return loader.samples_seen() if isinstance(loader, ResumableDataLoader) else None


class RunPosition(TrainerStateCallback):
    """Records (epoch, its first step, batches trained in it) in checkpoints; checks a resumed run against it at
    its first batch, every epoch end and the fit's end (:class:`RunPositionError`). A checkpoint without a record
    is resumed unchecked until the next whole epoch."""

    def __init__(self) -> None:
        self._epoch: int | None = None  # the epoch being trained (None: not known yet in this fit)
        self._first_step: int | None = None  # global step at that epoch's first batch
        self._expect: dict[str, Any] | None = None  # the checkpoint's position, until the first batch meets it
        self._unchecked_epoch: int | None = None  # an epoch resumed with another shape: its step count differs
        self._epoch_lengths: set[int] = set()  # steps per epoch seen in this run (the limit check needs one)

    # ---- saving --------------------------------------------------------------------------------------

    @override
    def state_dict(self) -> dict[str, Any]:
        trainer = self._trainer
        if trainer is None or self._epoch is None or self._first_step is None:
            return {}
        loop = trainer.fit_loop.epoch_loop
        return {"epoch": self._epoch, "first_step": self._first_step, "global_step": trainer.global_step,
                # processed, not completed: a checkpoint saved in on_train_batch_end (every_n_train_steps) is
                # written before Lightning counts that batch completed
                "batches": int(loop.batch_progress.current.processed), "epoch_batches": _batches(trainer),
                "last_batch": bool(loop.batch_progress.is_last_batch),  # an unsized loader's epoch end
                "stopped_early": bool(trainer.should_stop),  # EarlyStopping, max_time, a module: the epoch is cut
                "world_size": trainer.world_size, "accumulate": trainer.accumulate_grad_batches,
                "samples_seen": _loader_samples_seen(trainer), "epoch_lengths": sorted(self._epoch_lengths),
                "unchecked_epoch": self._unchecked_epoch}

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self._expect = None  # Lightning restores callback states after setup: only this fit's checkpoint counts

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._expect = dict(state_dict) if state_dict else None

    # ---- checking --------------------------------------------------------------------------------------

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        reach.switch_on_hook(self, "on_train_batch_start")  # this fit's first batch is checked again
        saved = self._expect if trainer.ckpt_path is not None else None
        self._expect = None
        self._epoch = self._first_step = self._unchecked_epoch = None
        self._epoch_lengths = set()
        if (trainer.ckpt_path is not None or trainer.global_step > 0) and not saved:
            # resumed from a checkpoint with no record, or a second fit of this trainer: the epochs before
            # may have had another length, so no one length implies the run's total
            self._epoch_lengths = {_UNKNOWN}
        if not saved:
            return
        same_shape = (saved.get("world_size") == trainer.world_size and saved.get("accumulate")
                      == trainer.accumulate_grad_batches and saved.get("epoch_batches") == _batches(trainer))
        finished = bool(saved.get("last_batch")) or saved["batches"] >= (saved.get("epoch_batches") or math.inf)
        # Epochs of another length before (a resume at another world size): no one length implies the total.
        # This run's own length counts from now on, whether or not it reaches an epoch end: a run resumed at
        # another shape and stopped by max_steps mid-epoch must not be held to the old epochs' length alone.
        self._epoch_lengths = set(saved.get("epoch_lengths") or [])
        if not same_shape:
            old = _epoch_steps(saved.get("epoch_batches"), saved.get("accumulate") or 1)
            new = _epoch_steps(_batches(trainer), trainer.accumulate_grad_batches)
            self._epoch_lengths |= {_UNKNOWN if length is None else length for length in (old, new)}
        self._expect = {**saved, "finished": finished, "same_shape": same_shape}
        if not finished:  # the resumed fit continues this epoch: its first step carries over
            self._epoch, self._first_step = saved["epoch"], saved["first_step"]
            if not same_shape or saved.get("unchecked_epoch") == saved["epoch"]:
                # its steps are part old shape, part new: neither epoch length bounds them
                self._unchecked_epoch = saved["epoch"]
                self._epoch_lengths.add(_UNKNOWN)

    @override
    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Lightning calls it for every epoch it opens (not for one it continues mid-way)
        self._epoch, self._first_step = trainer.current_epoch, trainer.global_step

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        """The fit's first batch only: then this hook takes itself off the step's path (Lightning skips a
        hook that is not callable), so later steps pay nothing for it."""
        reach.switch_off_hook(self, "on_train_batch_start")
        if self._expect is not None:
            expect, self._expect = self._expect, None
            self._check_first_batch(trainer, batch_idx, expect)
        if batch_idx == 0:  # an epoch's first batch, whether or not Lightning opened it with its hooks
            self._epoch, self._first_step = trainer.current_epoch, trainer.global_step

    def _check_first_batch(self, trainer: L.Trainer, batch_idx: int, saved: dict[str, Any]) -> None:
        epoch, step = trainer.current_epoch, trainer.global_step
        if saved["finished"]:
            want_epoch, want_batch, want_skip = saved["epoch"] + 1, 0, 0
        else:
            want_epoch, want_batch, want_skip = saved["epoch"], saved["batches"], saved.get("samples_seen")
        where = (f"the checkpoint was written after {saved['batches']} of epoch {saved['epoch']}'s "
                 f"{saved.get('epoch_batches')} batches, at step {saved['global_step']}")
        if step != saved["global_step"]:
            _fail(f"the resumed run starts at step {step}, but {where}")
        sized = saved.get("epoch_batches") is not None  # an unsized loader's batch numbers are not a position
        if saved.get("stopped_early") and not saved["finished"] and epoch == saved["epoch"] + 1 and batch_idx == 0:
            rank_zero_warn(f"[run-position] the checkpoint's run stopped early inside epoch {saved['epoch']} (after "
                           f"{saved['batches']} of its {saved.get('epoch_batches')} batches: EarlyStopping, "
                           f"max_time or should_stop); this run goes on with epoch {epoch}, so the rest of epoch "
                           f"{saved['epoch']} is not trained")
            return
        if epoch != want_epoch or (sized and (saved["same_shape"] or saved["finished"]) and batch_idx != want_batch):
            _fail(f"the resumed run starts at epoch {epoch}, batch {batch_idx}, but {where}: it would "
                  f"{'train batches of that epoch a second time' if epoch == saved['epoch'] else 'skip or repeat'}"
                  f" (expected epoch {want_epoch}, batch {want_batch})")
        position = _train_loader_position(trainer)
        if position is not None and want_skip is not None and position != (want_epoch, want_skip):
            _fail(f"the training loader starts epoch {position[0]} after {position[1]} samples, but {where} and "
                  f"its loader had given {want_skip} samples of epoch {want_epoch}")

    @override
    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._epoch is None or self._first_step is None:
            return
        length = _epoch_steps(_batches(trainer), trainer.accumulate_grad_batches)
        if length is None or self._unchecked_epoch == self._epoch:
            return
        trained = trainer.global_step - self._first_step
        if trained > length:
            _fail(f"epoch {self._epoch} made {trained} optimizer steps (steps {self._first_step + 1}-"
                  f"{trainer.global_step}), but it has {_batches(trainer)} batches: {length} steps at most; "
                  "batches of it were trained twice")
        if reach.epoch_batches_done(trainer):
            self._epoch_lengths.add(length)

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        step, limits = trainer.global_step, []
        if trainer.max_steps is not None and trainer.max_steps >= 0:
            limits.append((trainer.max_steps, f"max_steps={trainer.max_steps}"))
        if (trainer.max_epochs is not None and trainer.max_epochs >= 0 and len(self._epoch_lengths) == 1
                and _UNKNOWN not in self._epoch_lengths):  # "no length known" is no length to multiply
            (length,) = self._epoch_lengths
            limits.append((trainer.max_epochs * length, f"max_epochs={trainer.max_epochs} x {length} steps per "
                                                        "epoch"))
        over = [(limit, why) for limit, why in limits if step > limit]
        if over:
            limit, why = min(over)
            raise RunPositionError(f"[run-position] the run ended at step {step}, past the {limit} that {why} "
                                   "implies: batches were trained twice. Please report it with the run's log")


def _batches(trainer: L.Trainer) -> Any:
    batches = trainer.num_training_batches
    return int(batches) if isinstance(batches, int | float) and math.isfinite(batches) else None


def _fail(message: str) -> None:
    raise RunPositionError(f"[run-position] {message}. The checkpoint's position and Lightning's loops disagree; "
                           "nothing past this point was trained. Please report it with the run's log")
