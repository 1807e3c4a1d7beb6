"""DataLoader worker processes: they leave preemption signals to their training process, end with it however it
ends, and the ones a finished run leaves behind are killed at exit instead of hanging it."""

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
    # Named by the parent: the rank, or a fork server the rank started (not multiprocessing.parent_process(), which
    # kept a spawned process with live workers from exiting on Python 3.12).
    out = tempfile.NamedTemporaryFile(prefix=f"{STACK_FILE_PREFIX}{os.getppid()}-", delete=False)  # noqa: SIM115 - for life
    os.unlink(out.name)
    faulthandler.register(WORKER_STACK_SIGNAL, file=out, all_threads=True, chain=False)
    report_stacks_on_signal.file = out  # type: ignore[attr-defined]  # kept open (and referenced) for life


def die_with_rank() -> None:
    """Have the kernel SIGKILL this loader worker when the process that started it ends (Linux), and stop now if
    it has ended already.

    torch's worker notices a dead rank only between two samples; one retrying a store that is down outlived a
    SIGKILLed rank by minutes. SIGKILL because the worker ignores SIGTERM. Under forkserver the parent is the fork
    server, which exits with the rank. Elsewhere (no prctl) the storage retry loop gives up once the parent is gone.
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
    """worker_init_fn: a worker leaves SIGTERM/SIGUSR1 to its training process, which saves and exits (a signal
    to the whole process group would otherwise kill the workers first: "DataLoader worker killed")."""
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

    A loader iterator alive at exit (held by a reference cycle) never shuts its workers down; multiprocessing's
    exit handler then SIGTERMs its daemon children, which these ignore, and joins them forever. Such a worker holds
    nothing to save. Any other child (a script's uploader that ignores SIGTERM) is left to multiprocessing.
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
    """Register :func:`_kill_workers_left_at_exit` once per process, when a loader is made (not at import: a
    process that only imports the pack keeps its exit). It runs before multiprocessing's handler (registered
    earlier); in a spawned rank, which runs multiprocessing's clean-up first, the finalizer does."""
    if not _reaper["registered"]:
        _reaper["registered"] = True
        atexit.register(_kill_workers_left_at_exit)
        multiprocessing.util.Finalize(None, _kill_workers_left_at_exit, exitpriority=10)
