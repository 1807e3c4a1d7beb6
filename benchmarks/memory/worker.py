"""One variant of the memory bench, measured in this process (``python -m benchmarks.memory --variant X
--json FILE`` runs it): a warm-up step, the memory step, then the timed steps. ``benchmarks.memory``'s
docstring says what "step peak" means on CUDA and on CPU."""

from __future__ import annotations

import contextlib
import gc
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

NUM_CLASSES = 1000
MB = 2**20
# variant -> (grad_checkpointing, channels_last, bf16 autocast)
VARIANTS: dict[str, tuple[bool, bool, bool]] = {
    "baseline": (False, False, False),
    "grad-checkpointing": (True, False, False),
    "channels-last": (False, True, False),
    "bf16-mixed": (False, False, True),
    "grad-checkpointing-bf16": (True, False, True),
}
METHOD = ("step_peak_mb: memory one steady-state training step needs above what is resident before it (the "
          "second step of a fresh process; CPU: VmHWM after a /proc/self/clear_refs peak reset minus RSS before, "
          "workers under a fixed MALLOC_MMAP_THRESHOLD_; CUDA: max_memory_allocated - memory_allocated). "
          "tensor_peak_mb = state_mb (weights, buffers, optimizer state, batch) + step_peak_mb. "
          "process_peak_mb: CPU peak RSS of the process / CUDA max_memory_reserved.")


def _rss_mb() -> float | None:
    """Resident set size now (``/proc/self/statm``), or None off Linux."""
    try:
        resident_pages = int(Path("/proc/self/statm").read_text().split()[1])
    except OSError:
        return None
    return resident_pages * os.sysconf("SC_PAGE_SIZE") / MB


def _hwm_mb() -> float | None:
    """Peak RSS since the last reset (``VmHWM``), or None off Linux."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak RSS of this process to its current RSS (Linux >= 4.0); False if impossible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _maxrss_mb() -> float:
    # Linux reports KiB, macOS bytes.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (MB if sys.platform == "darwin" else 1024)


def _tensor_mb(tensors: list[Any]) -> float:
    return sum(t.numel() * t.element_size() for t in tensors) / MB


def measure_variant(variant: str, s: dict[str, Any]) -> dict[str, Any]:
    """Build the module, run a warm-up step, measure one step's peak, then time ``steps`` more."""
    import torch
    import torch.nn.functional as F

    from ddp_recipes.modules.resnet import ResNetClassifier

    checkpointing, channels_last, bf16 = VARIANTS[variant]
    if s["threads"]:
        torch.set_num_threads(s["threads"])
    device = torch.device(s["accelerator"])
    cuda = device.type == "cuda"
    torch.manual_seed(s["seed"])
    module = ResNetClassifier(arch=s["arch"], num_classes=NUM_CLASSES, cifar_stem=False,
                              grad_checkpointing=checkpointing, channels_last=channels_last).to(device).train()
    hp = module.hparams
    # configure_optimizers' SGD without the scheduler (which needs a trainer).
    optimizer = torch.optim.SGD(module.param_groups(), lr=hp.lr, momentum=hp.momentum, nesterov=hp.nesterov)
    x = torch.randn(s["batch_size"], 3, s["image_size"], s["image_size"], device=device)
    y = torch.randint(0, NUM_CLASSES, (s["batch_size"],), device=device)

    def step() -> float:
        # As Lightning's bf16-mixed plugin: autocast around the forward and the loss, backward outside.
        autocast = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
        with autocast:
            loss = F.cross_entropy(module(x), y, label_smoothing=hp.label_smoothing)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)  # Lightning's default: gradients are re-allocated every step
        if cuda:
            torch.cuda.synchronize(device)
        return float(loss.detach())

    def timed(fn: Callable[[], float]) -> tuple[float, float]:
        start = time.perf_counter()
        loss = fn()
        return (time.perf_counter() - start) * 1e3, loss

    gc.collect()
    linux_reset = not cuda and _reset_peak_rss()
    rss0 = _rss_mb()
    first_ms, loss = timed(step)
    first_peak = (_hwm_mb() if linux_reset else _maxrss_mb()) if not cuda else None

    gc.collect()
    state = [*module.parameters(), *module.buffers(), x, y]
    state += [t for st in optimizer.state.values() for t in st.values() if torch.is_tensor(t)]
    result: dict[str, Any] = {"variant": variant, "grad_checkpointing": checkpointing, "channels_last": channels_last,
                              "precision": "bf16-mixed" if bf16 else "32-true", "device": str(device),
                              "torch_threads": torch.get_num_threads(), "first_step_ms": first_ms,
                              "first_loss": loss, "state_mb": _tensor_mb(state)}
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        step()
        peak = torch.cuda.max_memory_allocated(device)
        result.update(method="cuda-allocator", rss_before_mb=None, retained_mb=None,
                      step_peak_mb=(peak - before) / MB, tensor_peak_mb=peak / MB,
                      process_peak_mb=torch.cuda.max_memory_reserved(device) / MB, first_step_peak_mb=None)
    elif linux_reset and _reset_peak_rss():
        before = _rss_mb()
        step()
        peak, after = _hwm_mb(), _rss_mb()
        result.update(method="rss-hwm-reset", rss_before_mb=before, retained_mb=after - before,
                      step_peak_mb=peak - before, process_peak_mb=peak,
                      first_step_peak_mb=first_peak - rss0 if rss0 is not None else None)
        result["tensor_peak_mb"] = result["state_mb"] + result["step_peak_mb"]
    else:
        # No peak reset: only the first step has a clean high-water mark (one-time allocations included).
        step()
        base = rss0 if rss0 is not None else 0.0
        result.update(method="first-step", rss_before_mb=rss0, retained_mb=None, step_peak_mb=first_peak - base,
                      process_peak_mb=_maxrss_mb(), first_step_peak_mb=first_peak - base)
        result["tensor_peak_mb"] = result["state_mb"] + result["step_peak_mb"]

    times = [timed(step)[0] for _ in range(s["steps"])]
    result.update(step_ms=times, step_ms_median=statistics.median(times),
                  malloc_mmap_threshold=os.environ.get("MALLOC_MMAP_THRESHOLD_"))
    return result
