"""The preemption vote: every rank stops at the same optimizer-step boundary, the one after the boundary where a
rank saw its signal, with no collective and no host read (``.item()``) at any step boundary. Two real gloo
processes; a blocking all-reduce per step stands in for DDP's gradient all-reduce, which is what orders the
ranks' steps (see :mod:`ddp_recipes.checkpointing.vote`)."""

from __future__ import annotations

import os
import random
import sys
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

from tests.helpers import free_port

READS = {"aten::_local_scalar_dense", "aten::is_nonzero"}
STEPS = 12


class _CountReads(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name in READS:
            self.reads += 1
        return func(*args, **(kwargs or {}))


def collectives() -> int:
    """Collectives issued so far on every process group of this process (each group's sequence number)."""
    from torch.distributed.distributed_c10d import _world

    return sum(pg._get_sequence_number_for_group() for pg in list(_world.pg_map))


class _NoClone:
    """A store without ``clone``: the vote falls back to a store lookup at every boundary."""

    def __init__(self, store) -> None:
        self._store = store

    def __getattr__(self, name):
        if name == "clone":
            raise AttributeError(name)
        return getattr(self._store, name)


class _SlowWatch:
    """A store whose second client (the watcher's) reads the announcement long after it was written, later than
    a step takes: only the announcer's wait for every rank's acknowledgement then keeps a rank from passing the
    stop step before it knows it."""

    LAG = 0.5  # seconds; a step here is at most 2 x jitter

    def __init__(self, store, lag: float = 0.0) -> None:
        self._store, self._lag = store, lag

    def clone(self):
        return _SlowWatch(self._store.clone(), self.LAG)

    def get(self, key):
        time.sleep(self._lag)
        return self._store.get(key)

    def __getattr__(self, name):
        return getattr(self._store, name)


STORES = {"watcher": lambda store: store, "store-read": _NoClone, "slow-watcher": _SlowWatch}


def _case(rank: int, case: int, plan: dict[int, tuple[int, int]], jitter: float, store_kind: str) -> dict:
    """Train STEPS "steps"; ``plan[rank] = (step, signum)``: the signal lands during that step (the flag is
    seen at its boundary). Returns the boundary this rank stopped at and what the boundaries cost."""
    from torch.distributed.distributed_c10d import _get_default_store

    from ddp_recipes.checkpointing.vote import StopVote

    store = dist.PrefixStore(f"case{case}/", _get_default_store())
    vote = StopVote(STORES[store_kind](store), rank, 2, torch.device("cpu"))
    rng = random.Random(rank * 7919 + case)
    grad = torch.ones(4)
    local, stopped, counted, reads = 0, None, 0, _CountReads()
    for step in range(1, STEPS + 1):
        time.sleep(rng.random() * jitter)  # forward/backward of unequal length on each rank
        dist.all_reduce(grad)  # DDP's gradient all-reduce of this step
        time.sleep(rng.random() * jitter)  # the optimizer step
        if plan.get(rank, (0, 0))[0] == step:
            local = plan[rank][1]
        before = collectives()
        with reads:
            signum = vote.at_boundary(step, local)
        counted += collectives() - before
        if signum:
            stopped = (step, signum)
            break
    at_end = vote.now(0) if stopped is None else None
    vote.close()
    return {"stopped": stopped, "collectives": counted, "reads": reads.reads, "at_end": at_end,
            "watcher_alive": vote._watcher is not None and vote._watcher.is_alive()}


def _rank(rank: int, port: int, out: str, cases: list) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # Ranks that disagree on the stop leave one rank in a collective the other never joins: an error, not a hang.
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=30))
    results = [_case(rank, i, *case) for i, case in enumerate(cases)]
    torch.save(results, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


SIGTERM, SIGUSR1 = 15, 10
# (plan, the (step, signal) both ranks stop at; signal None: either, as long as both agree; None: no step)
PLANS = [
    ({1: (3, SIGTERM)}, (4, SIGTERM)),  # one rank signalled: both stop at the next boundary
    ({0: (3, SIGUSR1), 1: (5, SIGTERM)}, (4, SIGUSR1)),  # both, at different steps: the first one decides
    ({0: (6, SIGTERM), 1: (6, SIGUSR1)}, (7, None)),  # both at the same boundary: one announcement stands
    ({1: (STEPS, SIGTERM)}, None),  # at the last boundary: no later step, the train-end vote sees it
    ({}, "none"),  # no signal: no stop, and the watchers end at close
]
CASES = [(plan, jitter, kind) for plan, _ in PLANS for jitter in (0.0, 0.02) for kind in STORES]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("vote")
    mp.start_processes(_rank, args=(free_port(), str(out), CASES), nprocs=2, start_method="spawn")
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


@pytest.mark.skipif(sys.platform == "win32", reason="gloo processes")
@pytest.mark.parametrize("index", range(len(CASES)),
                         ids=[f"plan{i // (2 * len(STORES))}-jitter{c[1]}-{c[2]}" for i, c in enumerate(CASES)])
def test_every_rank_stops_at_the_same_boundary_without_a_collective_or_host_read(ranks, index):
    """Watcher (a store client of its own; also one that hears the announcement late) and fallback (a store
    lookup at each boundary) alike."""
    stop = PLANS[index // (2 * len(STORES))][1]
    results = [ranks[r][index] for r in range(2)]
    first = [r["stopped"] for r in results]
    if stop == "none":
        assert first == [None, None] and [r["at_end"] for r in results] == [0, 0]
    elif stop is None:
        assert first == [None, None] and [r["at_end"] for r in results] == [SIGTERM, SIGTERM]
    else:
        assert first[0] == first[1] and first[0][0] == stop[0], first
        assert stop[1] is None or first[0][1] == stop[1]
    for r in results:
        assert r["collectives"] == 0 and r["reads"] == 0, r  # the boundaries cost no collective, no read
        assert not r["watcher_alive"]  # closed: no thread outlives the fit
