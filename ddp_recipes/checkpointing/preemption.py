"""Preemption: signal handlers that only record the signal, the SLURM requeue, and ranks that follow their launcher.

A rank cannot act on a signal where it lands: a collective started from a handler (Lightning 2.6 broadcasts from
its SIGTERM handler; its SLURM handler saves, which gathers) pairs with whatever collective the others are in.
So the handlers only set a flag; the ranks agree at optimizer-step boundaries through the rendezvous store
(:class:`~ddp_recipes.checkpointing.vote.StopVote`), save ``last.ckpt`` together, rank 0 requeues SLURM if asked
(:func:`requeue_slurm_job`), and every rank exits with 128 + signal and one line (docs/resume-and-preemption.md).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Any

import lightning as L
from lightning.fabric.plugins.environments import SLURMEnvironment

from ddp_recipes.lightning_seam import reach

LAUNCHER_PID_VAR = "DDP_RECIPES_LAUNCHER_PID"  # in the environment of the ranks Lightning launched, only


def tag_children_with_launcher(launcher: Any) -> None:
    """Make the ranks Lightning's subprocess launcher starts know their launcher's pid (for
    :func:`die_with_launcher`), set only while the children are started."""
    def tagged(start_children: Any) -> Any:
        def call_children_scripts(*args: Any, **kwargs: Any) -> Any:
            os.environ[LAUNCHER_PID_VAR] = str(os.getpid())
            try:
                return start_children(*args, **kwargs)
            finally:
                os.environ.pop(LAUNCHER_PID_VAR, None)
        return call_children_scripts

    reach.wrap_children_start(launcher, tagged)


def die_with_launcher(enable: bool = True) -> bool:
    """Have the kernel send this rank SIGTERM when the rank that launched it exits (Linux only); with
    ``enable=False``, stop that again (at teardown: a rank's own work after ``fit`` must not die with rank 0).

    If rank 0 dies during set-up, a child waiting in the rendezvous would otherwise wait out the whole
    process-group timeout. Only ranks Lightning's launcher started (:func:`tag_children_with_launcher`)."""
    launcher = os.environ.get(LAUNCHER_PID_VAR, "")
    if not sys.platform.startswith("linux") or not launcher.isdigit() or int(launcher) == os.getpid():
        return False
    try:
        import ctypes

        pr_set_pdeathsig = 1
        signum = int(signal.SIGTERM) if enable else 0
        linked = ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signum, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False
    if enable and os.getppid() != int(launcher):  # it exited before the kernel could be told: follow it now
        print(f"rank 0 (pid {launcher}), which launched this rank, has exited: stopping", file=sys.stderr,
              flush=True)
        raise SystemExit(128 + signal.SIGTERM)
    return linked


class Preempted(SystemExit):
    """Raised on every rank after the preemption checkpoint is saved; exits with ``128 + signum``."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(128 + signum)
        self.signum = signum
        self.message = message


def skip_sigterm_broadcast(trainer: L.Trainer) -> None:
    """Take out Lightning's per-step SIGTERM broadcast (a collective and a device-to-host read before every
    batch at 2+ ranks): under the pack's ``FlagSignalConnector`` its flag stays False (the stop is agreed through
    the rendezvous store, :mod:`~ddp_recipes.checkpointing.vote`), so it can only ever say "go on"."""
    reach.replace_sigterm_broadcast(trainer, _agreed_elsewhere)


SIGTERM_BROADCAST = reach.SIGTERM_BROADCAST  # the tests' name for it


def _agreed_elsewhere() -> None:
    """The stop is agreed at step boundaries by the pack's vote: nothing to broadcast."""


def requeue_slurm_job(trainer: L.Trainer, signum: int) -> str:
    """Requeue the SLURM job from rank 0 when ``signum`` is its requeue signal and Lightning's SLURM
    environment has ``auto_requeue``; returns the words the preemption message adds (empty: none)."""
    env = reach.cluster_environment(trainer)
    if not (isinstance(env, SLURMEnvironment) and env.auto_requeue and signum == env.requeue_signal):
        return ""
    array_job, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    job_id = f"{array_job}_{task}" if array_job and task else os.environ.get("SLURM_JOB_ID", "")
    if not trainer.is_global_zero or not job_id:
        return f"; SLURM job {job_id} requeued by rank 0" if job_id else ""
    try:
        result = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60)
        ok = result.returncode == 0
        detail = (result.stderr or result.stdout).strip().splitlines()[-1:] if not ok else []
    except (OSError, subprocess.TimeoutExpired) as err:
        ok, detail = False, [str(err)]
    return f"; SLURM job {job_id} requeued" if ok else f"; requeueing SLURM job {job_id} failed ({detail})"
