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
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from ddp_recipes.checkpointing.vote import StopVote
from ddp_recipes.lightning_seam import reach
from ddp_recipes.lightning_seam.connectors import FlagSignalConnector, install_flag_signals

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
    """Take out Lightning's per-step SIGTERM broadcast (a collective and a device-to-host read before every batch at
    2+ ranks): under the pack's ``FlagSignalConnector`` its flag stays False, the stop being agreed through the store
    (:class:`AgreedStop`), so it can only ever say "go on"."""
    reach.replace_sigterm_broadcast(trainer, _agreed_elsewhere)


SIGTERM_BROADCAST = reach.SIGTERM_BROADCAST  # the tests' name for it


def _agreed_elsewhere() -> None:  # the vote agrees the stop: nothing to broadcast (a function: it pickles)
    return None


class AgreedStop(Callback):
    """The ranks' agreement on a signal (module docstring), which replaces Lightning's broadcast before every step.
    Alone (build_trainer's at 2+ ranks without ``last.ckpt``) every rank exits at the agreed step, saving nothing;
    :class:`~ddp_recipes.checkpointing.last.LastCheckpoint` saves there first."""

    def __init__(self) -> None:
        self._signals: FlagSignalConnector | None = None
        self._vote: StopVote | None = None
        self._seen_step = -1

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == TrainerFn.FITTING:
            self._signals = install_flag_signals(trainer)
            skip_sigterm_broadcast(trainer)

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._seen_step = trainer.global_step
        self._vote = StopVote.open(trainer)

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step != self._seen_step:  # an optimizer step's boundary, not an accumulation batch
            self._seen_step = trainer.global_step
            self._exit(trainer, self._agreed_signal(trainer))

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        signum = self._agreed_signal(trainer, now=True)
        self._close_vote()
        self._exit(trainer, signum)

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if not isinstance(exception, Preempted) and self._vote is not None:  # Preempted: closed already
            self._vote.abandon()  # a failing rank must not wait for peers that may be gone
            self._vote = None

    def _agreed_signal(self, trainer: L.Trainer, *, now: bool = False) -> int:
        """The signal every rank acts on at this step boundary (0: none), or with ``now`` (one blocking vote)."""
        local = int(self._signals.signum or 0) if self._signals is not None else 0
        if self._vote is None:
            return local
        return self._vote.now(local) if now else self._vote.at_boundary(trainer.global_step, local)

    def _close_vote(self) -> None:
        if self._vote is not None:
            self._vote.close()
            self._vote = None

    def _kept(self, requeued: str) -> str:  # the message's end: what was saved, how to continue
        return f"nothing saved (this run has no last.ckpt){requeued}"

    def _exit(self, trainer: L.Trainer, signum: int) -> None:
        if not signum:
            return
        self.save(trainer)  # at most once per step
        message = (f"preempted by {signal.Signals(signum).name} at step {trainer.global_step} (epoch "
                   f"{trainer.current_epoch}): {self._kept(requeue_slurm_job(trainer, signum))}")
        if trainer.is_global_zero:
            print(message, file=sys.stderr, flush=True)
        self._close_vote()
        raise Preempted(signum, message)

    def save(self, trainer: L.Trainer) -> None:
        """Where :class:`~ddp_recipes.checkpointing.last.LastCheckpoint` writes ``last.ckpt``: nothing to save alone."""


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
