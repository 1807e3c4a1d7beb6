"""What each stop of a run cost: every attempt (one launch of the command) leaves a record in the run folder,
and ``summary.json`` sums them (docs/resume-and-preemption.md#what-a-stop-costs).

An attempt's record, ``<output-dir>/attempts/<n>.json``, written by rank 0 only:

* ``started_at``: when the recipe began setting up (after its imports), ``train_started_at``: training's
  start (the checkpoint restored, the loaders built), ``first_step_at``: the end of its first optimizer step;
* ``start_step``: the step it resumed from (0 for a fresh run), ``last_step`` / ``last_step_at``: the
  latest step it was seen at, and ``ended`` / ``ended_at``: how it ended (``finished``, ``preempted by
  SIGTERM``, ``error: ...``); a SIGKILL or a lost machine leaves ``ended`` null.

The latest step is written at the first step, at every checkpoint save, by a heartbeat thread every
:data:`HEARTBEAT_S` seconds (more on object storage) when it changed, and at every end the process lives to
see: no hook on the step's path, and a killed attempt's ``last_step`` is what it had reached within one
heartbeat of the kill, and never short of its last checkpoint.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from ddp_recipes.checkpointing.preemption import Preempted
from ddp_recipes.checkpointing.run_folder.ownership import ATTEMPTS_DIR
from ddp_recipes.lightning_seam import reach
from ddp_recipes.storage import location
from ddp_recipes.storage.store import listing, read_bytes, write_json_atomic

HEARTBEAT_S = 2.0  # a local folder: one small atomic write when the step changed
BUCKET_HEARTBEAT_S = 10.0  # object storage: a PUT each


class AttemptLog(Callback):
    """Writes this attempt's record in ``folder/attempts`` (rank 0); see the module's docstring."""

    def __init__(self, folder: Any, started_at: float | None = None) -> None:
        self.folder = location(folder) / ATTEMPTS_DIR
        self.record: dict[str, Any] = {"started_at": started_at or time.time(), "ended": None}
        self._trainer: L.Trainer | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._warned = False

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # After the checkpoint is agreed (the run's id is known) and before the sanity check: an attempt that
        # fails there (a corrupt image) still leaves its end, so the same command may start afresh.
        if not trainer.is_global_zero:
            reach.switch_off_hook(self, "on_train_batch_end")  # only rank 0 records
            return
        self._trainer = trainer
        # Lightning restores the loops (global_step) after on_fit_start: the step is the loaded checkpoint's.
        loaded = reach.loaded_checkpoint(trainer)
        step = int(loaded.get("global_step", trainer.global_step))
        self.record.update(attempt=_next_number(self.folder), run_id=trainer_run_id(trainer), start_step=step,
                           last_step=step, last_step_at=time.time(), world_size=trainer.world_size)
        self._write()

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._trainer is None:
            return
        self.record["train_started_at"] = time.time()
        self._write()
        interval = BUCKET_HEARTBEAT_S if "://" in str(self.folder) else HEARTBEAT_S
        self._thread = threading.Thread(target=self._beat, args=(interval,), name="ddp-recipes-attempt-log",
                                        daemon=True)
        self._thread.start()

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step > self.record.get("start_step", 0):  # an accumulation micro-batch is not a step
            reach.switch_off_hook(self, "on_train_batch_end")  # the first step only: off the step's path
            self.record["first_step_at"] = time.time()
            self._note_step(trainer)
            self._write()  # once: an attempt killed within a heartbeat still shows when it began training

    @override
    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        # a checkpoint costs far more than this small write: the record never lags the last checkpoint
        if self._trainer is not None and self._note_step(trainer):
            self._write()

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._end(trainer, "finished")

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        how = (f"preempted by {signal.Signals(exception.signum).name}" if isinstance(exception, Preempted)
               else f"error: {type(exception).__name__}")
        if self._trainer is None and self.record["ended"] is None and trainer_run_id(trainer) is not None:
            # failed after the run claimed its folder but before on_fit_start (the DDP wrap, the optimizers):
            # its record still says so, or the folder would stay that run's against the same command
            self.on_fit_start(trainer, pl_module)
        self._end(trainer, how)

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._stop.set()

    def _end(self, trainer: L.Trainer, how: str) -> None:
        if self._trainer is None or self.record["ended"] is not None:
            return
        self._stop.set()
        self._note_step(trainer)
        self.record.update(ended=how, ended_at=time.time())
        self._write()

    def _note_step(self, trainer: L.Trainer) -> bool:
        step = trainer.global_step
        if step == self.record.get("last_step"):
            return False
        self.record.update(last_step=step, last_step_at=time.time())
        return True

    def _beat(self, interval: float) -> None:
        while not self._stop.wait(interval):
            if self._trainer is not None and self._note_step(self._trainer):
                self._write()

    def _write(self) -> None:
        with self._lock:  # the heartbeat thread and the training thread
            try:
                write_json_atomic(self.folder / f"{self.record['attempt']}.json", self.record)
            except Exception as error:  # the record is an account, never a reason to stop training
                if not self._warned:
                    self._warned = True
                    rank_zero_warn(f"could not write the attempt record in {self.folder} ({error}); summary.json "
                                   "will not count this attempt's stops")


def trainer_run_id(trainer: L.Trainer) -> str | None:
    """The run this attempt continues or starts (the id its checkpoints and ``run.json`` carry)."""
    from ddp_recipes.checkpointing.last import LastCheckpoint

    return next((c.run_id for c in trainer.callbacks if isinstance(c, LastCheckpoint)), None)


def _next_number(folder: Any) -> int:
    """One past the highest record number in ``folder`` (an unreadable record keeps its number taken)."""
    try:
        names = listing(folder)
    except OSError:
        names = []
    numbers = [int(name[:-5]) for name in map(str, names) if name.endswith(".json") and name[:-5].isdigit()]
    return max(numbers, default=0) + 1


def read_attempts(folder: Any, run_id: str | None = None) -> list[dict[str, Any]]:
    """The attempt records in ``folder`` (an ``attempts`` folder), by attempt number; unreadable ones skipped;
    with ``run_id``, only that run's (a run that ended before its first checkpoint left others there)."""
    records = []
    try:
        names = listing(folder)
    except (FileNotFoundError, OSError):
        return []
    for name in names:
        if not str(name).endswith(".json"):
            continue
        try:
            record = json.loads(read_bytes(location(folder) / name))
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and isinstance(record.get("attempt"), int) and (
                run_id is None or record.get("run_id") == run_id):
            records.append(record)
    return sorted(records, key=lambda r: r["attempt"])
