"""How every measured run is timed, the same way in each implementation.

A step ends with a barrier (+ ``cuda.synchronize``); its time is the wall time between consecutive step
ends, with the warm-up steps dropped. Also here: peak memory per rank, the all-reduce cost of the
gradients, the share of a step spent waiting for its batch, the host time inside each callback's hooks
(:class:`HookClock`) and each thread's CPU time (:func:`thread_cpu`).
"""

from __future__ import annotations

import os
import resource
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory of this rank: CUDA allocator peak on GPU, peak RSS of the process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def sync_point(device: torch.device) -> float:
    """End-of-step synchronisation shared by every implementation; returns the timestamp."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    return time.perf_counter()


def step_stats(ends: list[float], warmup_steps: int, global_batch: int,
               across: frozenset[int] | set[int] = frozenset()) -> dict[str, float]:
    """Step-time statistics from end-of-step timestamps, the first ``warmup_steps`` steps dropped, and the
    intervals ending at the indices in ``across`` (they span an epoch boundary: see :class:`StepEnds`)."""
    first = max(warmup_steps - 1, 0)
    times_s = [ends[k] - ends[k - 1] for k in range(first + 1, len(ends)) if k not in across]
    ms = sorted(t * 1000 for t in times_s)
    # inclusive: deciles inside the measured range (the default extrapolates below the fastest step)
    q = statistics.quantiles(ms, n=10, method="inclusive") if len(ms) >= 2 else [ms[0]] * 9
    total = sum(times_s)
    return {"step_ms_median": statistics.median(ms), "step_ms_p10": q[0], "step_ms_p90": q[-1],
            "global_samples_per_s": global_batch * len(times_s) / total if total else 0.0,
            "measured_steps": len(times_s)}


def gather(value: Any) -> list[Any]:
    """``value`` from every rank (just this one without a process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def measure_allreduce(numel: int, device: torch.device, iters: int) -> dict[str, float]:
    """Median ms of an all-reduce of the model's gradient size, fp32 and bf16 (the bf16 hook's payload)."""
    result = {}
    for name, dtype in (("fp32_ms", torch.float32), ("bf16_ms", torch.bfloat16)):
        buf = torch.ones(numel, dtype=dtype, device=device)
        times = []
        for i in range(iters + 2):
            start = sync_point(device)
            dist.all_reduce(buf)
            end = sync_point(device)
            if i >= 2:
                times.append((end - start) * 1000)
        result[name] = statistics.median(times)
    return result


def wait_fraction(ends: list[float], waits: list[float], warmup_steps: int) -> float | None:
    """Share of the timed steps' wall time the loop waited for its batch (the steps step_stats times)."""
    first = max(warmup_steps - 1, 0)
    span = ends[-1] - ends[first] if len(ends) > first + 1 else 0.0
    return sum(waits[first + 1:]) / span if span > 0 else None


def thread_cpu() -> dict[int, tuple[str, float]]:
    """{thread id: (name, CPU seconds so far)} of every thread of this process (Linux ``/proc``; {} elsewhere).

    On a host with as many cores as ranks, a thread that burns CPU steals it from a rank's compute: this is how
    the bench sees gloo's worker threads, a progress bar or a loader thread in the step time.
    """
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    out = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return {}
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # ended meanwhile
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        out[int(tid)] = (name, (int(fields[11]) + int(fields[12])) / tick)  # utime + stime
    return out


def thread_cpu_delta(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]],
                     steps: int) -> dict[str, Any]:
    """CPU ms per step of the main thread and of all other threads between two :func:`thread_cpu` snapshots,
    with the threads alive at the end and the busiest other threads by name."""
    main = os.getpid()
    used = {tid: (name, cpu - before.get(tid, (name, 0.0))[1]) for tid, (name, cpu) in after.items()}
    others = {tid: v for tid, v in used.items() if tid != main}
    by_name: dict[str, float] = {}
    for name, cpu in others.values():
        by_name[name] = by_name.get(name, 0.0) + cpu
    per_step = 1000.0 / max(steps, 1)
    return {"threads": len(after), "main_cpu_ms_per_step": round(used.get(main, ("", 0.0))[1] * per_step, 2),
            "other_threads_cpu_ms_per_step": round(sum(cpu for _, cpu in others.values()) * per_step, 2),
            "other_threads_by_name": {k: round(v * per_step, 2)
                                      for k, v in sorted(by_name.items(), key=lambda kv: -kv[1]) if v > 0}}


class StepEnds:
    """End-of-step timestamps through :func:`sync_point`, and this process's per-thread CPU over the timed
    steps (:func:`thread_cpu_delta`): the same measurement for every implementation."""

    def __init__(self, device: torch.device, warmup_steps: int, total_steps: int,
                 hooks: HookClock | None = None) -> None:
        self.device, self.warmup_steps, self.total_steps = device, warmup_steps, total_steps
        self.hooks = hooks
        self.start = sync_point(device)
        self.ends: list[float] = []
        # Intervals that span an epoch boundary (validation, checkpoints, the loaders' restart), by the index of
        # their end: left out of the step time, which is what each training step costs.
        self.across: set[int] = set()
        self._cpu_before: dict[int, tuple[str, float]] | None = None
        self.threads: dict[str, Any] | None = None

    @property
    def timed_steps(self) -> int:
        return self.total_steps - max(self.warmup_steps, 1)

    def epoch_start(self) -> None:
        """A new epoch starts: the interval from the last step end to the next one is not a training step."""
        if self.ends:
            self.across.add(len(self.ends))

    def step_end(self) -> None:
        if len(self.ends) >= self.total_steps:  # steps after the timed ones (the bench's counted iterations)
            return
        self.ends.append(sync_point(self.device))
        if len(self.ends) == max(self.warmup_steps, 1):  # the first timed interval starts here (step_stats)
            self._cpu_before = thread_cpu()
            if self.hooks is not None:
                self.hooks.active = True
        elif len(self.ends) == self.total_steps and self._cpu_before is not None:
            self.threads = thread_cpu_delta(self._cpu_before, thread_cpu(), self.timed_steps)
            if self.hooks is not None:
                self.hooks.active = False


class HookClock:
    """Host seconds inside each callback's hooks, per callback class, over the timed steps only.

    A callback costs a few hooks against steps of milliseconds to seconds: timing the hooks themselves is
    exact (collective waits inside them included), where comparing whole runs drowns them in run-to-run
    noise. Each hook is wrapped on the instance (Lightning looks hooks up on it), so the classes are
    untouched. ``active`` is set by the step timer while the timed steps run.
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.active = False

    def attach(self, callbacks: list[Any], skip: tuple[type, ...] = ()) -> None:
        for callback in callbacks:
            if isinstance(callback, skip):
                continue
            name = type(callback).__name__
            self.seconds.setdefault(name, 0.0)
            for hook in [h for h in dir(type(callback)) if h.startswith("on_") or h in ("setup", "teardown")]:
                method = getattr(callback, hook, None)
                if callable(method):
                    setattr(callback, hook, self._timed(name, method))

    def _timed(self, name: str, method: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.active:
                return method(*args, **kwargs)
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start
        return timed

    def ms_per_step(self, steps: int) -> dict[str, float]:
        return {name: round(1000 * s / max(steps, 1), 4) for name, s in sorted(self.seconds.items())}
