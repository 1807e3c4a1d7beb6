"""``last.ckpt``: written on a fixed cadence, where a limit ends the fit, and on preemption, on every rank together.

Lightning's ``ModelCheckpoint(save_last=True)`` refreshes ``last.ckpt`` only when it saves a top-k checkpoint;
:class:`LastCheckpoint` writes it on its own cadence, with or without validation.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Checkpoint
from typing_extensions import override

from ddp_recipes.checkpointing import kept
from ddp_recipes.checkpointing.checkpoint import RUN_KEY
from ddp_recipes.checkpointing.preemption import AgreedStop
from ddp_recipes.checkpointing.run_folder import ownership
from ddp_recipes.lightning_seam import reach
from ddp_recipes.storage import Url, location

LAST = "last.ckpt"
RECIPE_RESUME = "rerun with --resume auto"
# What a build_trainer user does instead (their script has no --resume flag).
LIBRARY_RESUME = 'run the script again with trainer.fit(..., ckpt_path="last") to continue from it'


class LastCheckpoint(Checkpoint, AgreedStop):
    """``<dirpath>/last.ckpt`` at every epoch end, every ``every_n_steps`` steps and where the ranks agree to stop on
    a signal (:class:`~ddp_recipes.checkpointing.preemption.AgreedStop`), on rank 0. A fit that stops inside its
    epoch saves at that batch's end, as a preemption does: a save from the epoch-end hooks would say the epoch is
    over and a continued run would skip its rest. A ``Checkpoint``, so its epoch-end hook runs after the
    LightningModule's; ``fast_dev_run`` writes nothing.
    """

    def __init__(self, dirpath: str | os.PathLike | None, every_n_steps: int = 0,
                 resume_hint: str | None = None, words: ownership.Words | None = None) -> None:
        super().__init__()
        if every_n_steps < 0:
            raise ValueError(f"--checkpoint-every-n-steps must be >= 0 (got {every_n_steps})")
        # None: set before fit (build_trainer puts it under the Trainer's default_root_dir). A URL stays one:
        # Path("s3://b/run") would be a local folder named "s3:".
        self.dirpath = location(dirpath) if dirpath is not None else None
        self.every_n_steps = every_n_steps
        if words is None:
            words = ownership.LIBRARY if resume_hint == LIBRARY_RESUME else ownership.RECIPE
        self.words = words
        # the preemption message's last words: how to continue
        self.resume_hint = resume_hint or (LIBRARY_RESUME if words is ownership.LIBRARY else RECIPE_RESUME)
        self.run_id: str | None = None
        self._saved_step = -1

    @property
    def path(self) -> Path | Url:
        return self.dirpath / LAST

    # ---- the cadence -----------------------------------------------------------------------------------

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # The step this process starts at is a boundary already passed (and saved, when resuming): the
        # first micro-batch of an accumulation window must not look like a new optimizer step.
        super().on_train_start(trainer, pl_module)
        self._saved_step = trainer.global_step
        resumed = trainer.ckpt_path
        kept.started(resumed, trainer.global_step,
                     own=resumed is not None and str(resumed).startswith(str(self.dirpath).rstrip("/") + "/"))

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        if step == self._seen_step:
            return  # an accumulation micro-batch: no optimizer step, no boundary
        self._seen_step = step
        signum = self._agreed_signal(trainer)
        last_of_epoch = trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
        due = self.every_n_steps > 0 and step % self.every_n_steps == 0 and not last_of_epoch
        if signum or due or (not last_of_epoch and _stops_after_this_batch(trainer, step)):
            self.save(trainer)
        self._exit(trainer, signum)

    @override
    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        if self.run_id is not None:  # every checkpoint of the trainer (ModelCheckpoint's too) names its run
            checkpoint[RUN_KEY] = {"run_id": self.run_id}

    @override
    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.save(trainer)
        self._exit(trainer, self._agreed_signal(trainer, now=True))  # a signal during epoch-end validation lands here

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        super().on_exception(trainer, pl_module, exception)
        self.teardown(trainer, pl_module, "fit")

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit" and trainer.is_global_zero and self.run_id and not trainer.fast_dev_run:
            ownership.release(self.dirpath, self.run_id)  # the fit is over: it holds the folder no more

    def save(self, trainer: L.Trainer) -> None:
        """Write last.ckpt (every rank calls; rank 0 writes), once per step."""
        if trainer.global_step == self._saved_step or trainer.fast_dev_run:  # the same on every rank: collective
            return
        trainer.save_checkpoint(self.path, weights_only=False)
        self._saved_step = trainer.global_step
        kept.saved(str(self.path), trainer.global_step)

    # ---- preemption ----------------------------------------------------------------------------------

    def _kept(self, requeued: str) -> str:
        return f"checkpoint saved to {self.path}{requeued}; {self.resume_hint}"


def _stops_after_this_batch(trainer: L.Trainer, step: int) -> bool:
    """Whether the fit loop ends after this batch (checked at its end, every rank alike): ``max_steps``
    reached, or ``should_stop`` set (``max_time``'s Timer, whose batch-end hook runs before any checkpoint
    callback's, a module, a callback) where Lightning lets the fit stop early."""
    if trainer.max_steps != -1 and step >= trainer.max_steps:
        return True
    return bool(trainer.should_stop) and reach.can_stop_early(trainer)
