"""``python -m benchmarks overhead``: what the pack adds to a training step, against plain Lightning.

    python -m benchmarks overhead --data-dir data --val-size 5000 --rounds 3
    python -m benchmarks overhead --steps 600 --threads 1 --out bench-results/overhead.json

The one-device MNIST view of ``benchmarks account``'s comparison (:func:`~benchmarks.account.run.measure`): each
round runs **plain** (``lightning.Trainer`` as a user writes it for the same LightningModule and in-memory
tensors: a shuffled ``DataLoader``, the same CSV logger, log cadence and progress bar) and **pack** (the
recipe's Trainer, the resumable loader over the recipe's in-memory MNIST split), each in a fresh process,
the order alternating; both timed alike (every training batch end to the next, the warm-up dropped). After
its timed steps each run counts ``--count-steps`` more whole loop iterations, untimed
(:class:`~benchmarks.account.step_counts.StepCounts`): host reads and Python ``torch.distributed`` calls per
step, for steps that do not log and for log steps apart.

Writes ``--out`` (JSON: every run, the per-round pack/plain ratio's median and range, the counts) and prints
one line: ``overhead pack/plain <median> (<min>-<max>) ...; host reads per step ...``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.account.run import by_round, measure, spread_of, summarize
from ddp_recipes.bench.harness.components import LOG_EVERY_N_STEPS
from ddp_recipes.bench.speedup.run import BenchConfig
from ddp_recipes.config.choices import MNIST_ARCHS
from ddp_recipes.errors import ConfigError

PROG = "python -m benchmarks overhead"
RUNS = ["plain", "pack"]


def settings_of(args: argparse.Namespace) -> dict[str, Any]:
    """The runs' settings, checked as ``make bench``'s (one device, MNIST, full precision as plain's default)."""
    if args.val_size < 0 or args.count_steps < 0 or args.threads < 0 or args.rounds < 1:
        raise ConfigError("{val_size}, {count_steps} and {threads} must be >= 0 and {rounds} >= 1")
    # Checked here, not by the speedup bench's config: there 0 means "fitted to the host", and its flags are
    # named otherwise (--threads-per-rank).
    for name in ("batch_size", "steps"):
        if getattr(args, name) < 1:
            raise ConfigError(f"{{{name}}} must be >= 1 (got {getattr(args, name)})")
    settings = BenchConfig(recipe="mnist", arch=args.arch, devices="1", steps=args.steps,
                           warmup_steps=args.warmup_steps, batch_size=args.batch_size, precision="32-true",
                           accelerator=args.accelerator, threads_per_rank=args.threads, data_dir=args.data_dir,
                           seed=args.seed, repeats=args.rounds).resolve()
    if args.val_size and not args.data_dir:
        raise ConfigError("{val_size} holds out real images: it needs {data_dir}")
    return {**settings, "val_size": args.val_size, "count_steps": args.count_steps}


def _best_ratio(rows: list[dict[str, Any]]) -> float | None:
    """Pack's best round over plain's best: a noisy host only ever slows a run, so each side's fastest round is
    its least disturbed one (runs interleaved, best of each)."""
    pack, plain = (list(by_round(rows, label, 1, "samples_per_s").values()) for label in ("pack", "plain"))
    return round(max(pack) / max(plain), 4) if pack and plain else None


def overhead_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """``benchmarks account``'s one-device summary of plain and pack, with the best of each and both input waits."""
    summary = summarize(rows, [1], [])["1"]

    def spread(label: str, key: str) -> dict[str, float] | None:
        return spread_of([v for v in by_round(rows, label, 1, key).values() if v is not None])
    return {"pack_over_plain": summary["pack_over_plain"], "pack_over_plain_best_of_each": _best_ratio(rows),
            **{f"{label}_{key}": spread(label, key) for label in RUNS for key in ("samples_per_s", "input_wait")},
            "counts": {label: summary["counts"][label] for label in RUNS}}


def _count_text(ranks: list[dict[str, Any]] | None, key: str) -> str:
    """``<steps without logging> (log steps <log steps>)``: the per-step count, its range where rounds differ."""
    if not ranks:
        return "not counted"

    def one(kind: str) -> str:
        cell = ranks[0][kind]
        if not cell or not cell.get(key):
            return "-"
        low, high = cell[key]["min"], cell[key]["max"]
        return f"{low:g}" if low == high else f"{low:g}-{high:g}"
    return f"{one('quiet')} (log steps {one('log')})"


def summary_line(result: dict[str, Any]) -> str:
    s = result["summary"]

    def med(stats: dict[str, float] | None, spread: bool = False, digits: int = 4) -> str:
        if not stats:
            return "-"
        mid = round(stats["median"], digits)
        return f"{mid} ({round(stats['min'], digits)}-{round(stats['max'], digits)})" if spread else f"{mid}"
    counts = s["counts"]
    return (f"overhead pack/plain {med(s['pack_over_plain'], True)} over {result['rounds']} rounds, best of each "
            f"{s['pack_over_plain_best_of_each']}; samples/s pack {med(s['pack_samples_per_s'], digits=1)} "
            f"plain {med(s['plain_samples_per_s'], digits=1)}; pack input wait "
            f"{med(s['pack_input_wait'], True)} of step time; host reads per step pack "
            f"{_count_text(counts['pack'], 'reads')} "
            f"plain {_count_text(counts['plain'], 'reads')}; Python collectives per step pack "
            f"{_count_text(counts['pack'], 'python')} plain {_count_text(counts['plain'], 'python')}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``benchmarks overhead``."""
    p.add_argument("--data-dir", default="",
                   help="folder holding MNIST/raw (empty: synthetic tensors of MNIST's shape)")
    p.add_argument("--val-size", type=int, default=0, help="images held out, as the recipe's --val-size")
    p.add_argument("--arch", default="mlp", choices=MNIST_ARCHS, help="the MNIST module's network")
    p.add_argument("--batch-size", type=int, default=64, help="per-device batch (the recipe's default)")
    p.add_argument("--steps", type=int, default=400, help="timed steps per run, after the warm-up")
    p.add_argument("--warmup-steps", type=int, default=20, help="steps run before timing starts")
    p.add_argument("--rounds", type=int, default=3, help="rounds of pack and plain, interleaved")
    p.add_argument("--count-steps", type=int, default=2 * LOG_EVERY_N_STEPS,
                   help="whole loop iterations counted after each run's timed steps, untimed "
                        "(host reads, Python collectives; 0: none)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (0: make bench's)")
    p.add_argument("--accelerator", default="cpu", choices=("cpu", "cuda"), help="the device of both runs")
    p.add_argument("--seed", type=int, default=42, help="seed of the data split, the model and the order")
    p.add_argument("--out", default="bench-results/overhead.json", help="the JSON file to write")


def run_command(args: argparse.Namespace) -> int:
    """``benchmarks overhead``: the rounds of plain and pack, the JSON written and the one-line summary."""
    from ddp_recipes.config.cli import fail

    try:
        settings = settings_of(args)
    except ConfigError as err:
        fail(err.cli(), PROG)
    with tempfile.TemporaryDirectory(prefix="overhead-") as scratch:
        rows = measure(settings, RUNS, args.rounds, Path(scratch),
                       progress=lambda m: print(m, file=sys.stderr, flush=True))
    result = {"settings": settings, "rounds": args.rounds, "rows": rows, "summary": overhead_summary(rows)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    print(summary_line(result))
    return 0
