"""`python -m ddp_recipes.doctor`: the "run a minimal init script first" tip as a command.

Pre-flight checks on the launcher (flags, MASTER_ADDR/PORT, NCCL/gloo variables, versions), then on every
rank: rendezvous, an exact all-reduce and a broadcast, and an all-reduce latency/bandwidth sweep reported
like nccl-tests. Ends with ``PASS`` (exit 0) or ``FAIL: <likely cause> -- fix: <fix>`` (exit 1); bad flags
exit 2. Every wait is bounded by --timeout-s, so it never hangs.

    python -m ddp_recipes.doctor                                  # all local GPUs, else 2 CPU processes
    python -m ddp_recipes.doctor --accelerator cpu --max-bytes 1M --json doctor.json
    python -m ddp_recipes.doctor --num-nodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500
    torchrun --nproc-per-node 4 -m ddp_recipes.doctor             # torchrun's processes are the ranks

Modules: ``config`` (DoctorConfig: the flags, resolved against torchrun or for spawning), ``checks``
(pre-flight checks and the diagnosis of a failure), ``sweep`` (the bandwidth sweep), ``ranks`` (what each
rank checks; starting and waiting for this node's ranks), ``report`` (printing and the --json report),
``cli`` (``main``); ``__main__`` is the entry point.
"""

from __future__ import annotations

import torch  # noqa: F401 - ``doctor.torch`` stays reachable, as before the split

from ddp_recipes.config.choices import BACKENDS
from ddp_recipes.doctor.checks import (
    COMM_VARS,
    DEBUG_FIX,
    Failure,
    classify,
    ifname_problem,
    is_loopback,
    port_in_use,
    port_problem,
    preflight,
    versions,
)
from ddp_recipes.doctor.cli import main
from ddp_recipes.doctor.config import TORCHRUN_FLAGS, TORCHRUN_VARS, DoctorConfig
from ddp_recipes.doctor.ranks import launch, run_rank
from ddp_recipes.doctor.report import json_report, print_outcome, print_preflight, verdict
from ddp_recipes.doctor.sweep import (
    CPU_BYTES_BUDGET,
    MIN_BYTES,
    UNITS,
    bandwidth_sweep,
    bus_bandwidth,
    parse_bytes,
    sweep_sizes,
)

__all__ = ["BACKENDS", "COMM_VARS", "CPU_BYTES_BUDGET", "DEBUG_FIX", "MIN_BYTES", "TORCHRUN_FLAGS", "TORCHRUN_VARS",
           "UNITS", "DoctorConfig", "Failure", "bandwidth_sweep", "bus_bandwidth", "classify", "ifname_problem",
           "is_loopback", "json_report", "launch", "main", "parse_bytes", "port_in_use", "port_problem", "preflight",
           "print_outcome", "print_preflight", "run_rank", "sweep_sizes", "verdict", "versions"]
