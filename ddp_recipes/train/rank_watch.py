"""RankWatch: where each rank is while the run is alive, for the hang report and the straggler check.

Per step it takes two clock marks and one monotonic time (no device read, no collective). The hang report
(:mod:`ddp_recipes.ddp.hangs`) runs in a thread. Every log window (``log_every_n_steps`` optimizer steps) each rank
posts its window's input wait and its time to reach the gradient all-reduce (batch start to backward) to the
rendezvous store; rank 0 reads the window before (posted by then) and names a rank that reached the all-reduce
later than the others' median by a share of the step in :data:`STRAGGLER_WINDOWS` windows in a row, as input-bound
(its input wait is what differs) or compute-bound (its forward is), through :class:`DDPDiagnostics` (the epoch-end
input-bound check's code, so the two say one thing). In synchronous DDP every rank's step takes the same wall
time: what differs is where each rank spends it.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from ddp_recipes.ddp import hangs
from ddp_recipes.ddp.hangs import AUTO_FLOOR_S, AUTO_STEPS, HangWatch
from ddp_recipes.train.diagnostics import DDPDiagnostics
from ddp_recipes.train.perf import StepClock, input_wait

STRAGGLER_WINDOWS = 3  # log windows in a row the same rank must be the late one: one noisy window is not a straggler
STRAGGLER_SHARE = 0.25  # late by this share of a step over the others' median ...
STRAGGLER_MIN_S = 0.005  # ... and by this many seconds per step (a scheduler hiccup on a millisecond step is not)
DEFAULT_WINDOW = 50  # steps per window when the Trainer logs only per epoch


class RankWatch(Callback):
    """See the module docstring. ``hang_report_s``: the bound (None: automatic, 0: no hang report);
    ``timeout_s``: the collective timeout the automatic bound stays under; ``flag``: the setting's name in messages."""

    def __init__(self, hang_report_s: float | None = None, timeout_s: float | None = None,
                 flag: str = "--hang-report-s") -> None:
        self.hang_report_s, self.flag = hang_report_s, flag
        self.timeout_s = timeout_s or torch.distributed.default_pg_timeout.total_seconds()
        self.watch: HangWatch | None = None
        self.figures: dict[str, Any] = {}  # rank 0: summary.json's "ranks" block
        self._slowest = 0.0  # the longest interval between two finished batches so far

    def bound(self) -> float:
        """Seconds without a finished batch that make a stall: the flag, else derived from the steps seen so far
        (at least :data:`AUTO_FLOOR_S`), always under half the collective timeout."""
        if self.hang_report_s:
            return self.hang_report_s
        seen = max(AUTO_FLOOR_S, AUTO_STEPS * self._slowest) if self._slowest else self.timeout_s
        return min(seen, self.timeout_s / 2)

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.clock = StepClock(trainer.strategy.root_device)
        # The strategy's own timeout when it has one: build_trainer's strategy_kwargs or a strategy object set it too.
        self.timeout_s = getattr(trainer.strategy, "collective_timeout_s", None) or self.timeout_s
        self._store = None
        if trainer.world_size > 1 and torch.distributed.is_initialized():
            from torch.distributed.distributed_c10d import _get_default_store

            restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # a restarted group may share the store
            self._store = torch.distributed.PrefixStore(f"ddp_recipes/ranks/{restart}/", _get_default_store())
        self._diagnostics = next((c for c in trainer.callbacks if isinstance(c, DDPDiagnostics)), None)
        # Marks only where a window exchange reads them: unread, they would pile up (two CUDA events a step).
        self._exchanging = self._store is not None and self._diagnostics is not None
        self._every = trainer.log_every_n_steps * trainer.accumulate_grad_batches or DEFAULT_WINDOW
        self._window, self._marks, self._wait, self._batches = 0, [], 0.0, 0
        self._window_start, self._start = time.monotonic(), None
        self._streak: tuple[int, str, int] = (-1, "", 0)
        self._totals = [[0.0, 0.0, 0] for _ in range(trainer.world_size)]
        self.figures = {}  # this fit's: summary.json must not show an earlier fit's straggler
        self._stop_watch()  # a fit of this Trainer before, ended in a way no hook saw
        hangs.last_report.clear()  # an earlier fit's report (another folder, maybe) is not this fit's
        if self.hang_report_s != 0:
            self.watch = HangWatch(rank=trainer.global_rank, world_size=trainer.world_size, store=self._store,
                                   out_dir=str(trainer.default_root_dir), bound=self.bound,
                                   step=lambda: trainer.global_step, flag=self.flag)
            self.watch.start()

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._stop_watch()

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._stop_watch()  # Lightning calls no teardown when a fit raises: the failed run must not be reported as hung

    def _stop_watch(self) -> None:
        if self.watch is not None:
            self.watch.stop()
            self.watch = None

    def _progress(self) -> None:
        if self.watch is not None:
            now = time.monotonic()
            self._slowest = max(self._slowest, now - self.watch.progress)
            self.watch.progress = now

    @override
    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.watch is not None:
            self.watch.progress = time.monotonic()  # epoch boundaries and validation are not stalls
        self._start = None

    on_validation_start = on_validation_end = on_train_epoch_start  # type: ignore[assignment]

    @override
    def on_validation_batch_end(self, *args: Any, **kwargs: Any) -> None:
        self._progress()

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self._exchanging:
            self._start = self.clock.mark()

    @override
    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        if self._start is not None:
            self._marks.append((self._start, self.clock.mark()))

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._progress()
        self._wait += input_wait(trainer) or 0.0
        self._batches += 1
        if self._exchanging and self._batches % self._every == 0:
            self._exchange(trainer)

    def _exchange(self, trainer: L.Trainer) -> None:
        """Post this window's figures; on rank 0, judge the window before (every rank has posted it by now: the
        step between was an all-reduce)."""
        reach, pending = 0.0, []
        for start, end in self._marks:
            seconds = self.clock.seconds(start, end)
            if seconds is None:  # CUDA: the device has not reached it; it counts in the next window
                pending.append((start, end))
            else:
                reach += seconds
        row = [self._window, self._wait, reach, self._every - len(pending)]
        self._marks, self._wait = pending, 0.0
        self._store.set(f"w{self._window % 2}/{trainer.global_rank}", json.dumps(row))
        self._window += 1
        now, wall = time.monotonic(), time.monotonic() - self._window_start
        self._window_start = now
        if trainer.global_rank == 0 and self._window > 1:
            keys = [f"w{self._window % 2}/{r}" for r in range(trainer.world_size)]
            if self._store.check(keys):
                rows = [json.loads(v) for v in self._store.multi_get(keys)]
                if all(r[0] == self._window - 2 and r[3] > 0 for r in rows):
                    self._judge(trainer, rows, wall / self._every)

    def _judge(self, trainer: L.Trainer, rows: list[list[float]], step_s: float) -> None:
        wait = [r[1] / r[3] for r in rows]
        forward = [r[2] / r[3] for r in rows]
        for total, r in zip(self._totals, rows, strict=True):
            total[0], total[1], total[2] = total[0] + r[1], total[1] + r[2], total[2] + r[3]
        arrive = [w + f for w, f in zip(wait, forward, strict=True)]
        late = max(range(len(rows)), key=arrive.__getitem__)

        def others(values: list[float]) -> float:
            return statistics.median(v for i, v in enumerate(values) if i != late)

        behind = arrive[late] - others(arrive)
        cause = "input-bound" if wait[late] - others(wait) >= forward[late] - others(forward) else "compute-bound"
        self._record(trainer, wait, forward, late, behind)
        if behind < max(STRAGGLER_SHARE * step_s, STRAGGLER_MIN_S):
            self._streak = (-1, "", 0)
            return
        rank, kind, count = self._streak
        self._streak = (late, cause, count + 1 if (rank, kind) == (late, cause) else 1)
        if self._streak[2] == STRAGGLER_WINDOWS:
            self._report(trainer, late, cause, wait, forward, behind, step_s)

    def _record(self, trainer: L.Trainer, wait: list[float], forward: list[float], late: int, behind: float) -> None:
        """The per-rank figures to the loggers (rank 0) and to summary.json's ``ranks`` block (whole fit)."""
        metrics = {"ranks/late_rank": float(late), "ranks/late_ms": 1000 * behind}
        for r, (w, f) in enumerate(zip(wait, forward, strict=True)):
            metrics |= {f"ranks/rank{r}/input_wait_ms": 1000 * w, f"ranks/rank{r}/forward_ms": 1000 * f}
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
        per_step = [(t[0] + t[1]) / t[2] for t in self._totals if t[2]]
        if len(per_step) == len(self._totals):
            slow, fast = max(range(len(per_step)), key=per_step.__getitem__), min(range(len(per_step)),
                                                                                   key=per_step.__getitem__)
            self.figures |= {"slowest_rank": slow, "fastest_rank": fast,
                             "ratio": round(per_step[slow] / per_step[fast], 3) if per_step[fast] else None,
                             "input_wait_ms": [round(1000 * t[0] / t[2], 3) for t in self._totals],
                             "forward_ms": [round(1000 * t[1] / t[2], 3) for t in self._totals]}

    def _report(self, trainer: L.Trainer, late: int, cause: str, wait: list[float], forward: list[float],
                behind: float, step_s: float) -> None:
        what, values = ("input wait", wait) if cause == "input-bound" else ("forward (batch start to backward)",
                                                                           forward)
        mine, theirs = values[late], statistics.median(v for i, v in enumerate(values) if i != late)
        self.figures["straggler"] = {"rank": late, "cause": cause, "step": trainer.global_step}
        assert self._diagnostics is not None
        self._diagnostics.report(cause, (
            f"rank {late} is a straggler: it reached the gradient all-reduce {1000 * behind:.1f} ms per step "
            f"({behind / step_s:.0%} of a {1000 * step_s:.1f} ms step) after the others in {STRAGGLER_WINDOWS} log "
            f"windows in a row (up to step {trainer.global_step}), and its {what} is what differs "
            f"({1000 * mine:.1f} ms vs {1000 * theirs:.1f} ms per step): the other ranks wait for it in the "
            "all-reduce."))
