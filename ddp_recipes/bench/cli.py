"""The bench's command lines: ``python -m ddp_recipes.bench`` and its subcommands (``ddp_recipes.bench.__main__``),
the checkout's ``tests.gpucheck`` and ``benchmarks``, and ``bench.jpeg_folder`` all parse with the pack's one parser
class, :class:`~ddp_recipes.config.cli.FlagParser` (bad input: one line naming the flag, exit 2).
:func:`measuring_args` is the command line a generated table quotes and :func:`rewrite_doc` puts the table in a doc
(``bench loader``, the checkout's ``benchmarks account`` and ``stops``).
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
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


def rewrite_doc(path: Path, text: str, begin: str, end: str) -> None:
    """Replace what is between the ``begin`` and ``end`` markers in ``path`` with ``text`` (markers kept)."""
    doc = path.read_text()
    if begin not in doc or end not in doc or doc.index(begin) > doc.index(end):
        raise SystemExit(f"{path} has no {begin} ... {end} block to rewrite; add the two markers where the "
                         "table goes")
    head, rest = doc.split(begin, 1)
    _, tail = rest.split(end, 1)
    path.write_text(f"{head}{begin}\n{text}\n{end}{tail}")
