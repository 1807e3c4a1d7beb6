"""``python -m benchmarks COMMAND``: the developer benchmarks of the pack itself, run from a clone.

    python -m benchmarks account --doc docs/benchmark.md   # where the step time goes: raw, plain, each part
    python -m benchmarks overhead --data-dir data --val-size 5000   # the pack vs plain Lightning, 1 process
    python -m benchmarks stops --doc docs/resume-and-preemption.md   # a SIGTERM's, a SIGKILL's, a lost rank's cost

``python -m benchmarks.memory`` (peak memory per variant) has its own entry point. ``COMMAND --help`` shows a
command's flags; bad input exits 2 with one line naming the flag.
"""

from __future__ import annotations

import argparse
import sys

from benchmarks import stops
from benchmarks.account import overhead
from benchmarks.account import run as account
from ddp_recipes.config.cli import FlagParser

PROG = "python -m benchmarks"


def build_cli() -> tuple[FlagParser, dict[str, argparse.ArgumentParser]]:
    """The parser, one subparser per command (each with the flags it had under ``python -m ddp_recipes.bench``),
    and the subparsers by command name."""
    parser = FlagParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", prog=PROG, title="commands", required=True)
    for name, help_text, module in (
        ("account", "where the pack's step time goes, against plain Lightning and the raw loop", account),
        ("overhead", "what the pack adds to a training step, against plain Lightning (one process)", overhead),
        ("stops", "what a SIGTERM, a SIGKILL and a lost rank cost: seconds to exit, to the resumed first step, "
         "steps redone", stops),
    ):
        sub = commands.add_parser(name, help=help_text, description=module.__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(sub)
        sub.set_defaults(run=module.run_command)
    return parser, commands.choices


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks COMMAND [flags]``."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser, command_parsers = build_cli()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # said by the command's own parser: its prog, the flag it likely means
        command_parsers[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    args.command_argv = argv[1:]  # as typed: account's table quotes them
    return args.run(args)


if __name__ == "__main__":
    raise SystemExit(main())
