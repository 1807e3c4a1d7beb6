"""How a DDP job fails, told apart: a peer that died or hung, a rendezvous that never completed, a
torchrun restart on a stale store; and how a failed launcher stops its other ranks."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import threading
import time
from typing import Any

import torch

# What gloo, NCCL and the c10d store say when a peer process died or stopped calling collectives.
PEER_FAILURE_PATTERN = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|Timed out waiting \d+ms"
    r"|Watchdog caught collective operation timeout|NCCL communicator was aborted|ncclRemoteError"
    r"|failed to recv, got 0 bytes|Socket Timeout"
)
PEER_FAILURE_PREFIX = "DDP: a peer rank died or stopped responding"
# torchrun hands its workers its own rendezvous store; a restarted worker group then finds the previous
# attempt's process-group keys there and may connect to a dead rank's address (pytorch/pytorch#135712).
SHARED_STORE_FIX = ("launch with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 and --standalone (one node) or --rdzv-backend "
                    "c10d --rdzv-endpoint HOST:PORT (static --master-addr/--master-port rendezvous always shares it)")
CHILD_GRACE_S = 5.0  # how long a failed launcher waits for its other ranks to exit on their own


def restarts_share_store(env: Any) -> bool:
    """True under torchrun with --max-restarts > 0 whose workers use the agent's rendezvous store."""
    return env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and env.get("TORCHELASTIC_MAX_RESTARTS", "0") != "0"


def init_failure_hint(err: BaseException) -> str | None:
    """What to do when the process group cannot start, for the two causes a message can tell apart."""
    if restarts_share_store(os.environ) and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return ("DDP: torchrun restarted the workers on a store that still holds the previous attempt's "
                f"addresses; {SHARED_STORE_FIX}")
    if isinstance(err, torch.distributed.DistStoreError) or "clients joined" in str(err):
        return ("DDP: not every rank reached the rendezvous at MASTER_ADDR:MASTER_PORT within --timeout-s: start "
                "every node with the same --num-nodes and its own NODE_RANK, with node 0's address and port "
                "reachable from all (python -m ddp_recipes.doctor checks this)")
    return None


def is_peer_failure(exception: BaseException) -> bool:
    """True for the errors a rank gets when another rank died or stopped calling collectives."""
    return isinstance(exception, RuntimeError) and bool(PEER_FAILURE_PATTERN.search(str(exception)))


def stop_processes(procs: list[Any], grace_s: float) -> None:
    """Wait up to ``grace_s`` for the processes to exit, then SIGKILL (and reap) those still running.

    Takes ``subprocess.Popen`` (Lightning's default launcher) and ``multiprocessing`` processes (its
    ``spawn``/``fork`` launcher), which wait with ``join`` and have no ``wait``.
    """
    deadline = time.monotonic() + grace_s
    for rank, proc in enumerate(procs, start=1):
        left = max(0.0, deadline - time.monotonic())
        if isinstance(proc, subprocess.Popen):
            try:
                proc.wait(timeout=left)
                continue
            except subprocess.TimeoutExpired:
                pass
        else:
            proc.join(timeout=left)
            if not proc.is_alive():
                continue
        print(f"local rank {rank} (pid {proc.pid}) still running {grace_s:g} s after this rank failed: "
              "killing it", file=sys.stderr, flush=True)
        proc.kill()
        proc.wait() if isinstance(proc, subprocess.Popen) else proc.join()


HEARTBEAT_S = 5.0  # how often each rank proves it is alive through the rendezvous store
STALE_CAP_S = 120.0  # a peer silent this long is lost (capped below the collective timeout, see stale_after)
_WATCH_PREFIX = "ddp_recipes/peerwatch/"


def stale_after(timeout_s: float | None) -> float:
    """How long a silent peer may stay silent: under half the collective timeout, so this watch ends the rank
    with the pack's message before torch's NCCL watchdog aborts it (SIGABRT, no Python); never under three
    heartbeats, so a rank busy holding the GIL a few seconds is not taken for dead."""
    half = timeout_s / 2 if timeout_s else STALE_CAP_S
    return max(3 * HEARTBEAT_S, min(STALE_CAP_S, half))


class PeerWatch:
    """A heartbeat through the c10d store that ends this rank, with the pack's one-line message, when a peer dies.

    On NCCL a rank whose peer died waits inside a collective until torch's watchdog aborts the process from C++
    (no exception, no ``on_exception``, exit -6). Here each rank bumps its own counter every ``HEARTBEAT_S`` and
    watches the next rank's (a ring: three store requests per rank per beat at any world size); a counter that
    stops for ``stale_s`` means that rank is gone. The finder posts it under one shared key that every watcher
    reads, so every rank prints the message and exits (code 1) within about one beat of each other. Rank 0
    hosts the store: it exits last, once every other live rank has read the news (or after ``stale_s``: a
    rank that has not read it by then is lost too), so that no rank finds the store gone and blames rank 0
    for another rank's death. A rank that stops normally posts ``done``, and a store that stays unreachable
    for ``stale_s`` (its host, rank 0, died) counts as a lost rank 0. Runs outside the step: no cost on the
    training path.
    """

    def __init__(self, store: Any, rank: int, world_size: int, stale_s: float, hint: Any,
                 interval_s: float | None = None) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.stale_s, self.hint = stale_s, hint
        self.interval_s = HEARTBEAT_S if interval_s is None else interval_s
        self.peer = (rank + 1) % world_size
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.store.set(f"{_WATCH_PREFIX}beat/{self.rank}", "0")
        self._thread = threading.Thread(target=self._run, name="ddp-recipes-peer-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop watching; tell the rank that watches this one that it finished on purpose."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval_s)
            self._thread = None
        with contextlib.suppress(Exception):  # the store's host may already be gone after a normal end
            self.store.set(f"{_WATCH_PREFIX}beat/{self.rank}", "done")

    def _run(self) -> None:
        beats, last_value, last_change, store_ok = 0, None, time.monotonic(), time.monotonic()
        lost_key, peer_key = f"{_WATCH_PREFIX}lost", f"{_WATCH_PREFIX}beat/{self.peer}"
        while not self._stop.wait(self.interval_s):
            now = time.monotonic()
            try:
                beats += 1
                self.store.set(f"{_WATCH_PREFIX}beat/{self.rank}", str(beats))
                if self.store.check([lost_key]):
                    lost_rank = self.store.get(f"{_WATCH_PREFIX}lost_rank").decode()
                    return self._lose(self.store.get(lost_key).decode(), int(lost_rank))
                value = self.store.get(peer_key).decode() if self.store.check([peer_key]) else None
                store_ok = now
            except Exception:  # noqa: BLE001 - an unreachable store is the news here, not a bug
                if now - store_ok >= self.stale_s:
                    return self._lose(f"rank 0 (the rendezvous store's host) unreachable for {now - store_ok:.0f} s", 0)
                continue
            if value == "done":
                last_change = now  # finished on purpose: its silence from now on means nothing
            elif value != last_value:
                last_value, last_change = value, now
            elif now - last_change >= self.stale_s:
                what = f"rank {self.peer} silent for {now - last_change:.0f} s"
                with contextlib.suppress(Exception):
                    self.store.set(f"{_WATCH_PREFIX}lost_rank", str(self.peer))  # before the news that names it
                    self.store.set(lost_key, what)
                return self._lose(what, self.peer)

    def _lose(self, what: str, lost_rank: int) -> None:
        if self._stop.is_set():
            return
        print(f"[rank {self.rank}] {self.hint(what)}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        if self.rank == 0:
            self._keep_store_up(lost_rank)
        else:
            with contextlib.suppress(Exception):  # read: rank 0 may take the store down
                self.store.add(f"{_WATCH_PREFIX}read", 1)
        os._exit(1)  # the main thread is blocked in a collective: nothing short of exiting ends it

    def _keep_store_up(self, lost_rank: int) -> None:
        """Rank 0 hosts the store: wait until every other live rank has read the loss (at most ``stale_s``), so
        none of them finds the store gone first and blames rank 0."""
        others = self.world_size - 1 - (lost_rank != 0)
        deadline = time.monotonic() + self.stale_s
        while time.monotonic() < deadline:
            try:
                if self.store.add(f"{_WATCH_PREFIX}read", 0) >= others:
                    return
            except Exception:  # noqa: BLE001 - our own store: nothing left to wait for
                return
            time.sleep(min(0.05, self.interval_s / 4))
