"""``python -m benchmarks account``: where the pack's step time goes, against plain Lightning and the raw loop.

    python -m benchmarks account                           # make bench's workload, N=1,2, 3 rounds
    python -m benchmarks account --doc docs/benchmark.md   # and rewrite the table there
    python -m benchmarks account --from bench-results/account/account.json --doc docs/benchmark.md

Every round runs, at each N, the raw DDP loop, plain Lightning (``L.Trainer(strategy="ddp")``), the pack (the
recipe's Trainer) and the pack with each of its parts switched off alone (``--without``, see
:data:`~benchmarks.account.worker.PACK_COMPONENTS`), each in fresh processes, back to back, the order
reversed every other round. What a part costs is the paired difference pack - pack without it, per round;
Lightning's own loop is plain - raw; the gap is pack - raw. Beside them: the host time inside each part's
hooks (exact, from the same runs) and the CPU time of threads other than the training thread. The load
average before and after every run is recorded: a figure taken on a loaded host says so. After its timed
steps, each raw, plain and pack run counts ``--count-steps`` more whole loop iterations
(:mod:`benchmarks.account.step_counts`): host reads and collectives per step, on every rank.

Writes ``--out``/account.json and account.md; ``--doc FILE`` replaces the block between
``<!-- bench-account:begin -->`` and ``<!-- bench-account:end -->`` in FILE with the tables.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.account.worker import PACK_COMPONENTS
from ddp_recipes.bench.cli import measuring_args, rewrite_doc
from ddp_recipes.bench.harness.components import LOG_EVERY_N_STEPS
from ddp_recipes.bench.speedup import run as speedup
from ddp_recipes.errors import ConfigError

PROG = "python -m benchmarks account"
BASELINES = ("raw", "plain", "pack")


def labels(components: list[str]) -> list[str]:
    return [*BASELINES, *(f"pack-without-{c}" for c in components)]


def _load() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def measure(settings: dict[str, Any], runs: list[str], rounds: int, out: Path,
            progress: Any = print) -> list[dict[str, Any]]:
    """Every (round, label, N) run of the ``runs`` labels (:func:`labels`), interleaved as the speedup bench's
    (:func:`speedup.interleaved_schedule`), each by its runner (:func:`speedup.run_worker`); each row: the run's
    figures and the load around it. ``benchmarks overhead`` is the same comparison with only plain and pack."""
    devices = settings["devices"]
    plan = [(label, n) for n in devices for label in runs]
    schedule = speedup.interleaved_schedule(plan, rounds)
    rows = []
    for i, (round_no, label, n) in enumerate(schedule, 1):
        impl = label if label in BASELINES else "pack"
        run_settings = {**settings, "without": label.removeprefix("pack-without-") if impl != label else "",
                        "count_steps": settings.get("count_steps", 0) if impl == label else 0,
                        "worker": "benchmarks.account.worker"}  # the bench's worker with its counter and switches
        before, start = _load(), time.perf_counter()
        try:
            run = speedup.run_worker(impl, n, run_settings, out, tag=f"-{label}-round{round_no + 1}")
        except Exception as err:  # noqa: BLE001 - one failed run stays in the record, the others go on
            progress(f"[{i}/{len(schedule)}] {label} N={n}: failed: {str(err).splitlines()[0]}")
            rows.append({"round": round_no, "label": label, "devices": n, "error": str(err)[-2000:]})
            continue
        row = {"round": round_no, "label": label, "devices": n, "steps": run.get("measured_steps"),
               "step_ms": run["step_ms_median"],
               "samples_per_s": run["global_samples_per_s"], "input_wait": run.get("input_wait_fraction"),
               "threads": run.get("threads_per_rank"),
               "hooks": run.get("hook_ms_per_step_per_rank"), "counts": run.get("step_counts_per_rank"),
               "load_before": before, "load_after": _load(),
               "wall_s": round(time.perf_counter() - start, 1)}
        rows.append(row)
        progress(f"[{i}/{len(schedule)}] round {round_no + 1} {label} N={n}: {row['step_ms']:.1f} ms/step, "
                 f"load {before}->{row['load_after']} ({row['wall_s']:.0f} s)")
    return rows


def spread_of(values: list[float]) -> dict[str, float] | None:
    """Median, least, most and how many; None for no values."""
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def by_round(rows: list[dict[str, Any]], label: str, n: int, key: str = "step_ms") -> dict[int, float]:
    """{round: the ``key`` figure} of the ``label`` runs at N=``n``."""
    return {r["round"]: r[key] for r in rows if r["label"] == label and r["devices"] == n and key in r}


def paired(rows: list[dict[str, Any]], a: str, b: str, n: int, key: str = "step_ms", ratio: bool = False
           ) -> dict[str, float] | None:
    """a - b (or a / b) per round where both ran, summarised."""
    ra, rb = by_round(rows, a, n, key), by_round(rows, b, n, key)
    values = [ra[k] / rb[k] if ratio else ra[k] - rb[k] for k in ra if k in rb and (not ratio or rb[k])]
    return spread_of(values)


# A part measured inside another one (the vote is part of LastCheckpoint): not added twice.
INSIDE = {"vote": "last-checkpoint"}
# Which pack callbacks' hook time belongs to each part (None: the part has no hooks of its own).
HOOKS = {"vote": ("LastCheckpoint",), "last-checkpoint": ("LastCheckpoint",), "diagnostics": ("DDPDiagnostics",),
         "meter": ("ThroughputMeter",), "progress-bar": ("TQDMProgressBar",), "logger": ("TrackerRun",),
         "rank-watch": ("RankWatch",)}


def _hook_ms(rows: list[dict[str, Any]], n: int, names: tuple[str, ...]) -> dict[str, float] | None:
    """Host ms per step inside these callbacks' hooks in the pack runs (the slowest rank of each run)."""
    values = []
    for r in rows:
        if r["label"] == "pack" and r["devices"] == n and r.get("hooks"):
            values.append(max(sum(rank.get(name, 0.0) for name in names) for rank in r["hooks"] if rank))
    return spread_of(values)


def _threads(rows: list[dict[str, Any]], label: str, n: int) -> dict[str, Any] | None:
    runs = [r["threads"] for r in rows if r["label"] == label and r["devices"] == n and r.get("threads")]
    runs = [[t for t in run if t] for run in runs]
    if not runs or not all(runs):
        return None
    return {"threads": max(t["threads"] for run in runs for t in run),
            "other_cpu_ms": spread_of([max(t["other_threads_cpu_ms_per_step"] for t in run) for run in runs])}


COUNTED = ("reads", "python", "issued")  # benchmarks.account.step_counts.per_step's per-step means


def _counts(rows: list[dict[str, Any]], label: str, n: int) -> list[dict[str, Any]] | None:
    """Per rank, for steps that do not log (``quiet``) and log steps (``log``): each count's least and most
    per-step mean over the rounds, the iterations counted and the Python collectives' names."""
    runs = [r["counts"] for r in rows if r["label"] == label and r["devices"] == n and r.get("counts")]
    if not runs:
        return None
    out = []
    for rank in range(n):
        per_rank: dict[str, Any] = {}
        for kind in ("quiet", "log"):
            cells = [run[rank][kind] for run in runs if rank < len(run) and run[rank] and run[rank].get(kind)]
            per_rank[kind] = {
                **{key: None if any(c[key] is None for c in cells) else
                   {"min": min(c[key] for c in cells), "max": max(c[key] for c in cells)} for key in COUNTED},
                "iterations": sum(c["iterations"] for c in cells),
                "names": sorted({name for c in cells for name in c["python_names"]})} if cells else None
        out.append(per_rank)
    return out


def summarize(rows: list[dict[str, Any]], devices: list[int], components: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for n in devices:
        step = {label: spread_of(list(by_round(rows, label, n).values())) for label in labels(components)}
        gap = paired(rows, "pack", "raw", n)
        parts = {c: {"delta_ms": paired(rows, "pack", f"pack-without-{c}", n),
                     "hook_ms": _hook_ms(rows, n, HOOKS[c]) if c in HOOKS else None} for c in components}
        lightning = paired(rows, "plain", "raw", n)
        explained = (lightning["median"] if lightning else 0.0) + sum(
            p["delta_ms"]["median"] for c, p in parts.items()
            if p["delta_ms"] and INSIDE.get(c) not in components)
        out[str(n)] = {
            "step_ms": step, "gap_ms": gap, "lightning_ms": lightning,
            "pack_over_plain_ms": paired(rows, "pack", "plain", n),
            "parts": parts,
            "unexplained_ms": (gap["median"] - explained) if gap else None,
            "pack_over_raw": paired(rows, "pack", "raw", n, "samples_per_s", ratio=True),
            "pack_over_plain": paired(rows, "pack", "plain", n, "samples_per_s", ratio=True),
            "plain_over_raw": paired(rows, "plain", "raw", n, "samples_per_s", ratio=True),
            "threads": {label: _threads(rows, label, n) for label in BASELINES},
            "counts": {label: _counts(rows, label, n) for label in BASELINES},
        }
    loads = [r[k] for r in rows for k in ("load_before", "load_after") if r.get(k) is not None]
    out["load"] = spread_of(loads)
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``benchmarks account``."""
    p.add_argument("--devices", default="1,2", help="device counts, comma list (must include 1)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of every run")
    p.add_argument("--steps", type=int, default=20, help="timed steps per run, after the warm-up")
    p.add_argument("--warmup-steps", type=int, default=3, help="steps before timing starts")
    p.add_argument("--count-steps", type=int, default=LOG_EVERY_N_STEPS,
                   help="whole loop iterations counted after the timed steps of each raw, plain and pack run "
                        "(host reads, collectives; the default holds exactly one log step; 0: none)")
    p.add_argument("--components", default="all", help=f"pack parts to switch off, comma list of "
                                                         f"{', '.join(PACK_COMPONENTS)} (or all, or none)")
    p.add_argument("--arch", default="auto", help="network (auto: make bench's: resnet18 on CPU, resnet50 on CUDA)")
    p.add_argument("--batch-size", type=int, default=0, help="per-device batch (0: make bench's)")
    p.add_argument("--accelerator", default="auto", help="cpu, cuda or auto")
    p.add_argument("--threads-per-rank", type=int, default=0, help="torch threads per rank (0: make bench's)")
    p.add_argument("--out", default="bench-results/account", help="folder for account.json, account.md, runs/")
    p.add_argument("--doc", default="", help="a markdown file whose bench-account block is rewritten with the tables")
    p.add_argument("--from", dest="source", default="", help="an account.json to tabulate again instead of measuring")


def _components(text: str) -> list[str]:
    if text == "all":
        return list(PACK_COMPONENTS)
    names = [c.strip() for c in text.split(",") if c.strip() and c.strip() != "none"]
    unknown = [c for c in names if c not in PACK_COMPONENTS]
    if unknown:
        raise ConfigError(f"{{components}} {unknown[0]!r} is not a pack part; choose from {', '.join(PACK_COMPONENTS)}")
    return names


def run_command(args: argparse.Namespace) -> int:
    """``benchmarks account``: measure (or read ``--from``), write account.json/.md, print and rewrite ``--doc``."""
    from benchmarks.account.report import BEGIN, END, markdown
    from ddp_recipes.bench.hostinfo import host_facts
    from ddp_recipes.config.cli import fail

    try:
        components = _components(args.components)
        if args.rounds < 1 or args.steps < 2 or args.warmup_steps < 1 or args.count_steps < 0:
            raise ConfigError("{rounds} must be >= 1, {steps} >= 2, {warmup_steps} >= 1 and {count_steps} >= 0")
        if args.doc and not Path(args.doc).is_file():
            raise ConfigError(f"{{doc}} {args.doc!r} is not a file")
        if args.source:
            result = json.loads(Path(args.source).read_text())
        else:
            settings = speedup.BenchConfig(devices=args.devices, steps=args.steps, warmup_steps=args.warmup_steps,
                                   arch=args.arch, batch_size=args.batch_size, accelerator=args.accelerator,
                                   threads_per_rank=args.threads_per_rank).resolve()
            settings["count_steps"] = args.count_steps
    except (ConfigError, OSError, ValueError) as err:
        fail(err.cli() if isinstance(err, ConfigError) else str(err), PROG)
    if not args.source:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        started = datetime.datetime.now().astimezone().isoformat(timespec="minutes")
        command = " ".join([PROG, *measuring_args(args.command_argv)])
        load_start = _load()
        rows = measure(settings, labels(components), args.rounds, out,
                       progress=lambda m: print(m, file=sys.stderr, flush=True))
        result = {"command": command, "started": started, "host": host_facts(), "settings": settings,
                  "components": components, "rounds": args.rounds, "load_start": load_start, "load_end": _load(),
                  "rows": rows}
        result["summary"] = summarize(rows, settings["devices"], components)
        (out / "account.json").write_text(json.dumps(result, indent=2) + "\n")
        (out / "account.md").write_text(markdown(result) + "\n")
        print(f"wrote {out / 'account.json'}, {out / 'account.md'}")
    text = markdown(result)
    print(text)
    if args.doc:
        rewrite_doc(Path(args.doc), text, BEGIN, END)
        print(f"rewrote the bench-account block of {args.doc}")
    return 0
