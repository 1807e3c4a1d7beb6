"""One rank of a PeerWatch scenario (tests/ddp/test_cuda_paths.py):
``python -m tests.scenarios.peerwatch_scenarios CASE RANK``.

The watch runs on gloo here, exactly as TunedDDPStrategy starts it on NCCL (the backend name is the only
thing faked): the main thread sleeps outside any collective, so only the watch can end it.

``python -m tests.scenarios.peerwatch_scenarios ring RANK WORLD``: the watch alone on a bare TCPStore (rank 0 hosts it,
as the process group's rank 0 does), no Lightning: rank 1 dies, every other rank must end blaming rank 1.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import LightningEnvironment

from ddp_recipes.ddp import failures
from ddp_recipes.ddp.strategy import TunedDDPStrategy


def main(case: str, rank: int) -> None:
    failures.HEARTBEAT_S = 0.2  # read at call time by PeerWatch and stale_after: a fast test, same logic
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    env = LightningEnvironment()
    env.set_world_size(2)
    env.set_global_rank(rank)
    strategy = TunedDDPStrategy(process_group_backend="nccl", cluster_environment=env, timeout=2.0,
                                parallel_devices=[torch.device("cpu")] * 2)
    watch = strategy.start_peer_watch()
    assert watch is not None and watch.stale_s == 1.0, watch  # half the 2 s timeout
    dist.barrier()
    if case == "die" and rank == 1:
        os._exit(3)  # a crash: no teardown, no goodbye
    if case == "finish" and rank == 1:
        watch.stop()  # what the strategy's teardown does
        dist.destroy_process_group()
        return
    time.sleep(8)
    print(f"rank {rank} slept to the end", flush=True)


def ring(rank: int, world: int) -> None:
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=rank == 0,
                          timeout=timedelta(seconds=60))
    # 3 s: a loaded test machine may stall a process for a second or two; that must not read as a death.
    watch = failures.PeerWatch(store, rank, world, stale_s=3.0,
                               hint=lambda what: f"{failures.PEER_FAILURE_PREFIX}: {what}", interval_s=0.2)
    watch.start()
    store.add("ready", 1)
    while store.add("ready", 0) < world:  # every rank beating before rank 1 dies
        time.sleep(0.05)
    time.sleep(0.5)
    if rank == 1:
        os._exit(3)
    time.sleep(20)
    print(f"rank {rank} slept to the end", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "ring":
        ring(int(sys.argv[2]), int(sys.argv[3]))
    else:
        main(sys.argv[1], int(sys.argv[2]))
