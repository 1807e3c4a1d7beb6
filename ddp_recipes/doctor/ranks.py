"""The doctor's ranks: what each one checks, and how this node's ranks are started and waited for (spawned
ranks import this module by name, not ``__main__``; under torchrun each process calls :func:`run_rank`)."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ddp_recipes.doctor.checks import DEBUG_FIX, Failure, classify
from ddp_recipes.doctor.config import DoctorConfig
from ddp_recipes.doctor.sweep import bandwidth_sweep
from ddp_recipes.storage.store import write_json_atomic


def run_rank(cfg: DoctorConfig, rank: int, local_rank: int) -> dict[str, Any]:
    """One rank: rendezvous, exact checks, gather, sweep. Never raises: a failure comes back diagnosed."""
    os.environ.update(MASTER_ADDR=cfg.master_addr, MASTER_PORT=str(cfg.master_port), RANK=str(rank),
                      LOCAL_RANK=str(local_rank), WORLD_SIZE=str(cfg.world_size))
    device = torch.device("cuda", local_rank) if cfg.accelerator == "cuda" else torch.device("cpu")
    if cfg.backend == "nccl":
        # A hung collective then raises here after --timeout-s (and is diagnosed) instead of torch's watchdog
        # aborting the rank from C++ (SIGABRT, "exited with code -6"). The doctor's waits are all explicit.
        os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "1")
    phase, outcome, world = "init", {"ok": True, "rank": rank}, cfg.world_size
    try:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(cfg.backend, init_method="env://", rank=rank, world_size=world,
                                timeout=timedelta(seconds=cfg.timeout_s))
        phase = "check"
        # An odd length, so that chunked/ring algorithms also reduce a ragged last chunk.
        x = torch.full((65_537,), float(rank + 1), device=device)
        dist.all_reduce(x)
        expected = world * (world + 1) / 2  # small integers: exact in fp32, so == is the right test
        payload = torch.arange(65_537, dtype=torch.float32, device=device)
        y = payload.clone() if rank == 0 else torch.zeros_like(payload)
        dist.broadcast(y, src=0)
        mine = {"rank": rank, "local_rank": local_rank, "world_size": dist.get_world_size(),
                "backend": dist.get_backend(), "device": str(device), "host": socket.gethostname(), "pid": os.getpid(),
                "all_reduce_ok": bool(torch.all(x == expected)), "all_reduce_got": [x.min().item(), x.max().item()],
                "broadcast_ok": bool(torch.equal(y, payload))}
        ranks: list[Any] = [None] * world
        dist.all_gather_object(ranks, mine)
        outcome.update(ranks=ranks, all_reduce_expected=expected)
        wrong = [r for r in ranks if not (r["all_reduce_ok"] and r["broadcast_ok"])]
        if wrong:  # every rank gathered the same list, so all of them stop here together
            what = "all-reduce" if not wrong[0]["all_reduce_ok"] else "broadcast from rank 0"
            raise Failure(f"{what} gave wrong values on rank(s) {[r['rank'] for r in wrong]} (all-reduce min/max "
                          f"{wrong[0]['all_reduce_got']}, expected {expected:g}): data is corrupted in transit",
                          "suspect the GPU peer-to-peer path: rerun with NCCL_P2P_DISABLE=1 (then NCCL_SHM_DISABLE=1)"
                          " and NCCL_DEBUG=INFO; on CPU, check GLOO_SOCKET_IFNAME")
        phase = "bandwidth"
        outcome["bandwidth"] = bandwidth_sweep(cfg, device)
    except Exception as err:  # noqa: BLE001 - every failure becomes a diagnosis, never a traceback or a hang
        outcome.update(classify(err, cfg, phase, rank).as_dict())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return outcome


def _spawned(local_rank: int, cfg: DoctorConfig, out_dir: str) -> None:
    rank = cfg.node_rank * cfg.devices + local_rank
    outcome = run_rank(cfg, rank, local_rank)
    write_json_atomic(os.path.join(out_dir, f"rank{rank}.json"), outcome, indent=None)  # never half a file
    if not outcome["ok"]:
        sys.exit(1)  # the launcher then stops the peers now rather than at the timeout


def launch(cfg: DoctorConfig) -> dict[str, Any]:
    """Spawn this node's ranks, wait no longer than the deadline, and merge their outcomes."""
    # Rendezvous may use timeout_s and the collectives after it another timeout_s; 30 s covers start-up.
    limit = 2 * cfg.timeout_s + 30
    deadline, first = time.monotonic() + limit, cfg.node_rank * cfg.devices
    with tempfile.TemporaryDirectory(prefix="ddp-doctor-") as out_dir:
        context = mp.start_processes(_spawned, args=(cfg, out_dir), nprocs=cfg.devices, join=False,
                                     start_method="spawn")
        try:
            while not context.join(timeout=max(0.0, min(1.0, deadline - time.monotonic())), grace_period=3):
                if time.monotonic() >= deadline:
                    break
        except (mp.ProcessRaisedException, mp.ProcessExitedException):
            pass  # a rank failed: its file, or its exit code, says why
        hung = [first + i for i, p in enumerate(context.processes) if p.is_alive()]
        outcomes = {}
        for i, p in enumerate(context.processes):
            if p.is_alive():
                p.kill()
                p.join(5)
            path = os.path.join(out_dir, f"rank{first + i}.json")
            if os.path.exists(path):
                with open(path) as fh:
                    outcomes[first + i] = json.load(fh)
            elif p.exitcode == -signal.SIGABRT:  # torch's NCCL watchdog (a user's TORCH_NCCL_BLOCKING_WAIT=0)
                outcomes[first + i] = Failure(f"rank {first + i} was aborted by torch's NCCL watchdog: a collective "
                                              f"hung past --timeout-s {cfg.timeout_s:g}", DEBUG_FIX).as_dict()
            elif first + i not in hung and p.exitcode != -signal.SIGTERM:  # SIGTERM: we stopped a failed rank's peer
                outcomes[first + i] = Failure(f"rank {first + i} exited with code {p.exitcode} before reporting "
                                              "(crash, OOM kill or signal)", "check dmesg; " + DEBUG_FIX).as_dict()
    # Root causes first: "lost a peer" is a symptom of whichever rank failed on its own.
    failures = sorted((o for o in outcomes.values() if not o["ok"]), key=lambda o: (o["secondary"], o.get("rank", 0)))
    if hung:
        failures.append(Failure(f"rank(s) {hung} still running after {limit:g} s: stuck in rendezvous or a "
                                "collective", DEBUG_FIX).as_dict())
    merged = dict(outcomes.get(first, {}))
    merged.update(failures[0] if failures else {"ok": True})
    return merged
