"""Facts about the host a benchmark ran on, and how many workers it really runs in parallel.

A CPU "speedup" from N processes means nothing unless the host has N free cores: ``os.cpu_count()``
counts vCPUs (hyper-threads, or a share of a machine other jobs also use). :func:`parallel_ceiling`
measures it instead: the same single-thread matmul loop, first alone, then in N processes at once. Each
worker's rate relative to the lone one says how much of a core it got; their sum is the most throughput
N processes can reach on this host (the ceiling a measured CPU speedup must be read against).

The workers are small numpy scripts (one BLAS thread each; see ``ceiling_worker.py``), not torch
processes: a worker that imports torch, or this package, spends seconds on it on a loaded box, longer
than the measurement itself. A 256x256 float32 GEMM is the kind of work a CPU training step does, so
the share of a core it gets is the share a rank gets.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import platform
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

DEFAULT_SECONDS = 0.5
DEFAULT_MATMUL_SIZE = 256
_THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
_WORKER = Path(__file__).with_name("ceiling_worker.py")


@contextlib.contextmanager
def _workers(n: int, size: int, seconds: float) -> Iterator[list[subprocess.Popen[str]]]:
    """``n`` worker scripts with one BLAS/OpenMP thread each, past their warm-up; always cleaned up."""
    # One thread each: the question is how many cores N processes get, not how well one spreads.
    env = {**os.environ, **dict.fromkeys(_THREAD_VARS, "1")}
    procs = [subprocess.Popen([sys.executable, str(_WORKER), str(size), str(seconds)], env=env, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE) for _ in range(n)]
    try:
        for p in procs:
            _read(p, "ready")
        yield procs
    finally:
        for p in procs:
            with contextlib.suppress(OSError):
                p.stdin.close()  # type: ignore[union-attr]  # EOF: the worker's loop ends
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _read(proc: subprocess.Popen[str], what: str) -> str:
    line = proc.stdout.readline().strip()  # type: ignore[union-attr]
    if not line:
        raise RuntimeError(f"parallel_ceiling worker exited (code {proc.poll()}) before sending {what!r}")
    return line


def _run(procs: list[subprocess.Popen[str]]) -> list[float]:
    """Start the loop in all ``procs`` at (nearly) the same instant; their rates."""
    for p in procs:
        p.stdin.write("run\n")  # type: ignore[union-attr]
        p.stdin.flush()  # type: ignore[union-attr]
    return [float(_read(p, "a rate")) for p in procs]


def usable_cpus() -> int:
    """CPUs this process may run on (affinity), which can be fewer than ``os.cpu_count()``."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS / Windows
        return os.cpu_count() or 1


def parallel_ceiling(n: int, seconds: float = DEFAULT_SECONDS, size: int = DEFAULT_MATMUL_SIZE) -> dict[str, Any]:
    """Run a single-thread matmul loop alone, then in ``n`` concurrent processes; the aggregate ceiling.

    ``relative`` is each concurrent worker's rate over the lone rate; ``ceiling`` is their sum: the
    speedup N perfectly parallel workers could show on this host (n on an idle n-core machine; ~0.9 for
    two workers on a busy 2-vCPU box). Takes ~2 x ``seconds`` plus process start-up.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1 (got {n})")
    if not seconds > 0:
        raise ValueError(f"seconds must be > 0 (got {seconds})")
    started = time.perf_counter()
    with _workers(n, size, seconds) as procs:
        alone = _run(procs[:1])[0]  # the others idle, blocked on their stdin
        rates = _run(procs)
    relative = [r / alone for r in rates]
    return {
        "workers": n, "seconds": seconds, "matmul_size": size, "threads_per_worker": 1,
        "alone_rate": alone, "worker_rates": rates, "relative": relative,
        "relative_mean": sum(relative) / n, "ceiling": sum(relative),
        "cpu_count": os.cpu_count(), "usable_cpus": usable_cpus(),
        "wall_s": time.perf_counter() - started,
    }


def ceiling_range(ceiling: dict[str, Any]) -> tuple[float, float]:
    """The lowest and highest of the ceiling's probes (``probes``: the re-probes, when taken)."""
    probes = ceiling.get("probes") or [ceiling["ceiling"]]
    return min(probes), max(probes)


def ceiling_words(ceiling: dict[str, Any], measured: float | None = None) -> str:
    """The probed ceiling in words (a range when re-probed). The probe shares the host with other work: a measured
    speedup above it means that load disturbed the probe, never that the speedup is impossible."""
    # Compared as printed: "reach 1.54x, below the measured 1.54x" (1.5401 against 1.5449) would contradict itself.
    low, high = (round(x, 2) for x in ceiling_range(ceiling))
    words = f"{ceiling['workers']} single-thread workers reach {low:.2f}x" + (f"-{high:.2f}x" if high > low else "")
    if measured is not None and round(measured, 2) > high:
        return f"{words} one alone's rate, below the measured {measured:.2f}x: other load disturbed the probe"
    return f"{words} one alone's rate: a CPU speedup near that is the host's limit, not DDP's"


def parallel_warning(devices: int, ceiling: dict[str, Any] | None, threshold: float = 0.8,
                     measured: float | None = None) -> str | None:
    """A warning when the host could not run ``devices`` single-thread workers at ``threshold`` of full speed: the
    probed ``ceiling`` (:func:`ceiling_words`, beside the ``measured`` speedup) when it had ``devices`` workers, else
    the usable CPU count."""
    if devices <= 1:
        return None
    if ceiling and ceiling.get("workers") == devices:
        if ceiling_range(ceiling)[1] >= threshold * devices:
            return None
        return f"host parallel ceiling: {ceiling_words(ceiling, measured)} ({ceiling['usable_cpus']} usable CPUs)"
    cpus = usable_cpus()
    if devices <= cpus:
        return None
    return (f"{devices} workers on {cpus} usable CPUs: they time-share, so a CPU speedup near {cpus}x is the "
            f"host's limit, not DDP's")


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _parallel_info() -> dict[str, str]:
    """``torch.__config__.parallel_info()`` ("key : value" lines) as a dict."""
    import torch

    info: dict[str, str] = {}
    for line in torch.__config__.parallel_info().splitlines():
        key, sep, value = line.rpartition(":")  # "at::get_num_threads() : 2"
        if sep and value.strip():
            info[key.strip()] = value.strip()
    return info


def host_facts() -> dict[str, Any]:
    """CPU, thread and accelerator facts for the report (imports torch; no CUDA work beyond queries)."""
    import torch

    cuda = torch.cuda.is_available()
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "usable_cpus": usable_cpus(),
        "torch": torch.__version__,
        "lightning": _version("lightning"),
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "omp_num_threads_env": os.environ.get("OMP_NUM_THREADS"),
        "parallel_info": _parallel_info(),
        "cuda_available": cuda,
        "cuda_devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else [],
        "cuda_version": torch.version.cuda,
    }
