"""``python -m ddp_recipes.bench``: single- vs multi-device speedup, the pack beside a raw DDP loop.

    python -m ddp_recipes.bench                                   # defaults fitted to the host (see docs/benchmark.md)
    python -m ddp_recipes.bench --devices 1,2,4 --recipe resnet --arch resnet50 --image-size 224
    python -m ddp_recipes.bench predict --step-ms 97 --params 25.6e6 --devices 8 --link nvlink2
    python -m ddp_recipes.bench loader --data-dir /data/imagenet/train --workers 0,2,4,8
    python -m ddp_recipes.bench peak --device-name "NVIDIA H200" --precision bf16-mixed   # MFU's denominator

Without a command it measures the speedup (``ddp_recipes.bench.speedup.run``): every measured run is a fresh
set of processes (``ddp_recipes.bench.harness.worker``). Output in ``--out``: results.json, report.md (also
printed), speedup.png, and a final one-line summary. ``COMMAND --help`` shows a command's flags. The benchmarks
of the pack itself (``account``, ``overhead``, ``stops``, ``memory``) run from a clone: ``python -m benchmarks``.
"""

from __future__ import annotations

import argparse
import sys

from ddp_recipes.bench import commodel, loader
from ddp_recipes.bench.cli import config_parser
from ddp_recipes.bench.speedup import run as speedup
from ddp_recipes.config.cli import FlagParser, fail
from ddp_recipes.errors import ConfigError
from ddp_recipes.train.peaks import PEAK_PRECISIONS, format_table, peak

PROG = "python -m ddp_recipes.bench"
PEAK_PROG = f"{PROG} peak"
PEAK_DOC = """The peak FLOP/s a run's MFU is measured against (the table: ``ddp_recipes.train.peaks``).

    python -m ddp_recipes.bench peak --device-name "NVIDIA H200" --precision bf16-mixed
    python -m ddp_recipes.bench peak --precision 32-true            # the visible GPU, TF32 on (the default)
    python -m ddp_recipes.bench peak --device-name "NVIDIA A100-SXM4-80GB" --precision 32-true --no-tf32
    python -m ddp_recipes.bench peak --list                          # the pack's table with its sources

Prints one line: the dense figure and its source (the pack's table, or Lightning's for a GPU the table
has no row for), or ``unknown`` where neither knows the GPU (MFU is then null, never a guess).
"""


def peak_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``bench peak``."""
    p.add_argument("--device-name", default="", help="the GPU as torch.cuda.get_device_name spells it "
                                                     "(default: the visible GPU 0)")
    p.add_argument("--precision", default="bf16-mixed",
                   help=f"a run precision or a compute dtype: {', '.join(PEAK_PRECISIONS)}")
    p.add_argument("--no-tf32", dest="tf32", action="store_false",
                   help="32-true in full FP32 (the recipes' --no-tf32); by default TF32 is on, as in the pack")
    p.add_argument("--list", action="store_true", help="print the pack's table of dense peaks and exit")


def run_peak(args: argparse.Namespace) -> int:
    """``bench peak``: print the peak a run would use, or the whole table."""
    try:
        print(format_table() if args.list else
              peak(args.device_name or _visible_gpu(), args.precision, tf32=args.tf32).describe())
    except ConfigError as err:
        fail(err.cli(), PEAK_PROG)
    return 0


def _visible_gpu() -> str:
    """GPU 0's name, the default ``--device-name``; without a visible GPU the flag is required."""
    import torch

    if not torch.cuda.is_available():
        fail("--device-name is required without a visible CUDA GPU (e.g. --device-name \"NVIDIA H200\")", PEAK_PROG)
    return torch.cuda.get_device_name(0)


def build_cli() -> tuple[FlagParser, dict[str, argparse.ArgumentParser]]:
    """The bench's parser (the speedup bench's flags at the top, one subparser per command) and the subparsers
    by command name."""
    parser = config_parser(speedup.BenchConfig, PROG, __doc__)
    parser.set_defaults(run=speedup.run_command)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", prog=PROG, title="commands")
    raw = argparse.RawDescriptionHelpFormatter
    for name, help_text, description, add_arguments, run in (
        ("predict", "predicted DDP speedup from a single-device step time (the all-reduce model)",
         commodel.PREDICT_DOC, commodel.add_arguments, commodel.run_command),
        ("peak", "the peak FLOP/s a run's MFU is measured against", PEAK_DOC, peak_arguments, run_peak),
        ("loader", "images/s the CPUs decode per DataLoader worker count and decode path", loader.__doc__,
         loader.add_arguments, loader.run_command),
    ):
        sub = commands.add_parser(name, help=help_text, description=description, formatter_class=raw)
        add_arguments(sub)
        sub.set_defaults(run=run)
    return parser, commands.choices


def main(argv: list[str] | None = None) -> int:
    """``python -m ddp_recipes.bench [COMMAND] [flags]``; bad input exits 2 with one line naming the flag."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser, command_parsers = build_cli()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # said by the parser of the command they were given to
        command_parsers.get(args.command, parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command and argv[0] != args.command:
        parser.error(f"the bench's own flags go without a command: put {args.command} first, then its flags")
    args.command_argv = argv[1:] if args.command else argv  # as typed: bench loader's table quotes them
    return args.run(args)


if __name__ == "__main__":
    raise SystemExit(main())
