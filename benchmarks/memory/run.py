"""``python -m benchmarks.memory``: peak memory and step time of one ResNet training step, per variant.

    python -m benchmarks.memory                       # ResNet-50, batch 16, 224 px, every variant
    python -m benchmarks.memory --arch resnet18 --batch-size 8 --variants baseline,grad-checkpointing

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

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.memory.report import markdown_table, summarize, summary_line
from benchmarks.memory.worker import METHOD, NUM_CLASSES, VARIANTS, measure_variant
from ddp_recipes.bench.cli import config_from, config_parser
from ddp_recipes.config.choices import ACCELERATORS, check_choice
from ddp_recipes.config.cli import fail, opt, writable_dir
from ddp_recipes.config.world import resolve_accelerator
from ddp_recipes.errors import ConfigError

PROG = "python -m benchmarks.memory"
ARCHS = ("resnet18", "resnet34", "resnet50")  # ResNetClassifier's; repeated so the parent skips importing it
MIN_IMAGE_SIZE = 32  # ResNetClassifier.min_image_size(cifar_stem=False)
WORKER_TIMEOUT_S = 3600


@dataclass
class MemoryBenchConfig:
    """The benchmark's flags; ``variant`` and ``json`` are the worker mode the runner starts."""

    arch: str = opt("resnet50", "network: resnet18, resnet34 or resnet50 (ImageNet stem, 1000 classes)",
                    choices=ARCHS)
    batch_size: int = opt(16, "images per step")
    image_size: int = opt(224, "image side in pixels (>= 32 for the ImageNet stem)")
    steps: int = opt(3, "timed steps after the memory step; the table shows their median")
    variants: str = opt(",".join(VARIANTS), f"comma list of variants to run, from {', '.join(VARIANTS)}")
    accelerator: str = opt("auto", "cpu, cuda or auto (CUDA when available)", choices=ACCELERATORS)
    threads: int = opt(0, "torch CPU threads in every worker (0: torch's default)")
    mmap_threshold_kb: int = opt(64, "glibc MALLOC_MMAP_THRESHOLD_ for CPU workers, so freed tensors leave RSS "
                                     "(0: glibc's default, which keeps freed heap resident and blurs the peak)")
    seed: int = opt(0, "seed of the weights and the synthetic batch")
    out: str = opt("bench-results", "output folder for memory.json (and memory-runs/, one file per variant)")
    variant: str = opt("", "worker mode: measure only this variant in this process and write --json")
    json: str = opt("", "worker mode: the JSON file to write")

    def resolve(self) -> dict[str, Any]:
        """Validated settings; raises ConfigError naming the parameter."""
        accelerator = resolve_accelerator(self.accelerator)
        check_choice("arch", self.arch, ARCHS)
        for name in ("batch_size", "steps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{{{name}}} must be >= 1 (got {getattr(self, name)})")
        if self.image_size < MIN_IMAGE_SIZE:
            raise ConfigError(f"{{image_size}} must be >= {MIN_IMAGE_SIZE} for the ImageNet stem "
                              f"(got {self.image_size})")
        if self.threads < 0:
            raise ConfigError(f"{{threads}} must be >= 0 (got {self.threads})")
        if self.mmap_threshold_kb < 0:
            raise ConfigError(f"{{mmap_threshold_kb}} must be >= 0 (got {self.mmap_threshold_kb})")
        variants = [v.strip() for v in (self.variant or self.variants).split(",") if v.strip()]
        unknown = [v for v in variants if v not in VARIANTS]
        if unknown or not variants:
            which = "{variant}" if self.variant else "{variants}"
            raise ConfigError(f"{which} must name variants from {', '.join(VARIANTS)} "
                              f"(got {', '.join(unknown) or 'none'})")
        if self.variant and (len(variants) != 1 or not self.json):
            raise ConfigError("{variant} takes one variant and needs {json} FILE (it is the runner's worker mode)")
        return {"arch": self.arch, "batch_size": self.batch_size, "image_size": self.image_size,
                "steps": self.steps, "accelerator": accelerator, "threads": self.threads,
                "mmap_threshold_kb": self.mmap_threshold_kb, "seed": self.seed, "num_classes": NUM_CLASSES,
                "variants": list(dict.fromkeys(variants))}


# ---- runner: every variant in a fresh process ----------------------------------------------------------

def run_variant(variant: str, s: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    """One variant in a fresh ``python -m benchmarks.memory --variant`` process; its JSON."""
    out = out_dir / "memory-runs" / f"{variant}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "benchmarks.memory", "--variant", variant, "--json", str(out)]
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
    cfg = config_from(MemoryBenchConfig, config_parser(MemoryBenchConfig, PROG, __doc__).parse_args(argv))
    try:
        settings = cfg.resolve()
        if not cfg.variant:
            out_dir = writable_dir(cfg.out, "{out}")
    except ConfigError as err:
        fail(err.cli(), PROG)
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
