"""What a stop costs on this machine: a SIGTERM, a SIGKILL of the job, a lost rank.

    python -m benchmarks stops                          # 3 of each, the table on stdout
    python -m benchmarks stops --doc docs/resume-and-preemption.md   # and rewrite the table there

Each trial starts the ResNet recipe on synthetic 16 px images at 2 CPU ranks (a checkpoint every
``--checkpoint-every`` steps), stops it once its attempt record shows step ``--stop-at`` or more, measures the
seconds from the stop to the job's exit, reruns the same command with ``--resume auto`` at once, and reads the
resumed run's ``summary.json``: the seconds from the stop to its first step, and the steps it trained again.
Kinds run interleaved (sigterm, sigkill, lost-rank, then again), so a slow spell of the host is shared out.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ddp_recipes.checkpointing.run_folder.ownership import ATTEMPTS_DIR

KINDS = ("sigterm", "sigkill", "lost-rank")
BEGIN, END = "<!-- bench-stops:begin -->", "<!-- bench-stops:end -->"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeats", type=int, default=3, help="trials of each kind (default 3)")
    parser.add_argument("--max-steps", type=int, default=60, help="the run's length in steps (default 60)")
    parser.add_argument("--checkpoint-every", type=int, default=10,
                        help="--checkpoint-every-n-steps of the run: the most a SIGKILL can lose (default 10)")
    parser.add_argument("--stop-at", type=int, default=25, help="stop once the run has reached this step")
    parser.add_argument("--timeout-s", type=int, default=20, help="the run's --timeout-s (a lost rank's wait)")
    parser.add_argument("--out", type=Path, default=None, help="keep the runs' folders and results.json here")
    parser.add_argument("--doc", type=Path, default=None, help="rewrite the table between the bench-stops "
                        "markers in this file")


def _command(args: argparse.Namespace, out: Path, resume: bool) -> list[str]:
    return [sys.executable, "-m", "recipes.resnet", "--accelerator", "cpu", "--devices", "2", "--data", "synthetic",
            "--image-size", "16", "--synthetic-samples", "256", "--synthetic-val-samples", "0", "--batch-size", "8",
            "--no-cosine", "--max-steps", str(args.max_steps), "--checkpoint-every-n-steps",
            str(args.checkpoint_every), "--timeout-s", str(args.timeout_s), "--output-dir", str(out),
            *(["--resume", "auto"] if resume else [])]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def _reached(out: Path) -> int:
    try:
        return int(json.loads((out / ATTEMPTS_DIR / "1.json").read_text()).get("last_step") or 0)
    except (OSError, ValueError):
        return 0


def _rank1(launcher: int) -> int | None:
    """The job's rank 1: the launcher leads a session of its own, and Lightning starts the other ranks in its
    process group (field 3 after the name in ``/proc/PID/stat``)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == launcher:
            continue
        try:
            group = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[2])
            env = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if group == launcher and b"LOCAL_RANK=1" in env:
            return int(entry.name)
    return None


def trial(kind: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """One stop of ``kind`` and its resume: seconds to exit, seconds to the first resumed step, steps redone."""
    log = open(out.with_suffix(".log"), "w")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(_command(args, out, False), stdout=log, stderr=subprocess.STDOUT, env=_env(),
                            start_new_session=True)
    deadline = time.monotonic() + 600
    while _reached(out) < args.stop_at and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if proc.poll() is not None:
        raise SystemExit(f"benchmarks stops: the run ended before step {args.stop_at} (exit {proc.returncode}); see "
                         f"{out.with_suffix('.log')}")
    stopped = time.time()
    if kind == "sigterm":
        proc.send_signal(signal.SIGTERM)
    elif kind == "sigkill":
        os.killpg(proc.pid, signal.SIGKILL)
    else:
        rank1 = _rank1(proc.pid)
        os.kill(rank1 if rank1 is not None else proc.pid, signal.SIGKILL)
    code = proc.wait(timeout=args.timeout_s + 120)
    exit_s = time.time() - stopped
    if kind == "lost-rank":
        os.killpg(proc.pid, signal.SIGKILL) if _alive_group(proc.pid) else None  # workers left behind, if any
    resumed = subprocess.run(_command(args, out, True), stdout=log, stderr=subprocess.STDOUT, env=_env(),
                             timeout=900)
    log.close()
    summary = json.loads((out / "summary.json").read_text())
    stop = (summary.get("stops") or {}).get("stops", [{}])[-1]
    first = json.loads((out / ATTEMPTS_DIR / "2.json").read_text()).get("first_step_at")
    return {"kind": kind, "exit_code": code, "seconds_to_exit": round(exit_s, 2),
            "seconds_to_first_step": round(first - stopped, 2) if first else None,
            "steps_redone": stop.get("steps_redone"), "resumed_from_step": stop.get("resumed_from_step"),
            "resumed_exit": resumed.returncode, "final_steps": summary.get("steps")}


def _alive_group(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def table(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    def spread(values: list[float]) -> str:
        values = [v for v in values if v is not None]
        if not values:
            return "-"
        fmt = "g" if all(isinstance(v, int) for v in values) else ".1f"
        mid = statistics.median(values)
        return f"{mid:{fmt}}" if len(values) < 2 else f"{mid:{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"

    lines = ["| stop | exit code | seconds to exit | seconds to the first resumed step | steps redone |",
             "| --- | --- | --- | --- | --- |"]
    for kind in KINDS:
        rows = [r for r in results if r["kind"] == kind]
        if rows:
            codes = ", ".join(sorted({str(r["exit_code"]) for r in rows}))
            lines.append(f"| {kind} | {codes} | {spread([r['seconds_to_exit'] for r in rows])} | "
                         f"{spread([r['seconds_to_first_step'] for r in rows])} | "
                         f"{spread([r['steps_redone'] for r in rows])} |")
    lines += ["", f"Median (min-max) of {args.repeats} interleaved trials each: ResNet-18 on 16 px synthetic images, "
              f"2 CPU ranks x batch 8, a checkpoint every {args.checkpoint_every} steps, stopped at step "
              f"{args.stop_at} or just after, resumed at once. Generated by `python -m benchmarks stops`."]
    return "\n".join(lines)


def run_command(args: argparse.Namespace) -> int:
    from ddp_recipes.bench.cli import rewrite_doc

    root = args.out or Path(tempfile.mkdtemp(prefix="bench-stops-"))
    root.mkdir(parents=True, exist_ok=True)
    results = []
    for i in range(args.repeats):
        for kind in KINDS:
            result = trial(kind, args, root / f"{kind}-{i}")
            print(json.dumps(result), flush=True)
            results.append(result)
    (root / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    text = table(results, args)
    print(text)
    if args.doc is not None:
        rewrite_doc(args.doc, text, BEGIN, END)
    return 0
