"""``make gpu-check``: all the GPU verification that fits one short slot, with a verdict per check.

    python3 -m tests.gpucheck --out-dir DIR [--budget-s 420] [--only NAME,...] [--compile] [--decode-gpu] [--bench]

A slot's one command is ``python3 -m tests.gpucheck --out-dir "$OUT"`` (docs/gpu.md). Runs from the checkout as
it is (no install, nothing fetched). In order of value, each check a command with its own timeout (a hang is a
failure and cannot eat the slot), all inside one budget (what the budget cuts is ``incomplete``, unless its
output already shows a failure). The defaults are what a slot should run: on one H100 or H200 they add up to
about 5 minutes by :data:`ESTIMATE_S` (cold start included), inside the 7-minute budget:

1. ``sync-debug``: pack training steps under ``torch.cuda.set_sync_debug_mode("warn")``, after the warm-up
   and the first log step, later log steps among them; any host sync in a step that does not log fails it,
   and so does a log step that reads more than the values the logger writes (``tests.gpucheck.worker``).
2. ``resnet50-pack``, ``resnet50-raw``, then ``pack-vs-raw`` (derived): ResNet-50, 224 px, bf16-mixed,
   channels-last, synthetic data, eager, the pack and the raw PyTorch loop, with MFU; the pack's images/s
   at least ``PACK_VS_RAW_MIN`` of the raw loop's. The headline figure.
3. ``gpu-tests``: the ``gpu`` pytest tier (``GPU_TEST_FILES`` only) but its kill-and-resume test and its
   ``compiles`` tests; 2+-GPU (NCCL) tests skip below 2 GPUs inside it.
4. ``cuda-kill-resume``: that test alone: SIGKILL a CUDA run mid-training, ``--resume auto``, bit-identical.

Behind flags (each a few minutes more; ``--only`` also picks any of them):

* ``--decode-gpu``: ``decode-gpu``, the ResNet-50 recipe on one folder of real-size synthetic JPEGs with
  ``--decode cpu`` and with ``--decode gpu`` (nvJPEG): images/s and input-wait fraction of each; it fails where
  the gpu run did not decode on CUDA or needed the CPU fallback for any of these plain baseline JPEGs. (The
  nvJPEG path itself runs in ``gpu-tests``.)
* ``--compile``: ``resnet50-{pack,raw}-compiled``, ``pack-vs-raw-compiled`` (``torch.compile``d; ``no
  verdict`` with the reason where :func:`tests.gpucheck.machine.compile_blocker` says it cannot build code
  here), and the gpu tier's ``compiles`` tests.
* ``--bench`` (2+ GPUs): ``bench-multi-gpu``, ``python -m ddp_recipes.bench`` at 1, 2 and N GPUs.

``--out-dir`` (default: :data:`DEFAULT_OUT_DIR`, outside the checkout) gets the report and one log bundle,
rewritten after every check (a slot that ends mid-run still leaves them), and nothing else
(:mod:`tests.gpucheck.bundle`); the checks work in a scratch folder that is removed. Exit codes and verdicts:
:mod:`tests.gpucheck.report` (0 pass, 1 fail, 2 bad flag, 3 incomplete, 4 no verdict).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ddp_recipes.bench.harness.components import LOG_EVERY_N_STEPS
from ddp_recipes.config.cli import FlagParser, fail
from tests.gpucheck.bundle import FILES, write_logs
from tests.gpucheck.machine import Machine, inspect_machine
from tests.gpucheck.report import (
    EXIT_CODES,
    build_report,
    markdown,
    reference_rows,
    throughput_rows,
    write_report,
)
from tests.gpucheck.runner import (
    Check,
    Derived,
    Result,
    exit_text,
    pytest_judge,
    pytest_partial,
    run_checks,
    verdict,
)

PROG = "python3 -m tests.gpucheck"
TOTAL_BUDGET_S = 420.0  # 7 minutes of a 10-minute slot on one H200: the rest is the machine's start and the copy
PACK_VS_RAW_MIN = 0.90  # the pack's step may cost at most ~10 % over the raw loop's at ResNet-50 scale
# The gpu tier, and only it: collecting all of tests/ would import every test module (and its optional
# packages) before a single GPU test runs. tests/gpucheck/test_gpucheck.py checks this list against the
# markers.
GPU_TEST_FILES = ("tests/gpu/test_gpu.py", "tests/gpu/test_gpu_cuda_paths.py",
                  "tests/gpu/test_gpu_timing.py", "tests/gpu/test_gpu_decode.py")
RESUME_TEST = "kill_and_resume"  # the -k expression of tests/gpu/test_gpu.py's CUDA kill + --resume auto test
# gpu-tests: the tier but the kill-and-resume test (its own check) and the 5-step raw bench run (the
# resnet50-raw check runs that worker at full size): the slot has no seconds for the same thing twice.
GPU_TESTS_EXPRESSION = f"not {RESUME_TEST} and not bench_raw_path_on_one_gpu"
DEFAULT_OUT_DIR = Path(tempfile.gettempdir()) / "gpu-check"  # never the working tree
# Seconds each check takes on one H100 or H200 by estimate, from its code, a cold process each: ~15 s to import
# torch + Lightning and start CUDA and cuDNN, then its work. sync-debug: 17 ResNet-50 steps at batch 32. The
# ResNet-50 runs: 40 steps at batch 128 (~50 ms each at ~2,500 images/s) and cuDNN's first-step search.
# gpu-tests: ~20 one-GPU tests of tiny models, 2-5 s each, the doctor's NCCL run ~15 s. cuda-kill-resume:
# three recipe processes (straight, killed, resumed). decode-gpu: 2,304 JPEGs written (~7 s), two recipe
# runs of 16 steps with loader workers. Compiled: inductor compiling ResNet-50's step cold, 1-2 minutes.
ESTIMATE_S = {"sync-debug": 30, "resnet50-pack": 35, "resnet50-raw": 30, "gpu-tests": 120, "cuda-kill-resume": 90,
              "decode-gpu": 100, "resnet50-pack-compiled": 150, "resnet50-raw-compiled": 120,
              "bench-multi-gpu": 200}
PER_TEST_TIMEOUT_S = 150  # pytest-timeout's limit per gpu test, where it is installed: one hang, one failure
# Sized from its work, with room for a cold start: the folder of 2,304 JPEGs (6.6 s on 2 CPU cores), then two
# recipe processes, each importing torch, Lightning and torchvision (8.7 s measured in one of them, 4.9 s for
# `--help` here warm), starting CUDA, cuDNN and its loader workers, a sanity batch, 16 ResNet-50 steps at batch
# 128 and the test pass: about 45 s each cold. 2 x 45 + 10 = 100 s, and half again for a slow disk or a cold
# page cache. The overall budget still bounds the slot: what it cuts is "incomplete", never "fail".
DECODE_TIMEOUT_S = 150
# The compiled runs' steps (see plan_checks); their warm-up reaches past the first log step (batch
# LOG_EVERY_N_STEPS - 1), where the compiled step takes a new branch (and may recompile): never timed.
COMPILED_WARMUP, COMPILED_STEPS = LOG_EVERY_N_STEPS, 12


def pytest_cmd(expression: str, marks: str = "gpu") -> list[str]:
    cmd = [sys.executable, "-m", "pytest", "-v", "-m", marks, "-p", "no:cacheprovider", "-k", expression,
           "--junitxml={work}/junit.xml"]
    if importlib.util.find_spec("pytest_timeout") is not None:
        cmd += ["--timeout", str(PER_TEST_TIMEOUT_S)]
    return [*cmd, *GPU_TEST_FILES]


def bench_settings(args: argparse.Namespace) -> dict[str, Any]:
    # The warm-up reaches past the first log step (the harness logs every LOG_EVERY_N_STEPS): one-off work there.
    return {"recipe": "resnet", "arch": "resnet50", "image_size": 224, "batch_size": args.batch_size,
            "steps": args.steps, "warmup_steps": max(args.warmup_steps, LOG_EVERY_N_STEPS), "precision": "bf16-mixed",
            "accelerator": "cuda", "threads": 0, "seed": 0, "data_dir": "", "channels_last": 1}


def worker_cmd(impl: str, settings: dict[str, Any]) -> list[str]:
    """``ddp_recipes.bench.harness.worker`` on one GPU, as ``bench.run_worker`` runs it (but under our timeout)."""
    cmd = [sys.executable, "-m", "ddp_recipes.bench.harness.worker", impl, "--out", "{work}/run.json", "--devices", "1"]
    for key, value in settings.items():
        cmd += ["--" + key.replace("_", "-"), str(value)]
    return cmd


def throughput_judge(rc: int, work: Path, tail: str) -> Result:
    if rc != 0:
        return verdict("fail", exit_text(rc, tail))
    run = json.loads((work / "run.json").read_text())
    row = {"images_per_s": round(run["global_samples_per_s"], 1), "step_ms_median": round(run["step_ms_median"], 2),
           "first_step_s": round(run["first_step_s"], 2) if run.get("first_step_s") is not None else None}
    return verdict("pass", f"{row['images_per_s']} images/s, median step {row['step_ms_median']} ms", **row)


def sync_judge(rc: int, work: Path, tail: str) -> Result:
    if rc != 0:
        return verdict("fail", exit_text(rc, tail))
    found = json.loads((work / "sync.json").read_text())
    n, steps, logs = found["syncs"], found["steps"], found.get("log_steps", [])
    if n:
        return verdict("fail", f"{n} host sync(s) in the {steps - len(logs)} steady-state steps that do not log, "
                       f"first at {found['sites'][0]}", **found)
    over = found.get("log_steps_over") or {}
    if over:
        step, syncs = next(iter(over.items()))
        return verdict("fail", f"log step {step} made {syncs} host sync(s) for the "
                       f"{found['logged_values'].get(step, '?')} value(s) the logger wrote, first at "
                       f"{found['log_step_sites'][0]}", **found)
    if not logs:
        return verdict("fail", f"no log step among the {steps} steady-state steps: the window must span one", **found)
    reads = sum(found["log_step_syncs"].values())
    return verdict("pass", f"no host sync in the {steps - len(logs)} steps that do not log; {len(logs)} log steps "
                   f"read {reads} value(s), what the logger wrote", **found)


def _percent(fraction: float | None) -> str:
    return "n/a" if fraction is None else f"{fraction:.1%}"


def decode_judge(rc: int, work: Path, tail: str) -> Result:
    """Both runs' figures; a fail where the gpu run did not decode on CUDA or fell back to the CPU for a file."""
    if rc != 0:
        return verdict("fail", f"exit {rc}: {' | '.join(tail.strip().splitlines()[-3:])}")
    found = json.loads((work / "decode.json").read_text())
    cpu, gpu = found["cpu"], found["gpu"]
    rates = [run["images_per_s"] for run in (cpu, gpu)]
    ratio = round(rates[1] / rates[0], 3) if all(rates) else None
    figures = (f"decode cpu: {rates[0]} images/s, input wait {_percent(cpu['input_wait_fraction'])} "
               f"({cpu['num_workers']} workers); decode gpu: {rates[1]} images/s, input wait "
               f"{_percent(gpu['input_wait_fraction'])}" + (f"; gpu/cpu = {ratio:.2f}" if ratio else ""))
    data = {**found, "gpu_vs_cpu": ratio}
    record = gpu.get("decode") or {}
    if not str(record.get("device", "")).startswith("cuda"):
        return verdict("fail", f"--decode gpu decoded on {record.get('device')}, not CUDA; {figures}", **data)
    if record.get("cpu_fallbacks"):
        return verdict("fail", f"nvJPEG refused {record['cpu_fallbacks']} of {record.get('images')} plain baseline "
                       f"JPEGs (decoded on the CPU instead); {figures}", **data)
    if not all(rates):
        return verdict("fail", f"a run measured no steady-state rate; {figures}", **data)
    return verdict("pass", figures, **data)


def decode_partial(work: Path, tail: str) -> tuple[str, bool]:
    """The runs that finished before a cut (figures, no verdict of their own)."""
    try:
        found = json.loads((work / "decode.json").read_text())
    except (OSError, ValueError):
        return "", False
    return "; ".join(f"decode {d} ran: {found[d]['images_per_s']} images/s" for d in ("cpu", "gpu")
                     if d in found), False


def pack_vs_raw(suffix: str) -> Derived:
    """The pack's images/s against the raw loop's, from the two runs before it."""
    label = suffix.removeprefix("-") or "eager"

    def compute(done: dict[str, Result]) -> Result:
        pack, raw = done.get(f"resnet50-pack{suffix}"), done.get(f"resnet50-raw{suffix}")
        if pack is None or raw is None:
            return verdict("no verdict", "needs both runs, and --only left one out")
        if pack["verdict"] == "pass" and raw["verdict"] == "pass":
            ratio = pack["data"]["images_per_s"] / raw["data"]["images_per_s"]
            return verdict("pass" if ratio >= PACK_VS_RAW_MIN else "fail", f"pack/raw = {ratio:.3f}",
                           ratio=round(ratio, 4))
        states = f"pack: {pack['verdict']}, raw: {raw['verdict']}"
        if "incomplete" in (pack["verdict"], raw["verdict"]):
            return verdict("incomplete", f"a run it needs did not finish ({states})")
        return verdict("no verdict", f"needs both runs to pass ({states})")

    return Derived(f"pack-vs-raw{suffix}", f"pack images/s >= {PACK_VS_RAW_MIN:.0%} of raw ({label})",
                   (f"resnet50-pack{suffix}", f"resnet50-raw{suffix}"), compute)


def plan_checks(args: argparse.Namespace, gpus: int) -> list[Check | Derived]:
    """The checks in order of value (the module docstring), before ``--only``."""
    settings = bench_settings(args)

    def resnet(impl: str, timeout_s: float) -> Check:
        compiled = impl.endswith("compiled")
        # A compiled run's time is its compilation (the first step, tens of seconds cold): once compiled the
        # step is steady, so fewer steps measure it as well and keep the compiled pair inside the budget.
        run = {**settings, **({"warmup_steps": COMPILED_WARMUP, "steps": min(args.steps, COMPILED_STEPS)}
                              if compiled else {})}
        return Check(f"resnet50-{impl}", f"ResNet-50 224 px bf16 channels-last, {impl}, batch {args.batch_size}, "
                     f"{run['warmup_steps']}+{run['steps']} steps", worker_cmd(impl, run), timeout_s=timeout_s,
                     compiled=compiled, judge=throughput_judge)

    checks: list[Check | Derived] = [
        Check("sync-debug", "pack training steps under torch.cuda.set_sync_debug_mode('warn'): no host sync",
              [sys.executable, "-m", "tests.gpucheck.worker", "sync-debug", "--out", "{work}/sync.json"],
              timeout_s=150, judge=sync_judge),
        resnet("pack", 150), resnet("raw", 120), pack_vs_raw(""),
        Check("gpu-tests", "the gpu pytest tier (NCCL tests skip below 2 GPUs)" + ("" if args.compile else
              ", its compiles tests left to --compile"), pytest_cmd(GPU_TESTS_EXPRESSION, "gpu" if args.compile
                                                                  else "gpu and not compiles"),
              timeout_s=300, judge=pytest_judge, partial=pytest_partial),
        Check("cuda-kill-resume", "SIGKILL a CUDA run mid-training, --resume auto: bit-identical weights",
              pytest_cmd(RESUME_TEST), timeout_s=180, judge=pytest_judge, partial=pytest_partial),
        Check("decode-gpu", "ResNet-50 recipe on real-size JPEGs, --decode cpu vs gpu: images/s, input wait",
              [sys.executable, "-m", "tests.gpucheck.worker", "decode-gpu", "--out", "{work}/decode.json"],
              timeout_s=DECODE_TIMEOUT_S, judge=decode_judge, partial=decode_partial),
    ]
    n = max(gpus, 2)
    flagged = {"decode-gpu": args.decode_gpu, "resnet50-pack-compiled": args.compile,
               "resnet50-raw-compiled": args.compile, "pack-vs-raw-compiled": args.compile,
               "bench-multi-gpu": args.bench}
    checks += [resnet("pack-compiled", 300), resnet("raw-compiled", 240), pack_vs_raw("-compiled"),
               Check("bench-multi-gpu", f"python -m ddp_recipes.bench at 1/2/{n} GPUs (make bench)",
                     [sys.executable, "-m", "ddp_recipes.bench", "--devices", ",".join(map(str, sorted({1, 2, n}))),
                      "--repeats", "1", "--steps", "20", "--out", "{work}/bench"], timeout_s=300, min_gpus=2)]
    if not args.only:
        return [c for c in checks if flagged.get(c.name, True)]
    wanted = set(args.only.split(","))
    unknown = wanted - {c.name for c in checks}
    if unknown:
        fail(f"--only: no check named {', '.join(sorted(unknown))}; choose from "
             f"{', '.join(c.name for c in checks)}", PROG)
    checks = [c for c in checks if c.name in wanted or (isinstance(c, Derived) and set(c.inputs) <= wanted)]
    return checks


def resnet50_flops(batch_size: int) -> int | None:
    import torch

    from ddp_recipes.bench.harness.workload import Workload, build_module
    from ddp_recipes.train.perf import training_flops_per_sample

    w = Workload(recipe="resnet", arch="resnet50", image_size=224, channels_last=1)
    return training_flops_per_sample(lambda: build_module(w), torch.empty(batch_size, 3, 224, 224))


def _parser() -> argparse.ArgumentParser:
    p = FlagParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget-s", type=float, default=TOTAL_BUDGET_S, help="total seconds for all checks")
    p.add_argument("--only", default="", help="comma list of check names to run (default: all)")
    p.add_argument("--batch-size", type=int, default=128, help="ResNet-50 per-GPU batch (NVIDIA's is 256)")
    p.add_argument("--steps", type=int, default=30, help="measured steps per ResNet-50 run")
    p.add_argument("--warmup-steps", type=int, default=10, help="steps before timing (compilation included)")
    p.add_argument("--compile", action="store_true", help="also the torch.compile'd ResNet-50 pair and the gpu "
                   "tier's compiles tests (~5 minutes more, cold)")
    p.add_argument("--decode-gpu", action="store_true", help="also decode-gpu: --decode cpu vs gpu figures (~2 min)")
    p.add_argument("--bench", action="store_true", help="also bench-multi-gpu on 2+ GPUs (~3-4 min)")
    p.add_argument("--out-dir", default=str(DEFAULT_OUT_DIR), help="where the report (gpu-report.json/.md) and "
                   "the log bundle (gpu-check-logs.txt) go, nothing else; a slot's $OUT (default: %(default)s)")
    return p


class Interrupted(BaseException):
    """SIGTERM (the slot ending) or Ctrl-C: the running check's tree is killed, the report says incomplete.

    A BaseException, as KeyboardInterrupt: the signal may land in a judge or in the FLOP count, whose
    ``except Exception`` would take it for their own error and carry on."""


def _interrupt(signum: int, frame: object) -> None:
    raise Interrupted(signal.Signals(signum).name)


def usable_out_dir(path: Path) -> Path:
    """``--out-dir`` made (with its parents) and checked writable before anything runs: found only when the first
    report is written, a file or read-only folder there would end the slot in a traceback, minutes in."""
    out_dir = path.resolve()
    if out_dir.exists() and not out_dir.is_dir():
        fail(f"--out-dir {path}: that is a file, not a folder; name a folder (a slot's $OUT)", PROG)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        fail(f"--out-dir {path}: cannot make that folder ({err.strerror}); name a folder you can write", PROG)
    if not os.access(out_dir, os.W_OK | os.X_OK):
        fail(f"--out-dir {path}: that folder is not writable; name a folder you can write", PROG)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    args = _parser().parse_args(argv)
    if args.batch_size < 1 or args.steps < 2 or args.warmup_steps < 1 or args.budget_s <= 0:
        fail("--batch-size must be >= 1, --steps >= 2, --warmup-steps >= 1 and --budget-s > 0", PROG)
    out_dir = usable_out_dir(Path(args.out_dir))
    checks = plan_checks(args, 0)  # --only is refused before the machine is inspected; planned again below
    scratch = Path(tempfile.mkdtemp(prefix="gpu-check-work-"))  # JPEGs, checkpoints, CSV logs: never brought back
    try:
        return _run(args, checks, started, out_dir, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _run(args: argparse.Namespace, checks: list[Check | Derived], started: float, out_dir: Path,
         scratch: Path) -> int:
    machine: Machine | None = None
    problem: tuple[str, str] | None = None
    flops: list[int | None] = []

    def report(results: list[Result], finished: bool) -> dict[str, Any]:
        if not flops and any(r["name"].startswith("resnet50-") and r["verdict"] == "pass" for r in results):
            flops.append(resnet50_flops(args.batch_size))
        peak, gpu = (machine.peak_flops_per_sec, machine.gpu) if machine else (None, None)
        rows = throughput_rows(results, flops[0] if flops else None, peak)
        built = build_report(results, machine.to_dict() if machine else {}, args.budget_s, time.monotonic() - started,
                             rows, reference_rows("bf16-mixed", peak, gpu), bench_settings(args), problem, finished,
                             only=args.only)
        write_logs(results, scratch, out_dir)
        write_report(built, out_dir)
        return built

    # The handlers come before anything slow: inspecting the machine (nvidia-smi, the C toolchain's probe) can
    # take minutes, and a stop then must still leave a report that says incomplete.
    previous = {s: signal.signal(s, _interrupt) for s in (signal.SIGTERM, signal.SIGINT)}
    results: list[Result] = []
    try:
        machine = inspect_machine(check_compile=args.compile or "compiled" in args.only)
        checks = plan_checks(args, machine.gpus)
        problem = machine.problem()
        if problem is not None:
            results = _not_run(checks, problem, machine)
        else:
            run_checks(checks, machine.gpus, scratch, args.budget_s, machine.compile_problem, started,
                       after_each=lambda done: report(done, False), into=results)
    except Interrupted as stop:
        if machine is None:
            results = [{"name": "machine", "what": "inspect the machine: GPUs, driver, versions, C toolchain",
                        "seconds": round(time.monotonic() - started, 1),
                        **verdict("incomplete", f"gpu-check was stopped ({stop}) while inspecting the machine")}]
        left = [c for c in checks if c.name not in {r["name"] for r in results}]
        results = results + [{"name": c.name, "what": c.what, "seconds": 0.0,
                              **verdict("incomplete", f"gpu-check was stopped ({stop}) before or during it")}
                             for c in left]
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    final = report(results, True)
    print(markdown(final))
    written = [out_dir / name for name in FILES]
    print(f"gpu-check: {final['verdict']} (exit {final['exit_code']}): {final['meaning']}; wrote {out_dir}: "
          + ", ".join(f"{p.name} ({p.stat().st_size} bytes)" for p in written), flush=True)
    return EXIT_CODES[final["verdict"]]


def _not_run(checks: list[Check | Derived], problem: tuple[str, str], machine: Machine) -> list[Result]:
    """A machine on which nothing can run: the machine's own row first, then every check with the reason."""
    status, reason = problem
    why = "no CUDA device" if status == "no verdict" else "torch sees no CUDA device"
    return [{"name": "cuda", "what": "torch sees the GPUs the driver shows", "seconds": 0.0, **verdict(status, reason)},
            *({"name": c.name, "what": c.what, "seconds": 0.0, **verdict("no verdict", why)} for c in checks)]

