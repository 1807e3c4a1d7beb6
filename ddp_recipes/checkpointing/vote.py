"""Every rank agrees on a preemption signal at the same optimizer-step boundary, with no collective per step.

A signal handler only sets a flag; saving is collective, so the ranks must stop at one step. A flagged rank
announces the stop step ``t + 1`` in the rendezvous store (``compare_set``: the first stands); each rank's watcher
thread blocks in ``store.wait`` (no CPU, no GIL), so each boundary is an attribute read. DDP's per-step all-reduce
keeps every rank within one boundary of the others, so all stop at ``t + 1`` (docs/resume-and-preemption.md).
"""

from __future__ import annotations

import itertools
import os
import threading
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

STOP_KEY = "stop"  # "<step>:<signum>", or CLOSED once a rank has finished the fit
CLOSED = "closed"
ACK_TIMEOUT = timedelta(seconds=60)  # a rank that has not acknowledged by then is dead or hung
WATCH_POLL = timedelta(days=1)  # the watcher re-enters its wait after this; no message in between
_fits = itertools.count()  # one namespace per fit in this process; every rank runs the same fits


def _parse(value: bytes | str) -> tuple[int, int] | None:
    text = value.decode() if isinstance(value, bytes) else value
    if text == CLOSED:
        return None
    step, signum = text.split(":")
    return int(step), int(signum)


class StopVote:
    """The agreement of one fit; see the module docstring. ``store`` is shared by every rank."""

    def __init__(self, store: Any, rank: int, world_size: int, device: torch.device) -> None:
        self._store, self._rank, self._world, self._device = store, rank, world_size, device
        self._stop: tuple[int, int] | None = None  # (step, signum), written by the watcher or the announcer
        self._closed = False
        try:
            self._watch_store = store.clone()
        except (AttributeError, NotImplementedError, RuntimeError):
            self._watch_store = None  # polled at each boundary instead
        self._watcher: threading.Thread | None = None
        if self._watch_store is not None:
            self._watcher = threading.Thread(target=self._watch, name="ddp_recipes-stop-vote", daemon=True)
            self._watcher.start()

    @classmethod
    def open(cls, trainer: Any) -> StopVote | None:
        """A vote for this fit, or None with one rank (its own flag is the answer). Not collective."""
        if trainer.world_size == 1 or not (dist.is_available() and dist.is_initialized()):
            return None
        from torch.distributed.distributed_c10d import _get_default_store

        # torchrun keeps its store across restarts: each attempt, and each fit, gets its own keys.
        prefix = f"ddp_recipes/preemption/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{next(_fits)}/"
        store = dist.PrefixStore(prefix, _get_default_store())
        return cls(store, trainer.global_rank, trainer.world_size, trainer.strategy.root_device)

    def at_boundary(self, step: int, local: int) -> int:
        """At optimizer-step boundary ``step`` with this rank's signal ``local`` (0: none): the agreed signal
        when every rank stops here, else 0."""
        if self._stop is None and self._watch_store is None and self._store.check([STOP_KEY]):
            self._stop = _parse(self._store.get(STOP_KEY))
        if self._stop is None and local:
            self._announce(step + 1, local)
        if self._stop is not None and step >= self._stop[0]:
            return self._stop[1]
        return 0

    def now(self, local: int) -> int:
        """The signal any rank holds (a flag, or a stop it knows of), read at once by every rank: one blocking
        all-reduce (MAX) on the training group, for the epoch end and the train end."""
        known = self._stop[1] if self._stop else 0
        flag = torch.tensor([max(local, known)], dtype=torch.int32, device=self._device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.cpu().tolist()[0])

    def close(self) -> None:
        """End the watcher (every rank calls it at the end of the fit; a rank that failed need not)."""
        if self._closed:
            return
        self._closed = True
        watcher = self._watcher
        if watcher is not None and watcher.is_alive():
            try:
                # Wakes every rank's watcher; each rank calls this only after its last boundary.
                self._store.compare_set(STOP_KEY, "", CLOSED)
            except RuntimeError:
                return  # the store has gone with rank 0: the daemon thread ends with the process
            watcher.join(timeout=5)

    def abandon(self) -> None:
        """A failing rank: no more waiting for peers (the daemon watcher ends with the process)."""
        self._closed = True

    # ---- the announcement ---------------------------------------------------------------------------

    def _announce(self, step: int, signum: int) -> None:
        stop = _parse(self._store.compare_set(STOP_KEY, "", f"{step}:{signum}"))
        if stop is None:  # CLOSED: a rank has finished the fit; the train-end vote decides
            return
        self._stop = stop
        if self._watch_store is None:
            return  # every rank reads the store at each boundary: nothing to wait for
        acks = [f"ack/{rank}" for rank in range(self._world)]
        try:
            self._store.wait(acks, ACK_TIMEOUT)
        except dist.DistStoreError:  # the wait timed out
            # A rank that cannot acknowledge in a minute is gone or stuck; the others stop as announced,
            # and DDP's next all-reduce reports the lost peer if there is one.
            pass

    def _watch(self) -> None:
        store = self._watch_store
        while not self._closed:
            try:
                store.wait([STOP_KEY], WATCH_POLL)
            except dist.DistStoreError:
                # TCPStore's wait timing out (torch 2.11-2.15: "wait timeout after ..."); whatever its wording
                continue
            except RuntimeError:
                return  # the store is gone (rank 0 ended: DistNetworkError): nothing more to agree on
            try:
                stop = _parse(store.get(STOP_KEY))
                if stop is not None:
                    self._stop = stop
                    store.set(f"ack/{self._rank}", "1")
            except RuntimeError:
                pass
            return
