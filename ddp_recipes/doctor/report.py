"""What the doctor prints (set-up, rank table, nccl-tests-style sweep, verdict) and the ``--json`` report."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from ddp_recipes.doctor.checks import Failure
from ddp_recipes.doctor.config import DoctorConfig


def print_preflight(cfg: DoctorConfig, info: dict[str, Any]) -> None:
    v = info["versions"]
    print(f"doctor: {cfg.devices} process(es) x {cfg.num_nodes} node(s) = world {cfg.world_size}, backend "
          f"{cfg.backend}, accelerator {cfg.accelerator}, master {cfg.master_addr}:{cfg.master_port} "
          f"({cfg.port_from}), timeout {cfg.timeout_s:g} s")
    print(f"launched by: {info['launch']}")
    print(f"versions: torch {v['torch']} | CUDA {v['cuda']} ({v['cuda_gpus']} GPU) | NCCL {v['nccl'] or 'n/a'} | "
          f"gloo {'yes' if v['gloo'] else 'NO'} | lightning {v['lightning']} | python {v['python']}")
    print("NCCL/gloo env: " + (", ".join(f"{k}={val}" for k, val in info["comm_env"].items()) or "none set"))
    if "NCCL_ASYNC_ERROR_HANDLING" in info["comm_env"]:
        print("note: torch reads TORCH_NCCL_ASYNC_ERROR_HANDLING; NCCL_ASYNC_ERROR_HANDLING is the deprecated name")
    if cfg.backend == "nccl":
        print(f"hang forensics: on a collective timeout every rank dumps its last collectives to "
              f"{os.environ.get('TORCH_FR_DUMP_TEMP_FILE', '/tmp/nccl_trace_rank_')}<rank> (TunedDDPStrategy sets "
              "TORCH_FR_BUFFER_SIZE=2000, TORCH_NCCL_DUMP_ON_TIMEOUT=1); read them with python -m "
              "torch.distributed.flight_recorder.fr_trace <folder> to see which rank stopped at which collective")


def print_outcome(cfg: DoctorConfig, outcome: dict[str, Any]) -> None:
    if ranks := outcome.get("ranks"):
        print(f"{'rank':>4} {'local':>5} {'world':>5}  {'backend':<7} {'device':<8} {'host':<20} pid")
        for r in ranks:
            print(f"{r['rank']:>4} {r['local_rank']:>5} {r['world_size']:>5}  {r['backend']:<7} {r['device']:<8} "
                  f"{r['host']:<20} {r['pid']}")
        ok = ["ok" if all(r[k] for r in ranks) else "WRONG" for k in ("all_reduce_ok", "broadcast_ok")]
        print(f"all-reduce of (rank+1): expected {outcome['all_reduce_expected']:g} -> {ok[0]}; broadcast -> {ok[1]}")
    if rows := outcome.get("bandwidth"):
        print(f"all-reduce fp32, time averaged over ranks; busbw = algbw * 2(n-1)/n, n = {cfg.world_size}")
        print(f"{'size(B)':>10} {'count':>10} {'iters':>5} {'time(us)':>10} {'algbw(GB/s)':>11} {'busbw(GB/s)':>11}")
        for row in rows:
            print(f"{row['bytes']:>10} {row['count']:>10} {row['iters']:>5} {row['time_us']:>10.1f} "
                  f"{row['algbw_gbs']:>11.3f} {row['busbw_gbs']:>11.3f}")


def verdict(outcome: dict[str, Any]) -> str:
    """The last line: ``PASS``, or ``FAIL: <likely cause> -- fix: <fix>``."""
    return "PASS" if outcome["ok"] else f"FAIL: {outcome['cause']} -- fix: {outcome['fix']}"


def json_report(cfg: DoctorConfig, info: dict[str, Any], problems: list[Failure],
                outcome: dict[str, Any]) -> dict[str, Any]:
    """The ``--json`` file: the verdict, the resolved config, the pre-flight facts and problems, the outcome."""
    return {"result": verdict(outcome).split(":")[0], "config": dataclasses.asdict(cfg), "world_size": cfg.world_size,
            **info, "problems": [p.as_dict() for p in problems], **outcome}
