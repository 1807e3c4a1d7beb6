"""``python -m benchmarks.account.worker IMPL ...``: the bench's worker (:mod:`ddp_recipes.bench.harness.worker`, the
same flags) with what ``account`` and ``overhead`` add: ``--count-steps N`` whole loop iterations counted after the
timed steps (:mod:`benchmarks.account.step_counts`), and ``--without a,b``, the pack's parts switched off, each alone
(:data:`PACK_COMPONENTS`), to measure what each costs.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

from benchmarks.account.step_counts import LoopCount, StepCounts
from ddp_recipes.bench.harness import baselines
from ddp_recipes.bench.harness import worker as bench_worker

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
    "rank-watch": "RankWatch (2+ ranks: the hang report's thread and progress marks, the straggler windows)",
}


def parse_without(text: str) -> list[str]:
    """The comma list ``--without`` names, each checked against :data:`PACK_COMPONENTS`."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [n for n in names if n not in PACK_COMPONENTS]
    if unknown:
        raise SystemExit(f"--without {unknown[0]!r}: not a pack component; choose from {', '.join(PACK_COMPONENTS)}")
    return names


def switch_off(trainer: Any, names: list[str]) -> None:
    """Take the named parts out of a built pack Trainer (before ``fit``), each as if it had never been added."""
    from lightning.pytorch.callbacks import ProgressBar
    from lightning.pytorch.profilers import PassThroughProfiler

    from ddp_recipes.checkpointing.last import LastCheckpoint
    from ddp_recipes.lightning_seam.connectors import remove_loader_hook
    from ddp_recipes.lightning_seam.reach import ddp_kwargs
    from ddp_recipes.train.callbacks import ThroughputMeter
    from ddp_recipes.train.diagnostics import DDPDiagnostics
    from ddp_recipes.train.rank_watch import RankWatch
    from ddp_recipes.train.tracking import TrackerRun

    callbacks = {"last-checkpoint": LastCheckpoint, "diagnostics": DDPDiagnostics, "meter": ThroughputMeter,
                 "progress-bar": ProgressBar, "logger": TrackerRun, "rank-watch": RankWatch}
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


def main(argv: list[str] | None = None) -> None:
    impl, out, w = bench_worker.parse(argv)
    counter = StepCounts(after=w.total_steps, count=w.count_steps) if w.count_steps and impl != "raw" else None
    if impl == "pack":
        without = parse_without(w.without)
        bench_worker.run_pack(w, out, counter, functools.partial(switch_off, names=without),
                              "pack" + (f"-without-{'+'.join(without)}" if without else ""))
    elif impl == "plain":
        bench_worker.run_plain(w, out, counter)
    elif impl == "raw":
        baselines.run_raw(w, out, functools.partial(LoopCount, w.total_steps, w.count_steps) if w.count_steps else None)
    else:
        bench_worker.main(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
