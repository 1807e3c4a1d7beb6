"""`python -m ddp_recipes.doctor`: the "run a minimal init script first" tip as a command (the package
docstring lists the commands)."""

from __future__ import annotations

import os
from typing import Any

from ddp_recipes.config.cli import build_parser, fail
from ddp_recipes.doctor.checks import preflight
from ddp_recipes.doctor.config import DoctorConfig
from ddp_recipes.doctor.ranks import launch, run_rank
from ddp_recipes.doctor.report import json_report, print_outcome, print_preflight, verdict
from ddp_recipes.errors import ConfigError
from ddp_recipes.storage.store import write_json_atomic

PROG = "python -m ddp_recipes.doctor"


def main(argv: list[str] | None = None) -> int:
    """Run the doctor: 0 = PASS, 1 = FAIL (cause and fix printed), 2 = bad flags."""
    parser = build_parser(DoctorConfig, prog=PROG, description=__doc__.splitlines()[0])  # type: ignore[arg-type]
    try:
        cfg = DoctorConfig(**vars(parser.parse_args(argv)))
    except ConfigError as err:
        fail(err.cli(), parser.prog)
    rank = int(os.environ["RANK"]) if cfg.torchrun else cfg.node_rank * cfg.devices
    # A launcher speaks for its node; under torchrun rank 0 speaks, and another rank only for a failure
    # rank 0 cannot have seen (before the gather), pre-flight ones once per node.
    speaks = rank == 0 or not cfg.torchrun
    info, problems = preflight(cfg)
    if speaks:
        print_preflight(cfg, info)
        for p in problems[1:]:
            print(f"also: {p.cause} -- fix: {p.fix}")
    if problems:
        outcome: dict[str, Any] = problems[0].as_dict()
    elif cfg.torchrun:
        outcome = run_rank(cfg, rank, int(os.environ["LOCAL_RANK"]))
    else:
        outcome = launch(cfg)
    line = verdict(outcome)
    if speaks:
        print_outcome(cfg, outcome)
        print(line if rank == 0 else f"node {cfg.node_rank}: {line}", flush=True)
    elif not outcome["ok"] and not outcome.get("ranks") and (not problems or os.environ["LOCAL_RANK"] == "0"):
        print(f"rank {rank}: {line}", flush=True)
    if rank == 0 and cfg.json:
        write_json_atomic(cfg.json, json_report(cfg, info, problems, outcome))
    return 0 if outcome["ok"] else 1
