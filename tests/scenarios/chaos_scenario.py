"""A recipe run with one stop aimed at a chosen moment, for the chaos test in
tests/checkpointing/test_stop_schedules.py: ``python tests/scenarios/chaos_scenario.py RECIPE [flags...]``.

``CHAOS_KIND`` and ``CHAOS_AFTER`` (optimizer steps after the step this attempt starts from) say what and when:

* ``kill-job``: SIGKILL of the whole job (launcher, ranks, loader workers) at that step's start;
* ``term-launcher``: SIGTERM to rank 0, the launching process, at that step's start;
* ``kill-rank1``: SIGKILL of rank 1 alone at that step's start;
* ``kill-in-upload``: SIGKILL of the job while that step's checkpoint is being written (local: the temp file
  half written; bucket: the object's upload under way);
* ``kill-before-publish``: SIGKILL of the job once that step's checkpoint is complete but not yet published
  (local: before the rename; bucket: the object uploaded, the manifest not);
* ``kill-in-validation``: SIGKILL of the job in the first validation batch this attempt runs after a step;
* ``term-last-batch``: SIGTERM to rank 0 at the start of an epoch's second-to-last batch (the stop is agreed
  at the epoch's last step or its end);
* ``kill-after-agreed``: SIGTERM to rank 0 at that step's start, then SIGKILL of the job right after the
  agreed stop's checkpoint is saved, before the ranks exit.

Rank 0 prints ``[chaos] start epoch E batch B step S`` at its first batch and ``[chaos] stop KIND at ...`` when it
acts, so every attempt's log says where it started and where it was stopped. With ``CHAOS_RECORD=FILE`` (and no
kind: nothing stopped) rank 0 writes there, at its first batch, the epoch and the sample indices its training
loader's sampler gives for the rest of that epoch.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning.pytorch.callbacks import Callback  # noqa: E402

from ddp_recipes.checkpointing import files, last  # noqa: E402
from tests.helpers import run_recipe_with  # noqa: E402

KIND = os.environ.get("CHAOS_KIND", "")
AFTER = int(os.environ.get("CHAOS_AFTER", "1"))
RECORD = os.environ.get("CHAOS_RECORD")


def say(text: str) -> None:
    print(f"[chaos] {text}", file=sys.stderr, flush=True)


def kill_job(why: str) -> None:
    say(f"stop {KIND}: {why}")
    os.killpg(os.getpgrp(), signal.SIGKILL)


class Chaos(Callback):
    def __init__(self) -> None:
        self.start: int | None = None
        self.trained = False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        rank, step = trainer.global_rank, trainer.global_step
        if self.start is None:
            self.start = step
            if rank == 0:
                say(f"start epoch {trainer.current_epoch} batch {batch_idx} step {step}")
                _arm_saves(self, trainer)
                if RECORD:
                    shard = [int(i) for i in trainer.train_dataloader.sampler]  # the resumed position's samples
                    Path(RECORD).write_text(json.dumps({"epoch": trainer.current_epoch, "samples": shard}))
        self.trained = step > self.start
        at = step == self.start + AFTER
        if KIND == "term-last-batch" and rank == 0 and batch_idx == trainer.num_training_batches - 2:
            say(f"stop {KIND}: SIGTERM at epoch {trainer.current_epoch} batch {batch_idx} step {step}")
            os.kill(os.getpid(), signal.SIGTERM)
        elif at and KIND in ("term-launcher", "kill-after-agreed") and rank == 0:
            say(f"stop {KIND}: SIGTERM at step {step}")
            os.kill(os.getpid(), signal.SIGTERM)
        elif at and KIND == "kill-job" and rank == 0:
            kill_job(f"at step {step}")
        elif at and KIND == "kill-rank1" and rank == 1:
            print(f"[chaos] stop {KIND}: at step {step}", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        if KIND == "kill-in-validation" and trainer.global_rank == 0 and self.trained and not trainer.sanity_checking:
            kill_job(f"validation batch {batch_idx} after step {trainer.global_step}")


def _arm_saves(chaos: Chaos, trainer) -> None:
    """Rank 0 writes the checkpoints: wrap its save for the aimed step."""
    target = chaos.start + AFTER
    save, put_file, put_bytes = files.save, files.put_file, files.put_bytes

    def aimed(path, write, step, epoch, run_id):
        if step != target or not str(path).endswith("last.ckpt"):
            return save(path, write, step, epoch, run_id)
        local = not isinstance(files._rule(path), files.Published)  # a bucket's path may come without its "//"
        if KIND == "kill-in-upload" and local:
            return save(path, lambda f: write(_Cut(f)), step, epoch, run_id)
        if KIND == "kill-before-publish" and local:
            return save(path, lambda f: (write(f), f.flush(), kill_job(f"temp file of step {step} complete")),
                        step, epoch, run_id)
        return save(path, write, step, epoch, run_id)

    def upload(local, url):
        if KIND == "kill-in-upload" and f"-{target:08d}-" in str(url):
            threading.Timer(0.05, kill_job, args=(f"upload of step {target} under way",)).start()
        return put_file(local, url)

    def manifest(url, data):
        if KIND == "kill-before-publish" and str(url).endswith("last.ckpt.manifest.json") and b'"global_step": %d,' \
                % target in data:
            kill_job(f"object of step {target} uploaded, manifest not")
        return put_bytes(url, data)

    files.save, files.put_file, files.put_bytes = aimed, upload, manifest
    if KIND == "kill-after-agreed":
        exit_after_save = last.LastCheckpoint._exit

        def exit_killed(self, trainer, signum):
            if signum:  # called at every boundary; 0: no stop agreed there
                kill_job(f"agreed stop saved at step {trainer.global_step}")
            exit_after_save(self, trainer, signum)

        last.LastCheckpoint._exit = exit_killed


class _Cut:
    """A file that kills the job once 256 KiB are written to it."""

    def __init__(self, file) -> None:
        self.file, self.written = file, 0

    def write(self, data) -> int:
        n = self.file.write(data)
        self.written += n
        if self.written > 1 << 18:
            self.file.flush()
            kill_job(f"temp file cut at {self.written} bytes")
        return n

    def __getattr__(self, name):
        return getattr(self.file, name)


def main() -> None:
    run_recipe_with(Chaos(), sys.argv[1:])


if __name__ == "__main__":
    main()
