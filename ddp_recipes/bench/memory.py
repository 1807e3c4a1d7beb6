"""``python -m ddp_recipes.bench.memory``: peak memory and step time of one ResNet training step, per variant.

    python -m ddp_recipes.bench.memory                       # ResNet-50, batch 16, 224 px, every variant
    python -m ddp_recipes.bench.memory --arch resnet18 --batch-size 8 --variants baseline,grad-checkpointing

Variants: ``baseline`` (32-true), ``grad-checkpointing``, ``channels-last``, ``bf16-mixed`` (torch.autocast
with bfloat16) and ``grad-checkpointing-bf16``. Each runs in a fresh process (this module with
``--variant X --json FILE``) so that no other variant's allocations, caches or freed heap pollute its peak.
The step is the module's own training path: ``ResNetClassifier.forward`` (which applies checkpointing and
channels-last), cross-entropy, backward, SGD over ``param_groups()``, ``zero_grad(set_to_none=True)``.

What "step peak" means (the headline number, and the one the reduction is computed on):
the memory the step needs *above* what is resident just before it, i.e. activations, gradients,
autocast weight copies and kernel workspaces; weights, optimizer state and the batch are resident before
and not counted. It is measured on the *second* step, so one-time costs (momentum buffers, oneDNN/cuDNN
set-up) are excluded and every variant starts from the same steady state.

* CUDA: ``max_memory_allocated - memory_allocated`` around the step, after ``reset_peak_memory_stats``.
* CPU (Linux): peak RSS of the step minus RSS before it. ``ru_maxrss`` is a high-water mark that the warm-up
  step has already raised, so the worker resets it (``/proc/self/clear_refs`` = 5, the kernel's peak-RSS
  reset) and reads ``VmHWM``. glibc keeps freed heap memory resident, which would hide a step's
  allocations behind the previous step's leftovers; the workers therefore run with a fixed
  ``MALLOC_MMAP_THRESHOLD_`` (``--mmap-threshold-kb``): every tensor is its own mapping, returned to the
  OS on free, and RSS follows the live tensor bytes. ``retained_mb`` (RSS after minus before the step)
  checks it: near 0 means the measurement is clean. Where the reset is unavailable the worker falls back
  to the first step's ``ru_maxrss`` minus the RSS before it (``method: first-step``), which also counts
  one-time allocations.

Also reported: ``tensor_peak_mb`` (model state + step peak: comparable to CUDA's ``max_memory_allocated``),
``process_peak_mb`` (CPU: peak RSS of the whole process, Python and libraries included; CUDA:
``max_memory_reserved``) and the median step time over ``--steps`` timed steps that follow the memory
step. On a shared CPU the times are noisy; memory is not. Output: a markdown table, ``--out``/memory.json
and a final line ``memory: baseline_mb=... checkpointing_mb=... reduction=..% step_cost=..x``.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddp_recipes.config import ConfigError, build_parser, fail, opt, writable_dir

PROG = "python -m ddp_recipes.bench.memory"
ARCHS = ("resnet18", "resnet34", "resnet50")  # ResNetClassifier's; repeated so the parent skips importing it
NUM_CLASSES = 1000
MIN_IMAGE_SIZE = 32  # ResNetClassifier.min_image_size(cifar_stem=False)
# variant -> (grad_checkpointing, channels_last, bf16 autocast)
VARIANTS: dict[str, tuple[bool, bool, bool]] = {
    "baseline": (False, False, False),
    "grad-checkpointing": (True, False, False),
    "channels-last": (False, True, False),
    "bf16-mixed": (False, False, True),
    "grad-checkpointing-bf16": (True, False, True),
}
TARGET_REDUCTION_PCT = 30.0  # the ResNet issue: --grad-checkpointing lowers the step peak by >= 30%
WORKER_TIMEOUT_S = 3600
MB = 2**20
METHOD = ("step_peak_mb: memory one steady-state training step needs above what is resident before it (the "
          "second step of a fresh process; CPU: VmHWM after a /proc/self/clear_refs peak reset minus RSS before, "
          "workers under a fixed MALLOC_MMAP_THRESHOLD_; CUDA: max_memory_allocated - memory_allocated). "
          "tensor_peak_mb = state_mb (weights, buffers, optimizer state, batch) + step_peak_mb. "
          "process_peak_mb: CPU peak RSS of the process / CUDA max_memory_reserved.")


@dataclass
class MemoryBenchConfig:
    """The benchmark's flags; ``variant`` and ``json`` are the worker mode the runner starts."""

    arch: str = opt("resnet50", "network: resnet18, resnet34 or resnet50 (ImageNet stem, 1000 classes)",
                    choices=ARCHS)
    batch_size: int = opt(16, "images per step")
    image_size: int = opt(224, "image side in pixels (>= 32 for the ImageNet stem)")
    steps: int = opt(3, "timed steps after the memory step; the table shows their median")
    variants: str = opt(",".join(VARIANTS), f"comma list of variants to run, from {', '.join(VARIANTS)}")
    accelerator: str = opt("auto", "cpu, cuda or auto (CUDA when available)", choices=("auto", "cpu", "cuda", "gpu"))
    threads: int = opt(0, "torch CPU threads in every worker (0: torch's default)")
    mmap_threshold_kb: int = opt(64, "glibc MALLOC_MMAP_THRESHOLD_ for CPU workers, so freed tensors leave RSS "
                                     "(0: glibc's default, which keeps freed heap resident and blurs the peak)")
    seed: int = opt(0, "seed of the weights and the synthetic batch")
    out: str = opt("bench-results", "output folder for memory.json (and memory-runs/, one file per variant)")
    variant: str = opt("", "worker mode: measure only this variant in this process and write --json")
    json: str = opt("", "worker mode: the JSON file to write")

    def resolve(self) -> dict[str, Any]:
        """Validated settings; raises ConfigError naming the flag."""
        import torch

        cuda = torch.cuda.is_available()
        accelerator = {"auto": "cuda" if cuda else "cpu", "gpu": "cuda"}.get(self.accelerator, self.accelerator)
        if accelerator == "cuda" and not cuda:
            raise ConfigError(f"--accelerator {self.accelerator} but no CUDA device is visible; use --accelerator cpu")
        if self.arch not in ARCHS:
            raise ConfigError(f"--arch must be one of {', '.join(ARCHS)} (got {self.arch!r})")
        for name in ("batch_size", "steps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(self, name)})")
        if self.image_size < MIN_IMAGE_SIZE:
            raise ConfigError(f"--image-size must be >= {MIN_IMAGE_SIZE} for the ImageNet stem (got {self.image_size})")
        if self.threads < 0:
            raise ConfigError(f"--threads must be >= 0 (got {self.threads})")
        if self.mmap_threshold_kb < 0:
            raise ConfigError(f"--mmap-threshold-kb must be >= 0 (got {self.mmap_threshold_kb})")
        variants = [v.strip() for v in (self.variant or self.variants).split(",") if v.strip()]
        unknown = [v for v in variants if v not in VARIANTS]
        if unknown or not variants:
            which = "--variant" if self.variant else "--variants"
            raise ConfigError(f"{which} must name variants from {', '.join(VARIANTS)} (got {', '.join(unknown) or 'none'})")
        if self.variant and (len(variants) != 1 or not self.json):
            raise ConfigError("--variant takes one variant and needs --json FILE (it is the runner's worker mode)")
        return {"arch": self.arch, "batch_size": self.batch_size, "image_size": self.image_size,
                "steps": self.steps, "accelerator": accelerator, "threads": self.threads,
                "mmap_threshold_kb": self.mmap_threshold_kb, "seed": self.seed, "num_classes": NUM_CLASSES,
                "variants": list(dict.fromkeys(variants))}


# ---- worker: one variant in this process ---------------------------------------------------------------

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


# ---- runner: every variant in a fresh process ----------------------------------------------------------

def run_variant(variant: str, s: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    """One variant in a fresh ``python -m ddp_recipes.bench.memory --variant`` process; its JSON."""
    out = out_dir / "memory-runs" / f"{variant}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "ddp_recipes.bench.memory", "--variant", variant, "--json", str(out)]
    for key in ("arch", "batch_size", "image_size", "steps", "accelerator", "threads", "seed"):
        cmd += ["--" + key.replace("_", "-"), str(s[key])]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    if s["accelerator"] == "cpu" and s["mmap_threshold_kb"]:
        # Setting the threshold also turns off glibc's dynamic threshold, which would otherwise grow to
        # 32 MiB after the first large free and keep everything below it on the (never shrunk) heap.
        env["MALLOC_MMAP_THRESHOLD_"] = str(s["mmap_threshold_kb"] * 1024)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=WORKER_TIMEOUT_S)
    if proc.returncode != 0 or not out.exists():
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        raise RuntimeError(f"variant {variant} failed (exit {proc.returncode}):\n{tail}")
    return json.loads(out.read_text())


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Adds reduction / slowdown vs baseline to each run; the checkpointing-vs-baseline summary."""
    by = {r["variant"]: r for r in runs}
    base = by.get("baseline")
    for r in runs:
        for key, ref in (("reduction_pct", "step_peak_mb"), ("tensor_reduction_pct", "tensor_peak_mb"),
                         ("process_reduction_pct", "process_peak_mb")):
            ok = base and base.get(ref) and r.get(ref) is not None
            r[key] = 100.0 * (1 - r[ref] / base[ref]) if ok else None
        r["slowdown"] = r["step_ms_median"] / base["step_ms_median"] if base else None
    ckpt = by.get("grad-checkpointing")
    summary: dict[str, Any] = {"baseline_mb": base["step_peak_mb"] if base else None,
                               "checkpointing_mb": ckpt["step_peak_mb"] if ckpt else None,
                               "reduction_pct": ckpt["reduction_pct"] if ckpt else None,
                               "step_cost": ckpt["slowdown"] if ckpt else None,
                               "target_reduction_pct": TARGET_REDUCTION_PCT}
    summary["target_met"] = None if summary["reduction_pct"] is None else summary["reduction_pct"] >= TARGET_REDUCTION_PCT
    return summary


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{suffix}"


def markdown_table(results: dict[str, Any]) -> str:
    """The per-variant table, with the setting and what the columns mean."""
    c = results["config"]
    lines = [f"### Memory of one training step: {c['arch']}, batch {c['batch_size']}, {c['image_size']} px, "
             f"{c['accelerator']}", "",
             "| variant | step peak MB | vs baseline | tensor peak MB | vs baseline | process peak MB "
             "| step ms | slowdown |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in results["runs"]:
        lines.append(f"| {r['variant']} | {_fmt(r['step_peak_mb'], '.0f')} | {_fmt(r['reduction_pct'], '+.1f', '%')} "
                     f"| {_fmt(r['tensor_peak_mb'], '.0f')} | {_fmt(r['tensor_reduction_pct'], '+.1f', '%')} "
                     f"| {_fmt(r['process_peak_mb'], '.0f')} | {_fmt(r['step_ms_median'], '.0f')} "
                     f"| {_fmt(r['slowdown'], '.2f', 'x')} |")
    lines += ["", "step peak: memory the step needs above what is resident before it (activations, gradients, "
              "workspaces); tensor peak: + weights, buffers, optimizer state, batch; process peak: "
              + ("max_memory_reserved." if c["accelerator"] == "cuda" else "peak RSS incl. Python and libraries.")
              + " 'vs baseline' is the reduction (positive = less memory).",
              f"step ms: median of {c['steps']} step(s) after the memory step"
              + ("; CPU times on a shared host are noisy, memory is not." if c["accelerator"] == "cpu" else ".")]
    lines += [f"WARNING: {w}" for w in results["warnings"]]
    lines += [f"FAILED: {e.splitlines()[0]}" for e in results["errors"]]
    return "\n".join(lines)


def summary_line(summary: dict[str, Any]) -> str:
    return (f"memory: baseline_mb={_fmt(summary['baseline_mb'], '.0f')} "
            f"checkpointing_mb={_fmt(summary['checkpointing_mb'], '.0f')} "
            f"reduction={_fmt(summary['reduction_pct'], '.1f', '%')} step_cost={_fmt(summary['step_cost'], '.2f', 'x')}")


def run_bench(s: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    """Every variant in its own process; the results dict written to ``memory.json``."""
    from ddp_recipes.bench.hostinfo import host_facts

    results: dict[str, Any] = {"config": dict(s), "host": host_facts(), "method": METHOD, "runs": [],
                               "errors": [], "warnings": []}
    for i, variant in enumerate(s["variants"], 1):
        print(f"[{i}/{len(s['variants'])}] {variant}: 1 warm-up + 1 memory + {s['steps']} timed step(s) ...",
              file=sys.stderr, flush=True)
        start = time.perf_counter()
        try:
            run = run_variant(variant, s, out_dir)
        except (RuntimeError, subprocess.TimeoutExpired) as err:
            results["errors"].append(str(err))
            print(f"        failed: {err}", file=sys.stderr, flush=True)
            continue
        results["runs"].append(run)
        retained = run.get("retained_mb")
        if retained is not None and retained > max(16.0, 0.05 * run["step_peak_mb"]):
            results["warnings"].append(f"variant {variant}: RSS stayed {retained:.0f} MB above its pre-step level: "
                                     "freed memory was kept resident, so its step peak may be too low")
        print(f"        step peak {run['step_peak_mb']:.0f} MB, median step {run['step_ms_median']:.0f} ms "
              f"({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)
    results["summary"] = summarize(results["runs"])
    (out_dir / "memory.json").write_text(json.dumps(results, indent=2) + "\n")
    return results


def main(argv: list[str] | None = None) -> int:
    parser = build_parser(MemoryBenchConfig, prog=PROG, description=__doc__)  # type: ignore[arg-type]
    cfg = MemoryBenchConfig(**vars(parser.parse_args(argv)))
    try:
        settings = cfg.resolve()
        if not cfg.variant:
            out_dir = writable_dir(cfg.out, "--out")
    except ConfigError as err:
        fail(str(err), PROG)
    if cfg.variant:
        result = {"config": settings, **measure_variant(settings["variants"][0], settings)}
        Path(cfg.json).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.json).write_text(json.dumps(result, indent=2) + "\n")
        return 0
    results = run_bench(settings, out_dir)
    print(markdown_table(results))
    print(f"wrote {out_dir / 'memory.json'}")
    print(summary_line(results["summary"]))
    return 0 if not results["errors"] and results["runs"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
