"""How every measured run is timed, the same way in each implementation.

A step ends with a barrier (+ ``cuda.synchronize``); its time is the wall time between consecutive step
ends, with the warm-up steps dropped. Also here: peak memory per rank, the all-reduce cost of the
gradients, the share of a step spent waiting for its batch, and the cost of ``DDPDiagnostics``' hooks.
"""

from __future__ import annotations

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


def step_stats(ends: list[float], warmup_steps: int, global_batch: int) -> dict[str, float]:
    """Step-time statistics from end-of-step timestamps, the first ``warmup_steps`` steps dropped."""
    first = max(warmup_steps - 1, 0)
    times_s = [b - a for a, b in zip(ends[first:], ends[first + 1:], strict=False)]
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


def timed_diagnostics():
    """build_trainer's DDPDiagnostics with a stopwatch around each of its hooks (collective waits included).

    Its cost is a few hooks against seconds-long steps: timing the hooks themselves is exact, where
    comparing two whole runs would drown it in run-to-run noise.
    """
    from ddp_recipes.train.diagnostics import DDPDiagnostics

    class TimedDDPDiagnostics(DDPDiagnostics):
        seconds = 0.0

    for name, hook in vars(DDPDiagnostics).items():
        if name.startswith("on_") and callable(hook):
            def timed(self, *args, _hook=hook, **kwargs):
                start = time.perf_counter()
                try:
                    return _hook(self, *args, **kwargs)
                finally:
                    type(self).seconds += time.perf_counter() - start
            setattr(TimedDDPDiagnostics, name, timed)
    return TimedDDPDiagnostics()
