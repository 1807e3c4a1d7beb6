"""``make gpu-check``: all the GPU verification that fits one short slot, with a verdict per check.

    python -m ddp_recipes.bench.gpucheck [--budget-s 480] [--only NAME,...] [--out-dir bench-results]

In order, each check a subprocess with its own timeout (one hang cannot eat the slot), all of them inside
a total budget (a check that would start with too little of it left is skipped, saying so):

* ``gpu-tests``: the ``gpu`` pytest tier (``make test-gpu``) but its kill-and-resume test; 2+-GPU (NCCL)
  tests skip below 2 GPUs inside it.
* ``cuda-kill-resume``: that test alone: SIGKILL a CUDA run mid-training, ``--resume auto``, bit-identical.
* ``sync-debug``: pack training steps under ``torch.cuda.set_sync_debug_mode("warn")``; any host sync in
  the steady-state steps fails it (``ddp_recipes.bench._gpucheck_worker``).
* ``resnet50-{pack,raw}[-compiled]``: ResNet-50, 224 px, bf16-mixed, channels-last, synthetic data, the pack
  and the raw PyTorch loop, eager and compiled, with MFU (``ddp_recipes.train.perf.peak_flops``).
* ``pack-vs-raw``: derived: the pack's images/s at least ``PACK_VS_RAW_MIN`` of the raw loop's.
* ``bench-multi-gpu`` (2+ GPUs): ``python -m ddp_recipes.bench`` at 1, 2 and N GPUs.

Writes ``<out-dir>/gpu-report.json`` and ``gpu-report.md``; exit 1 when any check fails, else 0 (skipped
checks do not fail it: on a machine without CUDA every GPU check is skipped and the exit is 0).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddp_recipes.config.cli import fail

PROG = "python -m ddp_recipes.bench.gpucheck"
TOTAL_BUDGET_S = 480.0  # 8 minutes: the slot issue #20 sizes this for (one H100/H200-class GPU)
MIN_START_S = 20.0  # less than this left: a check is skipped rather than started to be cut off
PACK_VS_RAW_MIN = 0.90  # the pack's step may cost at most ~10 % over the raw loop's at ResNet-50 scale
TESTS_DIR = Path(__file__).resolve().parents[2] / "tests"
RESUME_TEST = "kill_and_resume"  # the -k expression of tests/test_gpu.py's CUDA kill + --resume auto test

# NVIDIA DeepLearningExamples, PyTorch/Classification/ConvNets/resnet50v1.5/README.md, "Training performance
# results" (pytorch-21.03 NGC container), the 1-GPU row. Its "mixed precision" is native AMP with fp16; no
# bf16 figure is published there, so no row is like for like with this check's bf16 run.
REFERENCE_SOURCE = ("NVIDIA DeepLearningExamples, PyTorch/Classification/ConvNets/resnet50v1.5/README.md, "
                    "Training performance results (pytorch-21.03 NGC container), 1 GPU")
PUBLISHED = {  # (gpu, precision) -> images/s, 1 GPU, ResNet-50 v1.5 (= torchvision's resnet50)
    ("A100 80GB", "TF32"): 938.0, ("A100 80GB", "AMP fp16"): 2470.0,
    ("V100 16GB", "FP32"): 367.0, ("V100 16GB", "AMP fp16"): 1200.0,
}
REFERENCE_PRECISION = {"bf16-mixed": None, "16-mixed": "AMP fp16", "32-true": "TF32"}  # None: not published
A100_DENSE_PEAK = {"AMP fp16": 312e12, "TF32": 156e12}  # NVIDIA A100 datasheet, dense tensor-core FLOP/s


@dataclass
class Check:
    """One verification: a command run in its own session, judged from its exit code and files."""

    name: str
    what: str  # one line for the report
    cmd: list[str]
    timeout_s: float
    min_gpus: int = 1
    judge: Callable[[int, Path, str], dict[str, Any]] | None = None  # (rc, work dir, output tail) -> verdict
    env: dict[str, str] = field(default_factory=dict)


def verdict(status: str, reason: str = "", **data: Any) -> dict[str, Any]:
    return {"verdict": status, "reason": reason, **({"data": data} if data else {})}


def exit_code_judge(rc: int, work: Path, tail: str) -> dict[str, Any]:
    return verdict("pass") if rc == 0 else verdict("fail", f"exit {rc}: {last_lines(tail, 3)}")


def last_lines(text: str, n: int) -> str:
    return " | ".join(line.strip() for line in text.strip().splitlines()[-n:])


def run_one(check: Check, timeout_s: float, work: Path) -> dict[str, Any]:
    """Run ``check`` with ``timeout_s``; on timeout its whole process group is killed (ranks, loader
    workers, compile workers), so nothing it started outlives it."""
    work.mkdir(parents=True, exist_ok=True)
    log = work / "output.log"
    cmd = [part.replace("{work}", str(work)) for part in check.cmd]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", **check.env}
    started = time.monotonic()
    with log.open("w") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
    seconds = round(time.monotonic() - started, 1)
    tail = log.read_text(errors="replace")[-4000:]
    if rc is None:
        result = verdict("fail", f"timed out after {timeout_s:.0f} s (killed); log: {log}")
    else:
        try:
            result = (check.judge or exit_code_judge)(rc, work, tail)
        except Exception as err:  # noqa: BLE001 - a judge that cannot read the output is that check's failure
            result = verdict("fail", f"could not read its result ({type(err).__name__}: {err}); exit {rc}")
    return {"name": check.name, "what": check.what, **result, "seconds": seconds}


def run_checks(checks: list[Check], gpus: int, out_dir: Path, budget_s: float = TOTAL_BUDGET_S,
               progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Every check in order, each given ``min(its timeout, budget left)``; skipped (with the reason) when
    the machine has too few GPUs or less than ``MIN_START_S`` of the budget is left."""
    say = progress or (lambda line: print(line, file=sys.stderr, flush=True))
    started, results = time.monotonic(), []
    for i, check in enumerate(checks, 1):
        left = budget_s - (time.monotonic() - started)
        head = f"[gpu-check {i}/{len(checks)}] {check.name}"
        if gpus < check.min_gpus:
            why = "no CUDA device" if gpus == 0 else f"needs {check.min_gpus}+ GPUs ({gpus} visible)"
            result = {"name": check.name, "what": check.what, **verdict("skipped", why), "seconds": 0.0}
        elif left < MIN_START_S:
            result = {"name": check.name, "what": check.what, "seconds": 0.0,
                      **verdict("skipped", f"total budget of {budget_s:.0f} s spent ({max(left, 0):.0f} s left)")}
        else:
            timeout = min(check.timeout_s, left)
            say(f"{head}: {check.what} (timeout {timeout:.0f} s, {left:.0f} s of the budget left) ...")
            result = run_one(check, timeout, out_dir / "gpu-check" / check.name)
        say(f"{head}: {result['verdict']}" + (f": {result['reason']}" if result["reason"] else "")
            + (f" ({result['seconds']} s)" if result["seconds"] else ""))
        results.append(result)
    return results


# ---- the checks -----------------------------------------------------------------------------------------

def pytest_judge(rc: int, work: Path, tail: str) -> dict[str, Any]:
    """pytest's junit XML: counts, and the names of failed tests; no test run at all is a failure."""
    suite = ET.parse(work / "junit.xml").getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    failed = [f"{case.get('name')}: {(bad.get('message') or '').splitlines()[0][:200] if bad.get('message') else ''}"
              for case in suite.iter("testcase") for bad in case if bad.tag in ("failure", "error")]
    skipped = sorted({(s.get("message") or "").strip() for case in suite.iter("testcase")
                      for s in case if s.tag == "skipped"})
    summary = f"{passed} passed, {counts['skipped']} skipped, {len(failed)} failed"
    if failed or rc not in (0,):
        return verdict("fail", f"{summary}; exit {rc}" + (f"; {failed[0]}" if failed else f": {last_lines(tail, 2)}"),
                       failed=failed, skipped_reasons=skipped, **counts)
    if passed == 0:
        return verdict("skipped", f"every test skipped: {'; '.join(skipped)[:300]}", skipped_reasons=skipped, **counts)
    return verdict("pass", summary, skipped_reasons=skipped, **counts)


def pytest_cmd(expression: str) -> list[str]:
    return [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "-k", expression,
            "--junitxml={work}/junit.xml", str(TESTS_DIR)]


def bench_settings(args: argparse.Namespace) -> dict[str, Any]:
    return {"recipe": "resnet", "arch": "resnet50", "image_size": 224, "batch_size": args.batch_size,
            "steps": args.steps, "warmup_steps": args.warmup_steps, "precision": "bf16-mixed",
            "accelerator": "cuda", "threads": 0, "seed": 0, "data_dir": "", "channels_last": 1}


def worker_cmd(impl: str, settings: dict[str, Any]) -> list[str]:
    """``ddp_recipes.bench.workers`` on one GPU, as ``bench.run_worker`` runs it (but under our timeout)."""
    cmd = [sys.executable, "-m", "ddp_recipes.bench.workers", impl, "--out", "{work}/run.json", "--devices", "1"]
    for key, value in settings.items():
        cmd += ["--" + key.replace("_", "-"), str(value)]
    return cmd


def throughput_judge(rc: int, work: Path, tail: str) -> dict[str, Any]:
    if rc != 0:
        return verdict("fail", f"exit {rc}: {last_lines(tail, 3)}")
    run = json.loads((work / "run.json").read_text())
    row = {"images_per_s": round(run["global_samples_per_s"], 1), "step_ms_median": round(run["step_ms_median"], 2),
           "first_step_s": round(run["first_step_s"], 2) if run.get("first_step_s") is not None else None}
    return verdict("pass", f"{row['images_per_s']} images/s, median step {row['step_ms_median']} ms", **row)


def sync_judge(rc: int, work: Path, tail: str) -> dict[str, Any]:
    if rc != 0:
        return verdict("fail", f"exit {rc}: {last_lines(tail, 3)}")
    found = json.loads((work / "sync.json").read_text())
    n, steps = found["syncs"], found["steps"]
    if n:
        return verdict("fail", f"{n} host sync(s) in {steps} steady-state steps, first at {found['sites'][0]}", **found)
    return verdict("pass", f"no host sync in {steps} steady-state steps", **found)


def plan_checks(args: argparse.Namespace, gpus: int) -> list[Check]:
    settings = bench_settings(args)
    checks = [
        Check("gpu-tests", "the gpu pytest tier (NCCL tests skip below 2 GPUs)", pytest_cmd(f"not {RESUME_TEST}"),
              timeout_s=240, judge=pytest_judge),
        Check("cuda-kill-resume", "SIGKILL a CUDA run mid-training, --resume auto: bit-identical weights",
              pytest_cmd(RESUME_TEST), timeout_s=150, judge=pytest_judge),
        Check("sync-debug", "pack training steps under torch.cuda.set_sync_debug_mode('warn'): no host sync",
              [sys.executable, "-m", "ddp_recipes.bench._gpucheck_worker", "sync-debug", "--out", "{work}/sync.json"],
              timeout_s=90, judge=sync_judge),
    ]
    impls = ["pack", "raw"] + (["pack-compiled", "raw-compiled"] if args.compile else [])
    for impl in impls:
        checks.append(Check(f"resnet50-{impl}", f"ResNet-50 224 px bf16 channels-last, {impl}, batch "
                            f"{args.batch_size}, {args.warmup_steps}+{args.steps} steps", worker_cmd(impl, settings),
                            timeout_s=180 if impl.endswith("compiled") else 90, judge=throughput_judge))
    n = max(gpus, 2)
    checks.append(Check("bench-multi-gpu", f"python -m ddp_recipes.bench at 1/2/{n} GPUs (make bench)",
                        [sys.executable, "-m", "ddp_recipes.bench", "--devices", ",".join(map(str, sorted({1, 2, n}))),
                         "--repeats", "1", "--steps", "20", "--out", "{work}/bench"], timeout_s=240, min_gpus=2))
    if args.only:
        wanted = set(args.only.split(","))
        unknown = wanted - {c.name for c in checks} - {"pack-vs-raw"}
        if unknown:
            fail(f"--only: no check named {', '.join(sorted(unknown))}; choose from "
                 f"{', '.join(c.name for c in checks)}, pack-vs-raw", PROG)
        checks = [c for c in checks if c.name in wanted]
    return checks


# ---- derived figures: pack vs raw, MFU, the reference rows ---------------------------------------------

def pack_vs_raw(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One derived check per variant (eager, compiled) whose pack and raw runs both passed."""
    by_name = {r["name"]: r for r in results}
    derived = []
    for suffix in ("", "-compiled"):
        pack, raw = by_name.get(f"resnet50-pack{suffix}"), by_name.get(f"resnet50-raw{suffix}")
        if pack is None or raw is None:
            continue
        name, what = f"pack-vs-raw{suffix}", f"pack images/s >= {PACK_VS_RAW_MIN:.0%} of raw{suffix or ' (eager)'}"
        if pack["verdict"] != "pass" or raw["verdict"] != "pass":
            skipped = next((r["reason"] for r in (pack, raw) if r["verdict"] == "skipped"), None)
            derived.append({"name": name, "what": what, "seconds": 0.0, **verdict(
                "skipped", skipped or f"needs both runs to pass (pack: {pack['verdict']}, raw: {raw['verdict']})")})
            continue
        ratio = pack["data"]["images_per_s"] / raw["data"]["images_per_s"]
        status = "pass" if ratio >= PACK_VS_RAW_MIN else "fail"
        derived.append({"name": name, "what": what, "seconds": 0.0,
                        **verdict(status, f"pack/raw = {ratio:.3f}", ratio=round(ratio, 4))})
    return derived


def throughput_rows(results: list[dict[str, Any]], flops_per_sample: int | None, peak: float | None) -> list[dict]:
    """The passed ResNet-50 runs with achieved TFLOP/s and MFU (None when FLOPs or peak are unknown)."""
    rows = []
    for r in results:
        if not r["name"].startswith("resnet50-") or r["verdict"] != "pass":
            continue
        rate = r["data"]["images_per_s"]
        achieved = flops_per_sample * rate if flops_per_sample else None
        rows.append({"impl": r["name"].removeprefix("resnet50-"), **r["data"],
                     "achieved_tflops": round(achieved / 1e12, 2) if achieved else None,
                     "mfu": round(achieved / peak, 4) if achieved and peak else None})
    return rows


def reference_rows(precision: str, device_peak: float | None, device_name: str | None) -> list[dict[str, Any]]:
    """NVIDIA's published 1-GPU ResNet-50 training rows for ``precision``; when none is published, one row
    saying so. A published row from another GPU is scaled by the ratio of dense peaks, and says so."""
    ref = REFERENCE_PRECISION.get(precision)
    if ref is None:
        return [{"precision": precision, "images_per_s": None, "source": REFERENCE_SOURCE,
                 "label": "unavailable: NVIDIA publishes TF32/FP32 and AMP fp16 rows for this model, no bf16 row; "
                          "fp16 and bf16 share the dense tensor-core peak on A100/H100, but a different precision "
                          "is not like for like, so no figure is shown"}]
    rows = []
    for (gpu, prec), rate in PUBLISHED.items():
        if prec != ref:
            continue
        row = {"gpu": gpu, "precision": prec, "images_per_s": rate, "source": REFERENCE_SOURCE,
               "label": "published, 1 GPU"}
        if gpu.startswith("A100") and device_peak and device_name and "A100" not in device_name:
            row["scaled_images_per_s"] = round(rate * device_peak / A100_DENSE_PEAK[prec], 1)
            row["label"] += f"; scaled to {device_name} by dense peak ({device_peak / 1e12:.0f} / " \
                            f"{A100_DENSE_PEAK[prec] / 1e12:.0f} TFLOP/s), an estimate, not a measurement"
        rows.append(row)
    return rows


def device_facts() -> dict[str, Any]:
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    facts: dict[str, Any] = {"gpus": gpus, "torch": torch.__version__, "gpu": None, "peak_flops_per_sec": None}
    if gpus:
        from ddp_recipes.train.perf import peak_flops

        facts["gpu"] = torch.cuda.get_device_name(0)
        facts["peak_flops_per_sec"] = peak_flops(torch.device("cuda", 0), "bf16-mixed")
    return facts


def resnet50_flops(batch_size: int) -> int | None:
    import torch

    from ddp_recipes.bench.workers import Workload, build_module
    from ddp_recipes.train.perf import training_flops_per_sample

    w = Workload(recipe="resnet", arch="resnet50", image_size=224, channels_last=1)
    return training_flops_per_sample(lambda: build_module(w), torch.empty(batch_size, 3, 224, 224))


# ---- the report ---------------------------------------------------------------------------------------

def build_report(results: list[dict[str, Any]], facts: dict[str, Any], budget_s: float, elapsed_s: float,
                 rows: list[dict], reference: list[dict], config: dict[str, Any]) -> dict[str, Any]:
    counts = {s: sum(r["verdict"] == s for r in results) for s in ("pass", "fail", "skipped")}
    return {"verdict": "fail" if counts["fail"] else "pass", "counts": counts, **facts,
            "budget_s": budget_s, "elapsed_s": round(elapsed_s, 1), "config": config, "checks": results,
            "throughput": rows, "reference": reference}


def markdown(report: dict[str, Any]) -> str:
    c = report["counts"]
    lines = [f"# gpu-check: {report['verdict'].upper()} ({c['pass']} pass, {c['fail']} fail, {c['skipped']} skipped)",
             "", f"GPU: {report['gpu'] or 'none'} x {report['gpus']}, torch {report['torch']}; "
             f"{report['elapsed_s']} s of a {report['budget_s']:.0f} s budget", "",
             "| check | verdict | seconds | reason |", "| --- | --- | ---: | --- |"]
    lines += [f"| {r['name']} | {r['verdict']} | {r['seconds']} | {r['reason'].replace('|', '/')} |"
              for r in report["checks"]]
    if report["throughput"]:
        cfg = report["config"]
        lines += ["", f"ResNet-50, 224 px, bf16-mixed, channels-last, batch {cfg['batch_size']}, synthetic data, "
                  f"1 GPU; peak {report['peak_flops_per_sec']} FLOP/s", "",
                  "| impl | images/s | step ms | first step s | TFLOP/s | MFU |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
        lines += [f"| {r['impl']} | {r['images_per_s']} | {r['step_ms_median']} | {r['first_step_s']} | "
                  f"{r['achieved_tflops']} | {r['mfu']} |" for r in report["throughput"]]
    lines += ["", "Reference (NVIDIA, published, 1 GPU):"]
    for r in report["reference"]:
        figure = f"{r['images_per_s']:g} images/s" if r["images_per_s"] else "no figure"
        scaled = f" (~{r['scaled_images_per_s']:g} images/s scaled)" if r.get("scaled_images_per_s") else ""
        lines.append(f"- {r.get('gpu', '')} {r['precision']}: {figure}{scaled}; {r['label']}")
    lines += [f"- source: {report['reference'][0]['source']}"] if report["reference"] else []
    return "\n".join(lines) + "\n"


def write_report(report: dict[str, Any], out_dir: Path) -> tuple[Path, Path]:
    from ddp_recipes.atomic import write_json_atomic

    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / "gpu-report.json", out_dir / "gpu-report.md"
    write_json_atomic(json_path, report)
    md_path.write_text(markdown(report))
    return json_path, md_path


def _parser() -> argparse.ArgumentParser:
    class OneLine(argparse.ArgumentParser):
        def error(self, message: str) -> Any:  # type: ignore[override]
            fail(message, PROG)

    p = OneLine(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget-s", type=float, default=TOTAL_BUDGET_S, help="total seconds for all checks")
    p.add_argument("--only", default="", help="comma list of check names to run (default: all)")
    p.add_argument("--batch-size", type=int, default=128, help="ResNet-50 per-GPU batch (NVIDIA's is 256)")
    p.add_argument("--steps", type=int, default=30, help="measured steps per ResNet-50 run")
    p.add_argument("--warmup-steps", type=int, default=10, help="steps before timing (compilation included)")
    p.add_argument("--no-compile", dest="compile", action="store_false", help="eager ResNet-50 runs only")
    p.add_argument("--out-dir", default="bench-results", help="where gpu-report.json/.md and the logs go")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.batch_size < 1 or args.steps < 2 or args.warmup_steps < 1 or args.budget_s <= 0:
        fail("--batch-size must be >= 1, --steps >= 2, --warmup-steps >= 1 and --budget-s > 0", PROG)
    out_dir = Path(args.out_dir)
    facts = device_facts()
    checks = plan_checks(args, facts["gpus"])
    started = time.monotonic()
    results = run_checks(checks, facts["gpus"], out_dir, args.budget_s)
    if not args.only or "pack-vs-raw" in args.only.split(","):
        results += pack_vs_raw(results)
    rows = throughput_rows(results, resnet50_flops(args.batch_size) if facts["gpus"] else None,
                           facts["peak_flops_per_sec"])
    report = build_report(results, facts, args.budget_s, time.monotonic() - started, rows,
                          reference_rows("bf16-mixed", facts["peak_flops_per_sec"], facts["gpu"]),
                          bench_settings(args))
    json_path, md_path = write_report(report, out_dir)
    print(markdown(report))
    print(f"gpu-check: {report['verdict']} ({report['counts']['fail']} failed); wrote {json_path} and {md_path}",
          flush=True)
    return 1 if report["verdict"] == "fail" else 0


if __name__ == "__main__":
    raise SystemExit(main())
