"""``python -m ddp_recipes.bench peak``: the peak FLOP/s a run's MFU is measured against.

    python -m ddp_recipes.bench peak --device-name "NVIDIA H200" --precision bf16-mixed
    python -m ddp_recipes.bench peak --precision 32-true            # the visible GPU, TF32 on (the default)
    python -m ddp_recipes.bench peak --device-name "NVIDIA A100-SXM4-80GB" --precision 32-true --no-tf32
    python -m ddp_recipes.bench peak --list                          # the pack's table with its sources

Prints one line: the dense figure and its source (the pack's table, or Lightning's for a GPU the table
has no row for), or ``unknown`` where neither knows the GPU (MFU is then null, never a guess).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from ddp_recipes.config.cli import fail
from ddp_recipes.errors import ConfigError
from ddp_recipes.train.peaks import PEAK_PRECISIONS, format_table, peak

PROG = "python -m ddp_recipes.bench peak"


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # type: ignore[override]
        fail(message, self.prog)


def _parser() -> argparse.ArgumentParser:
    p = _OneLineParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device-name", default="", help="the GPU as torch.cuda.get_device_name spells it "
                                                     "(default: the visible GPU 0)")
    p.add_argument("--precision", default="bf16-mixed",
                   help=f"a run precision or a compute dtype: {', '.join(PEAK_PRECISIONS)}")
    p.add_argument("--no-tf32", dest="tf32", action="store_false",
                   help="32-true in full FP32 (the recipes' --no-tf32); by default TF32 is on, as in the pack")
    p.add_argument("--list", action="store_true", help="print the pack's table of dense peaks and exit")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.list:
        print(format_table())
        return 0
    name = args.device_name
    if not name:
        import torch

        if not torch.cuda.is_available():
            fail("--device-name is required without a visible CUDA GPU (e.g. --device-name \"NVIDIA H200\")", PROG)
        name = torch.cuda.get_device_name(0)
    try:
        print(peak(name, args.precision, tf32=args.tf32).describe())
    except ConfigError as err:
        fail(err.cli(), PROG)
    return 0
