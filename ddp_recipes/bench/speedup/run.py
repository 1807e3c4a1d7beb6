"""``python -m ddp_recipes.bench`` without a command: single- vs multi-device speedup, the pack beside a raw DDP loop.

    python -m ddp_recipes.bench                                   # defaults fitted to the host (see docs/benchmark.md)
    python -m ddp_recipes.bench --devices 1,2,4 --recipe resnet --arch resnet50 --image-size 224

Every measured run is a fresh set of processes (``ddp_recipes.bench.harness.worker``). Output in ``--out``:
results.json, report.md (also printed), speedup.png (with the ``plot`` extra), and a final one-line summary.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddp_recipes.bench.cli import config_from
from ddp_recipes.bench.commodel import LINKS, predict_table, validate_against_pytorch_benchmark
from ddp_recipes.bench.hostinfo import host_facts, parallel_ceiling, parallel_warning, usable_cpus
from ddp_recipes.bench.speedup.report import PLOT_NEEDS, best_speedups, markdown_report, summary_line, write_report
from ddp_recipes.config.choices import ACCELERATORS, MNIST_ARCHS, PRECISION_SPELLINGS, check_choice
from ddp_recipes.config.choices import PRECISIONS as RUN_PRECISIONS
from ddp_recipes.config.cli import fail, opt, writable_dir
from ddp_recipes.config.world import cuda_devices, resolve_accelerator
from ddp_recipes.errors import ConfigError, lit

PROG = "python -m ddp_recipes.bench"
# auto: fitted to the host in BenchConfig.resolve; Lightning's short spellings of these (16, bf16, 32) as the recipes
PRECISIONS = ("auto", *RUN_PRECISIONS, *(s for s, name in PRECISION_SPELLINGS.items() if name in RUN_PRECISIONS))
RECIPES = ("resnet", "mnist")
RESNET_ARCHS = ("resnet18", "resnet34", "resnet50")
RUN_TIMEOUT_S = 600


@dataclass
class BenchConfig:
    """The benchmark's flags; ``auto`` values are fitted to the host in :meth:`resolve`."""

    recipe: str = opt("resnet", "workload: resnet (torchvision ResNet) or mnist (the write-up's MLP)",
                      choices=RECIPES)
    arch: str = opt("auto", "network: resnet18/34/50 for resnet, mlp/cnn for mnist (auto: resnet50 on CUDA, "
                            "resnet18 on CPU, mlp for mnist)")
    devices: str = opt("auto", "comma list of device counts, e.g. 1,2,4 (auto: 1,2,4 capped at the GPUs; 1,2 on CPU)")
    steps: int = opt(0, "measured steps per run, after warm-up (0: 50 on CUDA, 20 on CPU)")
    warmup_steps: int = opt(3, "steps run before timing starts (allocator, bucket rebuild, first all-reduce)")
    batch_size: int = opt(0, "per-device batch, fixed across device counts (weak scaling); 0: 32 on CPU, 64 on CUDA")
    precision: str = opt("auto", "32-true, bf16-mixed or 16-mixed (auto: bf16-mixed on CUDA, 32-true on CPU)",
                         choices=PRECISIONS)
    image_size: int = opt(0, "image side in pixels for resnet (0: 224 on CUDA, 32 on CPU)")
    accelerator: str = opt("auto", "cpu, cuda or auto", choices=ACCELERATORS)
    threads_per_rank: int = opt(0, "CPU threads per rank for every run, 1-device included (0: usable cores / "
                                   "largest device count)")
    raw: bool = opt(True, "also measure the plain PyTorch DDP loop (the overhead baseline)")
    plain: bool = opt(True, "also measure plain Lightning, L.Trainer(strategy=\"ddp\"), on the same module and data")
    compile: bool = opt(False, "also measure torch.compile'd pack and raw runs (compile time reported apart: the "
                               "first step; on CPU inductor compiles for ~a minute per run)")
    dp: bool = opt(False, "also measure torch.nn.DataParallel (needs 2+ CUDA GPUs; skipped otherwise)")
    data_dir: str = opt("", "mnist only: real MNIST (torchvision layout) instead of synthetic tensors")
    writeup: bool = opt(False, "mnist only: also measure the write-up's original script (needs --data-dir)")
    repeats: int = opt(3, "rounds of the whole plan; each round runs the impls interleaved at each N (the order "
                          "alternates), and the report takes medians and the spread of the per-round pack/raw ratio")
    seed: int = opt(0, "seed of the synthetic data and the model")
    out: str = opt("bench-results", "output folder for results.json, report.md and speedup.png")

    def resolve(self) -> dict[str, Any]:
        """Validated, host-fitted settings; raises ConfigError naming the parameter."""
        check_choice("recipe", self.recipe, RECIPES)
        check_choice("precision", self.precision, PRECISIONS)
        accelerator = resolve_accelerator(self.accelerator)
        gpus = cuda_devices() if accelerator == "cuda" else 0
        if self.devices == "auto":
            devices = [n for n in (1, 2, 4) if n <= gpus] if accelerator == "cuda" else [1, 2]
        else:
            try:
                devices = sorted({int(part) for part in self.devices.split(",") if part.strip()})
            except ValueError:
                raise ConfigError(f"{{devices}} must be a comma list of integers such as 1,2,4 "
                                  f"(got {lit(repr(self.devices))})") from None
        if not devices or devices[0] < 1:
            raise ConfigError(f"{{devices}} needs counts >= 1 (got {lit(repr(self.devices))})")
        if accelerator == "cuda" and devices[-1] > gpus:
            raise ConfigError(f"{{devices}} {self.devices} but only {gpus} CUDA device(s) are visible; "
                              "lower {devices}")
        if 1 not in devices:
            raise ConfigError("{devices} must include 1: speedup is measured against the 1-device run")
        if self.repeats < 1:
            raise ConfigError(f"{{repeats}} must be >= 1 (got {self.repeats})")
        if self.warmup_steps < 1:
            raise ConfigError(f"{{warmup_steps}} must be >= 1 (got {self.warmup_steps})")
        steps = self.steps or (50 if accelerator == "cuda" else 20)
        if steps < 2:
            raise ConfigError(f"{{steps}} must be >= 2 to have a spread (got {self.steps})")
        arch = self.arch if self.arch != "auto" else (
            "mlp" if self.recipe == "mnist" else "resnet50" if accelerator == "cuda" else "resnet18")
        valid = MNIST_ARCHS if self.recipe == "mnist" else RESNET_ARCHS
        if arch not in valid:
            raise ConfigError(f"{{arch}} {arch!r} does not fit {{recipe}} {self.recipe}; "
                              f"choose one of {', '.join(valid)}")
        precision = PRECISION_SPELLINGS.get(self.precision, self.precision) if self.precision != "auto" else (
            "bf16-mixed" if accelerator == "cuda" else "32-true")
        if precision == "16-mixed" and accelerator == "cpu":
            raise ConfigError("{precision} 16-mixed needs CUDA; use {precision} bf16-mixed or 32-true on CPU")
        image_size = self.image_size or (224 if accelerator == "cuda" else 32)
        if self.recipe == "resnet" and image_size < 8:
            raise ConfigError(f"{{image_size}} must be >= 8 for resnet (got {image_size})")
        batch = self.batch_size or (64 if accelerator == "cuda" else 32)
        if batch < 1:
            raise ConfigError(f"{{batch_size}} must be >= 1 (got {batch})")
        if (self.writeup or self.data_dir) and self.recipe != "mnist":
            raise ConfigError("{writeup} and {data_dir} apply to {recipe} mnist only")
        if self.writeup and not self.data_dir:
            raise ConfigError("{writeup} needs {data_dir} (a folder holding MNIST/raw): the script reads real files")
        if self.data_dir and not (Path(self.data_dir) / "MNIST" / "raw").is_dir():
            raise ConfigError(f"{{data_dir}} {lit(self.data_dir)} has no MNIST/raw folder; "
                              "pass the folder that holds it")
        threads = self.threads_per_rank or (max(1, usable_cpus() // devices[-1]) if accelerator == "cpu" else 0)
        if threads < 0:
            raise ConfigError(f"{{threads_per_rank}} must be >= 0 (got {threads})")
        return {"recipe": self.recipe, "arch": arch, "devices": devices, "accelerator": accelerator,
                "precision": precision, "image_size": image_size, "batch_size": batch, "steps": steps,
                "warmup_steps": self.warmup_steps, "threads": threads, "seed": self.seed, "gpus": gpus,
                "repeats": self.repeats,
                "data_dir": self.data_dir}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_worker(impl: str, n: int, settings: dict[str, Any], out_dir: Path, tag: str = "") -> dict[str, Any]:
    """One measured run in fresh processes; returns its JSON (or raises RuntimeError with the tail). Its
    file is ``runs/<impl>-<n><tag>.json`` (the runner tags each round, so every round stays on disk)."""
    out = out_dir / "runs" / f"{impl}-{n}{tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)
    args = {k: settings[k] for k in ("recipe", "arch", "image_size", "batch_size", "steps", "warmup_steps",
                                     "precision", "accelerator", "threads", "seed", "data_dir")}
    args["channels_last"] = int(settings.get("channels_last", 0))
    if settings.get("count_steps"):
        args["count_steps"] = int(settings["count_steps"])
    if settings.get("val_size"):
        args["val_size"] = int(settings["val_size"])
    if settings.get("without"):
        args["without"] = settings["without"]
    worker = settings.get("worker", "ddp_recipes.bench.harness.worker")  # the clone's account: its own
    cmd = [sys.executable, "-m", worker, impl, "--out", str(out), "--devices", str(n)]
    for key, value in args.items():
        cmd += ["--" + key.replace("_", "-"), str(value)]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "PYTHONWARNINGS": "ignore"}
    if settings["threads"]:
        # The same per-rank budget for every run; Lightning keeps an OMP_NUM_THREADS that is already set.
        env["OMP_NUM_THREADS"] = str(settings["threads"])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    if proc.returncode != 0 or not out.exists():
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        raise RuntimeError(f"{impl} at {n} device(s) failed (exit {proc.returncode}):\n{tail}")
    return json.loads(out.read_text())


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run_bench(cfg: BenchConfig) -> dict[str, Any]:
    """Measure every (impl, N), the comm costs and the host ceiling; predict; return the results dict."""
    settings = cfg.resolve()
    devices = settings["devices"]
    out_dir = Path(cfg.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"host": host_facts(), "runs": [], "warnings": [], "allreduce": []}
    results["config"] = {k: settings[k] for k in ("recipe", "arch", "accelerator", "precision", "image_size",
                                                  "batch_size", "steps", "warmup_steps", "threads", "repeats")}
    results["config"]["devices"] = ",".join(map(str, devices))
    results["config"]["thread_budget"] = (
        f"{settings['threads']} torch thread(s) per rank in every run (OMP_NUM_THREADS)" if settings["threads"]
        else "torch default threads")
    results["config"]["cudnn_benchmark"] = (
        "on in pack, raw and dp alike (pack: Trainer(benchmark=True); raw, dp: torch.backends.cudnn.benchmark)"
        + (" - no effect on CPU" if settings["accelerator"] == "cpu" else ""))
    results["config"]["synthetic_data"] = ("each rank holds its own share of the global set, "
                                           + ("on its GPU (no host copy per step)" if settings["accelerator"] == "cuda"
                                              else "in its memory"))
    if settings["accelerator"] == "cpu" and devices[-1] > 1:
        _progress(f"measuring the host's parallel ceiling with {devices[-1]} workers ...")
        results["ceiling"] = parallel_ceiling(devices[-1])
    impls = ["pack"] + (["plain"] if cfg.plain else []) + (["raw"] if cfg.raw else []) + (
        ["writeup"] if cfg.writeup else [])
    if cfg.compile:
        impls += ["pack-compiled"] + (["raw-compiled"] if cfg.raw else [])
    plan = [(impl, n) for n in devices for impl in impls]
    if cfg.dp:
        if settings["accelerator"] == "cuda" and settings["gpus"] >= 2:
            plan += [("dp", n) for n in devices if n > 1]
        else:
            _progress("--dp skipped: DataParallel needs 2+ CUDA GPUs")
            results["warnings"].append("--dp skipped: DataParallel needs 2+ CUDA GPUs")
    measured: dict[tuple[str, int], list[dict[str, Any]]] = {}
    schedule = interleaved_schedule(plan, settings["repeats"])
    for i, (round_no, impl, n) in enumerate(schedule, 1):
        _progress(f"[{i}/{len(schedule)}] round {round_no + 1}: {impl:<4} {n} device(s): running "
                  f"{settings['warmup_steps']}+{settings['steps']} steps ...")
        start = time.perf_counter()
        run = None
        for attempt in (1, 2):
            try:
                run = run_worker(impl, n, settings, out_dir, tag=f"-round{round_no + 1}")
                break
            except (RuntimeError, subprocess.TimeoutExpired) as err:
                # A rendezvous can lose a race for its port or a peer on a busy host: one retry on a fresh
                # port, and the failure stays in the report either way.
                results["warnings"].append(f"attempt {attempt}: {str(err).splitlines()[0]}")
                _progress(f"        attempt {attempt} failed: {err}")
        if run is None:
            continue
        run["round"] = round_no
        measured.setdefault((impl, n), []).append(run)
        _progress(f"        {run['global_samples_per_s']:.1f} samples/s, median step {run['step_ms_median']:.1f} ms "
                  f"({time.perf_counter() - start:.0f} s)")
    results["runs"], chosen = aggregate_rounds(measured)
    if results.get("ceiling"):
        _reprobe_ceiling(results, devices)
    raw_by_n = {n: run for (impl, n), run in chosen.items() if impl == "raw"}
    pack_by_n = {n: run for (impl, n), run in chosen.items() if impl == "pack"}
    results["overhead_spread"] = paired_ratios(measured)
    results["overhead_ratio"] = {n: v["median"] for n, v in results["overhead_spread"].items()}
    if cfg.plain:
        results["plain_overhead_spread"] = paired_ratios(measured, "pack", "plain")
        results["plain_over_raw_spread"] = paired_ratios(measured, "plain", "raw")
    if cfg.compile:
        results["compiled_overhead_spread"] = paired_ratios(measured, "pack-compiled", "raw-compiled")
        results["compile_speedup"] = paired_ratios(measured, "pack-compiled", "pack")
    _flops(results, settings)
    _hook_cost(results, pack_by_n)
    _communication(results, raw_by_n, devices)
    _prediction(results, raw_by_n)
    return results


def _reprobe_ceiling(results: dict[str, Any], devices: list[int]) -> None:
    """Probe the host's parallel ceiling again when a measured speedup beat it (other load shared the host during
    the first probe), keep both as its range, and add the host warnings in light of the measured speedups."""
    ceiling, best = results["ceiling"], best_speedups(results["runs"])
    if best.get(ceiling["workers"], 0.0) > ceiling["ceiling"]:
        _progress("a measured speedup beat the host's parallel ceiling: probing it again ...")
        ceiling["probes"] = [ceiling["ceiling"], parallel_ceiling(ceiling["workers"])["ceiling"]]
    for n in devices[1:]:
        warning = parallel_warning(n, ceiling, measured=best.get(n))
        if warning:
            results["warnings"].append(warning)


def interleaved_schedule(plan: list[tuple[str, int]], repeats: int) -> list[tuple[int, str, int]]:
    """(round, impl, N) in run order: every round runs the whole plan with the impls of one N back to back,
    their order alternating between rounds, so a burst of host load hits both sides of a comparison."""
    schedule = []
    for round_no in range(repeats):
        for n in dict.fromkeys(n for _, n in plan):
            impls = [impl for impl, m in plan if m == n]
            schedule += [(round_no, impl, n) for impl in (impls if round_no % 2 == 0 else impls[::-1])]
    return schedule


def aggregate_rounds(measured: dict[tuple[str, int], list[dict[str, Any]]]
                     ) -> tuple[list[dict[str, Any]], dict[tuple[str, int], dict[str, Any]]]:
    """One row per (impl, N): the round with the median throughput (the lower middle of an even count),
    all of its figures from that one round so they agree with each other, plus every round's throughput
    range; and that round's full result, whose details (all-reduce, diagnostics) the report uses."""
    keep = ("impl", "devices", "global_samples_per_s", "step_ms_median", "step_ms_p10", "step_ms_p90",
            "peak_mem_mb_per_rank", "measured_steps", "torch_threads", "first_step_s", "input_wait_fraction")
    rows, chosen = [], {}
    for (impl, n), runs in measured.items():
        ordered = sorted(runs, key=lambda r: r["global_samples_per_s"])
        middle = ordered[(len(ordered) - 1) // 2]
        chosen[(impl, n)] = middle
        row = {k: middle[k] for k in keep if k in middle}
        row["per_device_samples_per_s"] = row["global_samples_per_s"] / n
        row["rounds"] = len(runs)
        row["samples_per_s_range"] = [ordered[0]["global_samples_per_s"], ordered[-1]["global_samples_per_s"]]
        rows.append(row)
    return rows, chosen


def paired_ratios(measured: dict[tuple[str, int], list[dict[str, Any]]], impl: str = "pack",
                  baseline: str = "raw") -> dict[int, dict[str, Any]]:
    """{N: median, min and max over rounds of impl/baseline throughput, each ratio from one round's pair}."""
    import statistics

    out = {}
    for (name, n), runs in sorted(measured.items()):
        if name != impl:
            continue
        base = {r["round"]: r for r in measured.get((baseline, n), [])}
        ratios = [r["global_samples_per_s"] / base[r["round"]]["global_samples_per_s"]
                  for r in runs if r["round"] in base and base[r["round"]]["global_samples_per_s"]]
        if ratios:
            out[n] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
                      "pairs": len(ratios)}
    return out


def _flops(results: dict[str, Any], settings: dict[str, Any]) -> None:
    """FLOPs per sample (Lightning's measure_flops on a meta copy), achieved FLOP/s per row, MFU where the
    device's peak is known (never on CPU)."""
    import torch

    from ddp_recipes.bench.harness.workload import Workload, build_module
    from ddp_recipes.train.perf import peak_flops, training_flops_per_sample

    w = Workload(recipe=settings["recipe"], arch=settings["arch"], image_size=settings["image_size"])
    shape = (1, 28, 28) if w.recipe == "mnist" else (3, w.image_size, w.image_size)
    per_sample = training_flops_per_sample(lambda: build_module(w), torch.empty(settings["batch_size"], *shape))
    device = torch.device("cuda", 0) if settings["accelerator"] == "cuda" else torch.device("cpu")
    peak = peak_flops(device, settings["precision"])
    results["flops"] = {"per_sample": per_sample, "peak_per_device": peak}
    for row in results["runs"]:
        achieved = per_sample * row["global_samples_per_s"] / row["devices"] if per_sample else None
        row["achieved_flops_per_sec_per_device"] = round(achieved) if achieved else None
        row["mfu"] = round(achieved / peak, 4) if achieved and peak else None


def _hook_cost(results: dict[str, Any], pack_runs: dict[int, dict[str, Any]]) -> None:
    """Host ms per step inside each pack callback's hooks at each N (the slowest rank's), and DDPDiagnostics'
    share of the step."""
    hooks, rows = {}, []
    for n, run in sorted(pack_runs.items()):
        per_rank = [r for r in run.get("hook_ms_per_step_per_rank") or [] if r]
        if not per_rank:
            continue
        hooks[n] = {name: max(r.get(name, 0.0) for r in per_rank) for name in per_rank[0]}
        if "DDPDiagnostics" in hooks[n]:
            ms = hooks[n]["DDPDiagnostics"]
            rows.append({"devices": n, "ms_per_step": ms, "fraction_of_step": ms / run["step_ms_median"]})
    if hooks:
        results["hook_overhead"] = hooks
    if rows:
        results["diagnostics_overhead"] = rows


def _communication(results: dict[str, Any], raw_by_n: dict[int, dict], devices: list[int]) -> None:
    """All-reduce cost of the gradients at each N, and the part of it the step did not hide."""
    pack = {r["devices"]: r for r in results["runs"] if r["impl"] == "pack"}
    for n in devices[1:]:
        raw = raw_by_n.get(n)
        if not raw or not raw.get("allreduce"):
            continue
        exposed = None
        if 1 in pack and n in pack:
            # Weak scaling: extra step time at N over 1 device is what communication (and, on CPU, core
            # sharing) added; it cannot exceed the full all-reduce.
            extra = pack[n]["step_ms_median"] - pack[1]["step_ms_median"]
            exposed = min(max(0.0, extra), raw["allreduce"]["fp32_ms"])
        results["allreduce"].append({"devices": n, "nbytes": raw["grad_bytes"], **raw["allreduce"],
                                     "exposed_ms": exposed})


def _prediction(results: dict[str, Any], raw_by_n: dict[int, dict]) -> None:
    one = next((r for r in results["runs"] if r["impl"] == "pack" and r["devices"] == 1), None)
    params = next((r["params"] for r in raw_by_n.values() if "params" in r), None)
    if params is None:
        params = _count_params(results["config"])
    if one is None:
        return
    results["prediction"] = {"step_ms": one["step_ms_median"], "params": params, "bytes_per_param": 4,
                             "rows": predict_table(one["step_ms_median"], params, list(LINKS)),
                             "validation": validate_against_pytorch_benchmark()}


def _count_params(config: dict[str, Any]) -> int:
    from ddp_recipes.bench.harness.workload import Workload, build_module

    w = Workload(recipe=config["recipe"], arch=config["arch"], image_size=config["image_size"])
    return sum(p.numel() for p in build_module(w).parameters() if p.requires_grad)


def run_command(args: argparse.Namespace) -> int:
    """The bench without a command: validate the flags, measure, write and print the report."""
    cfg = config_from(BenchConfig, args)
    try:
        cfg.resolve()
        writable_dir(cfg.out, "{out}")
    except ConfigError as err:
        fail(err.cli(), PROG)
    results = run_bench(cfg)
    paths = write_report(results, cfg.out)
    print(markdown_report(json.loads(paths["json"].read_text())))
    print("wrote " + ", ".join(str(path) for path in paths.values()))
    if "plot" not in paths:
        print(PLOT_NEEDS)
    print(summary_line(results))
    return 0 if results["runs"] else 1
