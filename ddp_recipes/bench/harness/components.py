"""The bench's Lightning runs (``pack`` and ``plain`` in :mod:`ddp_recipes.bench.harness.worker`): the pack's parts
that ``--without`` switches off, and what both runs time and write.

* ``pack``: what a recipe run trains with (:func:`~ddp_recipes.train.run.make_trainer`): ``TunedDDPStrategy`` at
  N > 1, ``LastCheckpoint`` (signal flags, the preemption agreement, the step cadence), ``ThroughputMeter`` (the
  live meter and its ``StepClock``), ``DDPDiagnostics``, ``ResumeState``, ``InputWaitProfiler``, the
  resumable training loader, the CSV logger (with ``TrackerRun``) and the progress bar, at the recipe's
  log cadence. ``--without a,b`` switches parts off, each alone (:data:`PACK_COMPONENTS`), to measure
  what each costs.
* ``plain``: what a user writes with Lightning alone for the same LightningModule and data:
  ``L.Trainer(strategy="ddp")`` (``"auto"`` at one device), a shuffled ``DataLoader`` (Lightning inserts its
  ``DistributedSampler``), the same CSV logger, log cadence and progress bar.

Both are timed by :class:`~ddp_recipes.bench.harness.measure.StepEnds` at every training batch end, as the raw loop
is after every step; after the timed steps, ``count_steps`` whole loop iterations are counted
(:class:`~ddp_recipes.bench.harness.step_counts.StepCounts`: host reads and collectives per step, per rank).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from ddp_recipes.bench.harness.measure import HookClock, StepEnds, gather, peak_memory_mb, step_stats, wait_fraction
from ddp_recipes.bench.harness.step_counts import StepCounts, compact, per_step

LOG_EVERY_N_STEPS = 10  # the recipes' default (RunConfig.log_every_n_steps)
PROGRESS_REFRESH = 20  # make_trainer's progress bar

# What --without switches off in a pack run, each alone; the value says what is left in its place.
PACK_COMPONENTS = {
    "vote": "the preemption agreement across ranks (StopVote: watcher thread, epoch-end vote); each rank alone",
    "last-checkpoint": "LastCheckpoint altogether (signal flags, vote, step cadence, epoch-end save)",
    "diagnostics": "DDPDiagnostics",
    "meter": "ThroughputMeter (live meter and StepClock)",
    "bucket-view": "the pack's gradient_as_bucket_view (True on CUDA, False on CPU) flipped to the other value",
    "progress-bar": "the progress bar (refresh every 20 steps)",
    "logger": "the CSV logger and TrackerRun (no logger)",
    "profiler": "InputWaitProfiler (Lightning's PassThroughProfiler instead)",
    "resumable-loader": "the resumable training loader (Lightning's DistributedSampler loader instead)",
}


def parse_without(text: str) -> list[str]:
    """The comma list ``--without`` names, each checked against :data:`PACK_COMPONENTS`."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [n for n in names if n not in PACK_COMPONENTS]
    if unknown:
        raise SystemExit(f"--without {unknown[0]!r}: not a pack component; choose from {', '.join(PACK_COMPONENTS)}")
    return names


def scratch_dir(out: str) -> Path:
    """Where a run's logs and checkpoints go: beside its JSON, the same path on every rank, removed after."""
    return Path(out).with_suffix(".scratch")


def step_timer(w: Any):
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
            self.hooks.attach(trainer.callbacks, skip=(Timer, StepCounts))
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


def step_counter(w: Any) -> StepCounts | None:
    """The Lightning side's count of the ``w.count_steps`` whole loop iterations after the timed steps (None:
    the workload counts none)."""
    return StepCounts(after=w.total_steps, count=w.count_steps) if w.count_steps else None


def switch_off(trainer: Any, names: list[str]) -> None:
    """Take the named parts out of a built pack Trainer (before ``fit``), each as if it had never been added."""
    from lightning.pytorch.callbacks import ProgressBar
    from lightning.pytorch.profilers import PassThroughProfiler

    from ddp_recipes.checkpointing.last import LastCheckpoint
    from ddp_recipes.lightning_seam.connectors import remove_loader_hook
    from ddp_recipes.lightning_seam.reach import ddp_kwargs
    from ddp_recipes.train.callbacks import ThroughputMeter
    from ddp_recipes.train.diagnostics import DDPDiagnostics
    from ddp_recipes.train.tracking import TrackerRun

    callbacks = {"last-checkpoint": LastCheckpoint, "diagnostics": DDPDiagnostics, "meter": ThroughputMeter,
                 "progress-bar": ProgressBar, "logger": TrackerRun}
    drop = tuple(callbacks[n] for n in names if n in callbacks)
    trainer.callbacks = [c for c in trainer.callbacks if not isinstance(c, drop)]
    if "vote" in names:
        from ddp_recipes.checkpointing.vote import StopVote

        # This measuring process only: LastCheckpoint then acts on its own rank's flag, as with one rank.
        StopVote.open = classmethod(lambda cls, trainer: None)
    if "logger" in names:
        trainer.loggers = []
    if "profiler" in names:
        trainer.profiler = PassThroughProfiler()
    if "resumable-loader" in names:
        remove_loader_hook(trainer)
    kwargs = ddp_kwargs(trainer.strategy)
    if "bucket-view" in names and kwargs is not None:
        from ddp_recipes.ddp.strategy import bucket_view_default

        chosen = kwargs.get("gradient_as_bucket_view")
        if chosen is None:
            chosen = bucket_view_default(trainer.strategy.root_device)
        kwargs["gradient_as_bucket_view"] = not chosen


def finish(w: Any, out: str, name: str, trainer: Any, timer: Any, facts: dict[str, Any],
           counter: StepCounts | None = None) -> None:
    """Rank 0 writes the run's JSON (every rank's peak memory, thread CPU and step counts gathered), then removes
    the scratch."""
    device = trainer.strategy.root_device
    peaks = gather(round(peak_memory_mb(device), 1))
    counts = gather(per_step(counter.rows) if counter else None)
    count_rows = gather(compact(counter.rows) if counter else None)
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
