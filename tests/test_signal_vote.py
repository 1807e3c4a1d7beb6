"""The preemption vote: every rank decides alike at the same step boundary, one boundary after the signal,
without a dispatched host read (``.item()``) in the step. Two real gloo processes."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

from tests.helpers import free_port

READS = {"aten::_local_scalar_dense", "aten::is_nonzero"}


class _CountReads(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name in READS:
            self.reads += 1
        return func(*args, **(kwargs or {}))


def _rank(rank: int, port: int, out: str) -> None:
    from ddp_recipes.checkpointing.preemption import _SignalVote

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    vote = _SignalVote(dist.new_group(backend="gloo"))
    seen, counter = [], _CountReads()
    with counter:
        for boundary in range(6):
            local = 15 if (rank == 1 and boundary == 2) else 0  # rank 1 alone is signalled, at boundary 2
            seen.append(vote.lagged(local))
    seen.append(vote.now(0))
    seen.append(vote.now(10 if rank == 0 else 0))  # the blocking vote sees this boundary's flag
    vote.close()
    torch.save({"seen": seen, "reads": counter.reads}, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.skipif(sys.platform == "win32", reason="gloo processes")
def test_every_rank_reads_the_same_vote_one_boundary_late_without_a_host_read(tmp_path):
    mp.start_processes(_rank, args=(free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert ranks[0]["seen"] == ranks[1]["seen"] == [0, 0, 0, 15, 0, 0, 0, 10]
    assert ranks[0]["reads"] == ranks[1]["reads"] == 0
