"""The bench's command lines: ``python -m ddp_recipes.bench`` and its subcommands (``ddp_recipes.bench.__main__``),
the checkout's ``tests.gpucheck``, ``bench.memory`` and ``bench.jpeg_folder`` all parse with the pack's one parser
class, :class:`~ddp_recipes.config.cli.FlagParser` (bad input: one line naming the flag, exit 2).
:func:`measuring_args` is the command line a generated table quotes (``bench account``, ``bench loader``).
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, TypeVar

from ddp_recipes.config.cli import FlagParser, HelpFormatter, build_parser

C = TypeVar("C")


def config_parser(cls: type, prog: str, description: str | None) -> FlagParser:
    """A :class:`~ddp_recipes.config.cli.FlagParser` with one flag per field of the config dataclass ``cls`` (the
    recipes' flags, from :func:`~ddp_recipes.config.cli.build_parser`), defaults shown in ``--help``."""
    return FlagParser(prog=prog, description=description, parents=[build_parser(cls)], add_help=False,
                         formatter_class=HelpFormatter)


def config_from(cls: type[C], args: argparse.Namespace) -> C:
    """``cls`` built from the parsed flags of its fields (a subcommand's namespace also holds the top level's)."""
    fields = [f for f in dataclasses.fields(cls) if f.init and not f.name.startswith("_")]  # type: ignore[arg-type]
    values: dict[str, Any] = {f.name: getattr(args, f.name) for f in fields}
    return cls(**values)


def measuring_args(argv: list[str]) -> list[str]:
    """The arguments that decide the figures: ``--out`` and ``--doc`` only say where they went (and a doc must
    not carry one machine's paths)."""
    kept: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--out", "--doc"):
            skip = True
        elif not arg.startswith(("--out=", "--doc=")):
            kept.append(arg)
    return kept
