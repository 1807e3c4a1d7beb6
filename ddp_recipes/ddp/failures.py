"""How a DDP job fails, told apart: a peer that died or hung, a rendezvous that never completed, a
torchrun restart on a stale store; and how a failed launcher stops its other ranks."""

from __future__ import annotations

import os
import re
import subprocess
import sys
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
ASYNC_ERROR_HANDLING_VARS = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING")  # new, old name
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
