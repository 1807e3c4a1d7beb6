"""``python -m ddp_recipes.bench overhead``: what the pack adds to a training step, against plain Lightning.

    python -m ddp_recipes.bench overhead --data-dir data --val-size 5000 --rounds 3
    python -m ddp_recipes.bench overhead --steps 600 --threads 1 --out bench-results/overhead.json

One process, one device. Each round fits the MNIST module twice, in alternating order: **pack** is the
MNIST recipe's path (``run_fit_test`` with the recipe's checkpoint callbacks, ``build_trainer``, the
resumable loader over in-memory tensors, diagnostics, CSV logs, progress bar) and **plain** is a
``lightning.Trainer`` a user would write for the same LightningModule and the same in-memory tensors
(a shuffled ``DataLoader``, the same CSV logger, log cadence and progress bar; its profiler times the
fetch as the pack's does, at the per-hook cost of Lightning's default profiler). Both are timed by the
same callback (host clock between consecutive training batch ends, epoch boundaries and validation
excluded, the first ``--warmup-steps`` dropped). The pack's own ``summary.json`` figures
(``train_samples_per_sec``, ``input_wait_fraction``) are recorded beside it. Each round then fits both once
more, untimed, for the ``--count-steps`` whole loop iterations after the warm-up, under
:class:`~ddp_recipes.bench.step_counts.StepCounts` (counting sends every op through Python, so it is never
timed): host reads and Python ``torch.distributed`` calls per step, for steps that do not log and for log
steps apart.

Writes ``--out`` (JSON: every round, medians, the spread of the per-round pack/plain ratio, the counts) and
prints one line: ``overhead pack/plain <median> (<min>-<max>) ...; host reads per step ...``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, TQDMProgressBar
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.profilers import Profiler
from torch.utils.data import DataLoader
from typing_extensions import override

from ddp_recipes.bench.step_counts import StepCounts, per_step
from ddp_recipes.config.choices import MNIST_ARCHS
from ddp_recipes.config.run_config import RunConfig
from ddp_recipes.data.base import TensorDataModule
from ddp_recipes.data.samplers import TensorBatchDataset, keep_batch
from ddp_recipes.errors import ConfigError
from ddp_recipes.train.perf import InputWaitProfiler

PROG = "python -m ddp_recipes.bench overhead"
LOG_EVERY_N_STEPS = 10  # make_trainer's cadence: both trainers log alike
PROGRESS_REFRESH = 20  # make_trainer's progress bar: both trainers draw alike


class StepTimer(Callback):
    """Host-clock seconds between consecutive training batch ends, outside epoch boundaries and validation;
    and apart, each later epoch's first batch (epoch start to its end: the sampler's permutation and
    whatever a loader does once per epoch, such as the pack's one-pass gather of in-memory rows)."""

    def __init__(self) -> None:
        self.intervals: list[float] = []
        self.waits: list[float | None] = []
        self.epoch_firsts: list[float] = []
        self._last: float | None = None
        self._epoch_start: float | None = None

    @override
    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._last = None
        # The first epoch's first batch is warm-up (allocator, first iteration): not counted.
        self._epoch_start = time.perf_counter() if trainer.current_epoch > 0 else None

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._last = None

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        now = time.perf_counter()
        if self._epoch_start is not None:
            self.epoch_firsts.append(now - self._epoch_start)
            self._epoch_start = None
        if self._last is not None:
            self.intervals.append(now - self._last)
            profiler = trainer.profiler
            self.waits.append(profiler.last_wait if isinstance(profiler, InputWaitProfiler) else None)
        self._last = now

    def figures(self, batch: int, warmup: int) -> dict[str, Any]:
        steady, waits = self.intervals[warmup:], self.waits[warmup:]
        if not steady:
            return {"samples_per_sec": None, "step_ms_median": None, "input_wait_fraction": None, "steps": 0}
        wait = sum(waits) / sum(steady) if all(w is not None for w in waits) else None
        # Every timed training batch, epoch starts included: what an implementation moved to the epoch
        # boundary still counts here.
        all_batches = batch * (len(steady) + len(self.epoch_firsts)) / (sum(steady) + sum(self.epoch_firsts))
        return {"samples_per_sec": round(batch * len(steady) / sum(steady), 1),
                "samples_per_sec_with_epoch_starts": round(all_batches, 1),
                "epoch_first_batch_ms_median": (round(1000 * statistics.median(self.epoch_firsts), 4)
                                                if self.epoch_firsts else None),
                "step_ms_median": round(1000 * statistics.median(steady), 4),
                "input_wait_fraction": round(wait, 4) if wait is not None else None, "steps": len(steady)}


class PlainProfiler(InputWaitProfiler):
    """The plain side's profiler: the pack's fetch timing (the same start/stop of ``train_dataloader_next``),
    at the cost of Lightning's default ``PassThroughProfiler``: a generator context around every hook, which
    the pack's profiler skips (it is part of what plain Lightning costs per step)."""

    profile = Profiler.profile


def load_data(data_dir: str, val_size: int, samples: int, seed: int) -> tuple[TensorBatchDataset, TensorBatchDataset]:
    """MNIST's train split normalised in memory as the recipe does (``data_dir``), or synthetic tensors of its
    shape; ``val_size`` images held out by a fixed-seed permutation, as MNISTDataModule does."""
    if data_dir:
        from ddp_recipes.data.mnist import load_split

        images, labels = load_split(data_dir, train=True)
    else:
        g = torch.Generator().manual_seed(seed)
        images, labels = torch.randn(samples, 1, 28, 28, generator=g), torch.randint(0, 10, (samples,), generator=g)
    if val_size >= len(labels):
        raise ConfigError(f"{{val_size}} {val_size} leaves no training data ({len(labels)} images)")
    perm = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    val, train = perm[:val_size], perm[val_size:]
    return TensorBatchDataset(images[train], labels[train]), TensorBatchDataset(images[val], labels[val])


def _length(args: argparse.Namespace, counter: StepCounts | None) -> int:
    """Steps of a timed fit, or of a counting fit (the warm-up, the counted iterations and the step whose
    start closes the last of them)."""
    return args.warmup_steps + (args.count_steps + 1 if counter else args.steps)


def _counting(args: argparse.Namespace, count: bool) -> StepCounts | None:
    return StepCounts(after=args.warmup_steps, count=args.count_steps) if count else None


def run_pack(args: argparse.Namespace, train: TensorBatchDataset, val: TensorBatchDataset, out: Path,
             count: bool = False) -> dict:
    """The MNIST recipe's fit (recipes.mnist.main without the flag parsing and the test pass); with ``count``,
    the counting fit instead (its counts only)."""
    from ddp_recipes.modules.mnist import MNISTClassifier
    from ddp_recipes.train.checkpoints import checkpoint_callbacks
    from ddp_recipes.train.run import run_fit_test

    counter = _counting(args, count)
    cfg = RunConfig(devices=1, accelerator=args.accelerator, max_steps=_length(args, counter),
                    batch_size=args.batch_size, seed=args.seed, output_dir=str(out), num_workers=0)
    timer = StepTimer()
    data = TensorDataModule(train, val, args.batch_size, args.seed)
    summary = run_fit_test(cfg, lambda: MNISTClassifier(arch=args.arch, lr=cfg.plan.lr), data,
                           callbacks=[*checkpoint_callbacks(cfg, len(val) > 0, MNISTClassifier), timer,
                                      *([counter] if counter else [])],
                           test=False, save_final=False)
    if counter:
        return per_step(counter.rows)
    return {**timer.figures(args.batch_size, args.warmup_steps),
            "summary_samples_per_sec": summary.get("train_samples_per_sec"),
            "summary_input_wait_fraction": summary.get("input_wait_fraction")}


def run_plain(args: argparse.Namespace, train: TensorBatchDataset, val: TensorBatchDataset, out: Path,
              count: bool = False) -> dict:
    """A plain ``lightning.Trainer`` on the same module and tensors, logging and drawing as the pack does;
    with ``count``, the counting fit instead (its counts only)."""
    from ddp_recipes.modules.mnist import MNISTClassifier

    L.seed_everything(args.seed, verbose=False)
    counter = _counting(args, count)
    timer = StepTimer()
    trainer = L.Trainer(accelerator=args.accelerator, devices=1, max_steps=_length(args, counter),
                        logger=CSVLogger(out, name="logs"), log_every_n_steps=LOG_EVERY_N_STEPS,
                        default_root_dir=out, profiler=PlainProfiler(),
                        callbacks=[TQDMProgressBar(refresh_rate=PROGRESS_REFRESH), timer,
                                   *([counter] if counter else [])])
    module = MNISTClassifier(arch=args.arch, lr=0.01)
    val_loader = DataLoader(val, batch_size=args.batch_size, collate_fn=keep_batch) if len(val) else None
    trainer.fit(module, DataLoader(train, batch_size=args.batch_size, shuffle=True, collate_fn=keep_batch),
                val_loader)
    return per_step(counter.rows) if counter else timer.figures(args.batch_size, args.warmup_steps)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every round, pack and plain interleaved (the order alternates), then medians and spreads."""
    if args.threads:
        torch.set_num_threads(args.threads)
    train, val = load_data(args.data_dir, args.val_size, args.samples, args.seed)
    rounds = []
    with tempfile.TemporaryDirectory(prefix="overhead-") as scratch:
        for r in range(args.rounds):
            order = ("plain", "pack") if r % 2 == 0 else ("pack", "plain")
            row: dict[str, Any] = {"round": r, "order": list(order)}
            for impl in order:
                out = Path(scratch) / f"{impl}-{r}"
                row[impl] = (run_pack if impl == "pack" else run_plain)(args, train, val, out)
            if args.count_steps:
                for impl in order:
                    out = Path(scratch) / f"{impl}-{r}-counted"
                    row[impl]["counts"] = (run_pack if impl == "pack" else run_plain)(args, train, val, out,
                                                                                       count=True)
            a, b = row["pack"]["samples_per_sec"], row["plain"]["samples_per_sec"]
            row["pack_over_plain"] = round(a / b, 4) if a and b else None
            a2, b2 = (row[k]["samples_per_sec_with_epoch_starts"] for k in ("pack", "plain"))
            row["pack_over_plain_with_epoch_starts"] = round(a2 / b2, 4) if a2 and b2 else None
            rounds.append(row)
            print(json.dumps({"round": r, "pack": a, "plain": b, "ratio": row["pack_over_plain"],
                              "pack_input_wait": row["pack"]["input_wait_fraction"]}), flush=True)
    config = {k: v for k, v in vars(args).items() if not callable(v)}  # the CLI's handler is no setting
    return {"config": config, "torch_version": torch.__version__, "lightning_version": L.__version__,
            "torch_threads": torch.get_num_threads(), "rounds": rounds, "summary": summarize(rounds)}


def _stats(values: list[float | None]) -> dict[str, float | None]:
    known = [v for v in values if v is not None]
    if not known:
        return {"median": None, "min": None, "max": None}
    return {"median": round(statistics.median(known), 4), "min": min(known), "max": max(known)}


def _best_ratio(rounds: list[dict[str, Any]]) -> float | None:
    """Pack's best round over plain's best: a noisy host only ever slows a fit, so each side's fastest round is
    its least disturbed one (the issue's "timed alike": interleaved runs, best of each)."""
    pack = [r["pack"]["samples_per_sec"] for r in rounds if r["pack"]["samples_per_sec"]]
    plain = [r["plain"]["samples_per_sec"] for r in rounds if r["plain"]["samples_per_sec"]]
    return round(max(pack) / max(plain), 4) if pack and plain else None


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    return {"pack_over_plain": _stats([r["pack_over_plain"] for r in rounds]),
            "pack_over_plain_best_of_each": _best_ratio(rounds),
            "pack_over_plain_with_epoch_starts": _stats([r["pack_over_plain_with_epoch_starts"] for r in rounds]),
            "pack_samples_per_sec": _stats([r["pack"]["samples_per_sec"] for r in rounds]),
            "plain_samples_per_sec": _stats([r["plain"]["samples_per_sec"] for r in rounds]),
            "pack_input_wait_fraction": _stats([r["pack"]["input_wait_fraction"] for r in rounds]),
            "plain_input_wait_fraction": _stats([r["plain"]["input_wait_fraction"] for r in rounds]),
            "pack_summary_input_wait_fraction": _stats([r["pack"]["summary_input_wait_fraction"] for r in rounds]),
            "counts": {impl: _counts([r[impl].get("counts") for r in rounds]) for impl in ("pack", "plain")}}


def _counts(rounds: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """Host reads and Python collectives (beyond DDP's own) per step over the rounds, for steps that do not log
    (``quiet``) and log steps (``log``): each the spread of the per-round means, the most in one iteration, and
    the iterations counted in all."""
    counted = [c for c in rounds if c]
    if not counted:
        return None
    out: dict[str, Any] = {}
    for kind in ("quiet", "log"):
        cells = [c[kind] for c in counted if c.get(kind)]
        out[kind] = {"iterations": sum(c["iterations"] for c in cells),
                     "reads": _stats([c["reads"] for c in cells]),
                     "reads_max": max(c["reads_max"] for c in cells),
                     "python": _stats([c["python"] for c in cells]),
                     "python_names": sorted({n for c in cells for n in c["python_names"]})} if cells else None
    return out


def _count_text(counts: dict[str, Any] | None, key: str) -> str:
    """``<steps without logging> (log steps <log steps>)``, each a median, with its range when rounds differ."""
    if not counts:
        return "not counted"

    def one(kind: str) -> str:
        cell = counts.get(kind)
        if not cell:
            return "-"
        s = cell[key]
        return f"{s['median']:g}" if s["min"] == s["max"] else f"{s['median']:g} ({s['min']:g}-{s['max']:g})"
    return f"{one('quiet')} (log steps {one('log')})"


def summary_line(result: dict[str, Any]) -> str:
    s = result["summary"]
    ratio, wait = s["pack_over_plain"], s["pack_input_wait_fraction"]
    whole = s["pack_over_plain_with_epoch_starts"]
    return (f"overhead pack/plain {ratio['median']} ({ratio['min']}-{ratio['max']}) over {len(result['rounds'])} "
            f"rounds ({whole['median']} ({whole['min']}-{whole['max']}) with epoch starts), best of each "
            f"{s.get('pack_over_plain_best_of_each')}; "
            f"samples/s pack {s['pack_samples_per_sec']['median']} plain {s['plain_samples_per_sec']['median']}; "
            f"pack input wait {wait['median']} ({wait['min']}-{wait['max']}) of step time; "
            f"host reads per step pack {_count_text(s['counts']['pack'], 'reads')} "
            f"plain {_count_text(s['counts']['plain'], 'reads')}; "
            f"Python collectives per step pack {_count_text(s['counts']['pack'], 'python')} "
            f"plain {_count_text(s['counts']['plain'], 'python')}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``bench overhead``."""
    p.add_argument("--data-dir", default="",
                   help="folder holding MNIST/raw (empty: synthetic tensors of MNIST's shape)")
    p.add_argument("--val-size", type=int, default=0, help="images held out for validation, as the recipe's --val-size")
    p.add_argument("--samples", type=int, default=20000, help="synthetic images when --data-dir is empty")
    p.add_argument("--arch", default="mlp", choices=MNIST_ARCHS, help="the MNIST module's network")
    p.add_argument("--batch-size", type=int, default=64, help="per-device batch (the recipe's default)")
    p.add_argument("--steps", type=int, default=400, help="timed steps per fit, after the warm-up")
    p.add_argument("--warmup-steps", type=int, default=20, help="step intervals dropped at the start of each fit")
    p.add_argument("--rounds", type=int, default=3, help="rounds of pack and plain, interleaved")
    p.add_argument("--count-steps", type=int, default=2 * LOG_EVERY_N_STEPS,
                   help="whole loop iterations after the warm-up counted per round in an untimed fit of each "
                        "(host reads, Python collectives; 0: none)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    p.add_argument("--accelerator", default="cpu", choices=("cpu", "cuda"), help="the device of both fits")
    p.add_argument("--seed", type=int, default=42, help="seed of the data split, the model and the order")
    p.add_argument("--out", default="bench-results/overhead.json", help="the JSON file to write")


def validate(args: argparse.Namespace) -> None:
    for name in ("batch_size", "steps", "rounds"):
        if getattr(args, name) < 1:
            raise ConfigError(f"{{{name}}} must be >= 1 (got {getattr(args, name)})")
    for name in ("val_size", "warmup_steps", "threads", "count_steps"):
        if getattr(args, name) < 0:
            raise ConfigError(f"{{{name}}} must be >= 0 (got {getattr(args, name)})")
    if args.data_dir and not (Path(args.data_dir) / "MNIST" / "raw").is_dir():
        raise ConfigError(f"{{data_dir}} {args.data_dir!r} has no MNIST/raw folder; pass the folder that holds it")
    if args.accelerator == "cuda" and not torch.cuda.is_available():
        raise ConfigError("{accelerator} cuda but no CUDA device is visible; use {accelerator} cpu")


def run_command(args: argparse.Namespace) -> int:
    """``bench overhead``: the rounds of pack and plain, the JSON written and the one-line summary."""
    from ddp_recipes.config.cli import fail

    try:
        validate(args)
    except ConfigError as err:
        fail(err.cli(), PROG)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's per-fit hints (num_workers, ...) would bury the figures
        result = run(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    print(summary_line(result))
    return 0
