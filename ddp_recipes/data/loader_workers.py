"""DataLoader worker processes: they leave preemption signals to their training process, end with it however it
ends, and the ones a finished run leaves behind are killed at exit instead of hanging it.

The workers ignore SIGTERM (:func:`ignore_preemption_signals`), so multiprocessing's exit handler, which
sends its daemon children SIGTERM and joins them, would wait for them forever; :func:`kill_loader_workers_at_exit`
registers the exit handler that finds those workers (their ``SigIgn`` mask in ``/proc``) and kills them first.
"""

from __future__ import annotations

import atexit
import faulthandler
import multiprocessing
import multiprocessing.util  # its exit handler is registered on import: before ours
import os
import signal
import sys
import tempfile

_PR_SET_PDEATHSIG = 1  # linux/prctl.h
WORKER_STACK_SIGNAL = signal.SIGRTMIN + 3 if hasattr(signal, "SIGRTMIN") else None  # not used by torch or Lightning
STACK_FILE_PREFIX = "ddp-recipes-worker-stack-"


def loader_worker_init(worker_id: int) -> None:
    """worker_init_fn of the pack's loaders: :func:`ignore_preemption_signals`, :func:`die_with_rank`, and the
    stack dump a hang report asks for (:func:`report_stacks_on_signal`)."""
    ignore_preemption_signals(worker_id)
    die_with_rank()
    report_stacks_on_signal()


def report_stacks_on_signal() -> None:
    """Dump every thread's stack on :data:`WORKER_STACK_SIGNAL` into an unlinked file that the rank's hang report
    (:mod:`ddp_recipes.ddp.hangs`) reads through ``/proc``: nothing left on disk, and C-level, so it works while
    the worker's Python is blocked in a read."""
    if WORKER_STACK_SIGNAL is None or not os.path.isdir("/proc"):
        return
    out = tempfile.NamedTemporaryFile(prefix=STACK_FILE_PREFIX, delete=False)  # noqa: SIM115 - open for life
    os.unlink(out.name)
    faulthandler.register(WORKER_STACK_SIGNAL, file=out, all_threads=True, chain=False)
    report_stacks_on_signal.file = out  # type: ignore[attr-defined]  # kept open (and referenced) for life


def die_with_rank() -> None:
    """Have the kernel SIGKILL this loader worker when the process that started it ends (Linux), and stop now if
    it has ended already.

    torch's worker notices a dead rank only between two samples (its watchdog compares ``getppid()``); a worker
    inside a sample's read, retrying a store that is down with backoff, outlived a SIGKILLed rank by minutes,
    orphaned, still downloading and logging. SIGKILL because the worker ignores SIGTERM
    (:func:`ignore_preemption_signals`). The parent is the rank under the fork and spawn start methods; under
    forkserver it is the fork server, which exits when the rank does (its pipe from the rank closes), so the
    signal follows. The kernel ties it to the thread that started the worker: torch starts workers from the
    thread that iterates the loader, Lightning's main thread. Elsewhere (no prctl) the storage layer's retry loop
    gives up once the parent is gone (:func:`~ddp_recipes.storage.retry.retrying`).
    """
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):
            pass
    parent = multiprocessing.parent_process()
    if parent is not None and not parent.is_alive():  # it ended before the kernel was told
        os._exit(1)


def ignore_preemption_signals(worker_id: int) -> None:
    """worker_init_fn: a worker leaves SIGTERM/SIGUSR1 to its training process, which saves and exits.

    A signal sent to the whole process group would otherwise kill the workers first, and the training
    process would fail on "DataLoader worker killed" instead of checkpointing.
    """
    for signum in (signal.SIGTERM, getattr(signal, "SIGUSR1", None)):
        if signum is not None:
            signal.signal(signum, signal.SIG_IGN)


def _ignores_sigterm(pid: int) -> bool:
    """Whether process ``pid`` ignores SIGTERM (Linux: its ``SigIgn`` mask; elsewhere unknown, so False)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("SigIgn:"):
                    return bool(int(line.split()[1], 16) >> (signal.SIGTERM - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def _kill_workers_left_at_exit() -> None:
    """At interpreter exit, SIGKILL the DataLoader workers that ignore SIGTERM, before multiprocessing joins them.

    A loader iterator still alive at exit (persistent workers held by a reference cycle, freed only by the
    GC after the exit handlers) never shuts its workers down; multiprocessing's own exit handler then
    sends its daemon children SIGTERM, which workers started with :func:`ignore_preemption_signals`
    ignore, and joins them, which never returns: a finished run that hangs at exit. Such a worker can do
    nothing with SIGTERM anyway and holds nothing to save, so it is killed outright. Only torch's loader
    workers: any other child (a script's own uploader that ignores SIGTERM to finish its work) and workers
    that honour SIGTERM are left to multiprocessing, which joins them.
    """
    stuck = [p for p in multiprocessing.active_children()
             if p.daemon and p.pid is not None and _ignores_sigterm(p.pid)]
    if stuck:  # rare: only then look for the live loader iterators whose workers these are
        workers = _live_loader_worker_pids()
        stuck = [p for p in stuck if p.pid in workers]
    if stuck and hasattr(signal, "SIGCHLD"):
        # torch's SIGCHLD handler would raise "DataLoader worker ... killed" into whatever exit code runs next.
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for process in stuck:
        process.kill()


def _live_loader_worker_pids() -> set[int]:
    """The pids of the workers of every multi-process DataLoader iterator still alive (a Process object
    forgets its target once started, so a worker is known by its iterator)."""
    import gc

    from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

    # type(), not isinstance: isinstance also reads obj.__class__, and torch.distributed's deprecated
    # reduce_op object (among the gc's objects) answers that with a FutureWarning, on every rank.
    return {w.pid for obj in gc.get_objects() if issubclass(type(obj), _MultiProcessingDataLoaderIter)
            for w in getattr(obj, "_workers", ()) if w.pid is not None}


_reaper = {"registered": False}


def kill_loader_workers_at_exit() -> None:
    """Register :func:`_kill_workers_left_at_exit` (once per process), when the pack makes a loader whose
    workers ignore SIGTERM: not at import, so a process that only imports the pack keeps its exit as it was.
    Exit handlers run last registered first: this one before multiprocessing's (imported above). A process that
    multiprocessing started (a spawned rank) runs no exit handler before its own clean-up, which terminates and
    joins its daemon children: there a multiprocessing finalizer of priority >= 0 runs first."""
    if not _reaper["registered"]:
        _reaper["registered"] = True
        atexit.register(_kill_workers_left_at_exit)
        multiprocessing.util.Finalize(None, _kill_workers_left_at_exit, exitpriority=10)
