"""The bench's Lightning runs (``pack`` and ``plain`` in :mod:`ddp_recipes.bench.harness.worker`): what both runs time
and write.

* ``pack``: what a recipe run trains with (:func:`~ddp_recipes.train.run.make_trainer`): ``TunedDDPStrategy`` at
  N > 1, ``LastCheckpoint`` (signal flags, the preemption agreement, the step cadence), ``ThroughputMeter`` (the
  live meter and its ``StepClock``), ``DDPDiagnostics``, ``ResumeState``, ``InputWaitProfiler``, the
  resumable training loader, the CSV logger (with ``TrackerRun``) and the progress bar, at the recipe's
  log cadence.
* ``plain``: what a user writes with Lightning alone for the same LightningModule and data:
  ``L.Trainer(strategy="ddp")`` (``"auto"`` at one device), a shuffled ``DataLoader`` (Lightning inserts its
  ``DistributedSampler``), the same CSV logger, log cadence and progress bar.

Both are timed by :class:`~ddp_recipes.bench.harness.measure.StepEnds` at every training batch end, as the raw loop
is after every step. The clone's ``benchmarks/account/worker.py`` adds a counter of the iterations after the timed
steps and switches parts off (``--count-steps``, ``--without``).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from ddp_recipes.bench.harness.measure import HookClock, StepEnds, gather, peak_memory_mb, step_stats, wait_fraction

LOG_EVERY_N_STEPS = 10  # the recipes' default (RunConfig.log_every_n_steps)
PROGRESS_REFRESH = 20  # make_trainer's progress bar

def scratch_dir(out: str) -> Path:
    """Where a run's logs and checkpoints go: beside its JSON, the same path on every rank, removed after."""
    return Path(out).with_suffix(".scratch")


def step_timer(w: Any, counter: Any = None):
    """The Lightning side's step timer: :class:`StepEnds` at every training batch end, every other callback's
    hooks timed (:class:`HookClock`), the fetch wait of each step."""
    from lightning.pytorch.callbacks import Callback

    class Timer(Callback):
        def __init__(self) -> None:
            self.steps: StepEnds | None = None
            self.waits: list[float] = []
            self.hooks = HookClock()

        def on_train_start(self, trainer, pl_module) -> None:
            # Every other callback's hooks timed (the pack's parts, plain Lightning's bar), not the bench's own.
            self.hooks.attach(trainer.callbacks, skip=(Timer, type(counter)))
            self.steps = StepEnds(trainer.strategy.root_device, w.warmup_steps, w.total_steps, self.hooks)

        def on_train_epoch_start(self, trainer, pl_module) -> None:
            self.steps.epoch_start()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            from ddp_recipes.train.perf import input_wait

            if len(self.steps.ends) >= w.total_steps:  # the counted iterations after the timed steps
                return
            self.steps.step_end()
            self.waits.append(input_wait(trainer) or 0.0)

    return Timer()


def finish(w: Any, out: str, name: str, trainer: Any, timer: Any, facts: dict[str, Any],
           counter: Any = None) -> None:
    """Rank 0 writes the run's JSON (every rank's peak memory, thread CPU and step counts gathered), then removes
    the scratch."""
    device = trainer.strategy.root_device
    peaks = gather(round(peak_memory_mb(device), 1))
    counts = gather(counter.per_step() if counter else None)
    count_rows = gather(counter.compact() if counter else None)
    threads = gather(timer.steps.threads if timer.steps else None)
    hooks = gather(timer.hooks.ms_per_step(timer.steps.timed_steps) if timer.steps else None)
    if trainer.is_global_zero:
        ends = timer.steps.ends if timer.steps else []
        payload = {"impl": name, "devices": w.devices, "workload": asdict(w),
                   "first_step_s": ends[0] - timer.steps.start if ends else None,
                   "input_wait_fraction": wait_fraction(ends, timer.waits, w.warmup_steps),
                   "precision_used": str(trainer.precision), "strategy": type(trainer.strategy).__name__,
                   "torch_threads": torch.get_num_threads(), "peak_mem_mb_per_rank": peaks,
                   "threads_per_rank": threads, "hook_ms_per_step_per_rank": hooks, "steps_run": len(ends),
                   "step_counts_per_rank": counts if counter else None,
                   "step_count_rows_per_rank": count_rows if counter else None,
                   "cudnn_benchmark": torch.backends.cudnn.benchmark, **facts,
                   **step_stats(ends, w.warmup_steps, w.batch_size * w.devices,
                                timer.steps.across if timer.steps else frozenset())}
        Path(out).write_text(json.dumps(payload, indent=2) + "\n")
        shutil.rmtree(scratch_dir(out), ignore_errors=True)
