"""Lightning's ``--devices N`` launcher (rank 0 starts ranks 1..N-1 as its children), with the job's exit code and
end kept when a child rank fails first.

Lightning 2.6's ``_SubprocessScriptLauncher`` starts a ``_ChildProcessObserver`` thread that, once a child exits
with a non-zero code, SIGKILLs every rank and then rank 0 itself. The launcher (rank 0's process) then exits 137
whatever the failing rank said (2 for bad input or a store outage), no exit handler of rank 0 runs, and rank 0's
loader workers are orphaned mid-download. The same thread also kills rank 0 while rank 0 is itself ending a
failure it met first (its exit handler waits for the other ranks, which stop on the lost peer with code 1).

:class:`ObservedLauncher` starts :class:`RankObserver` instead: the first child that fails names the job's exit
code; rank 0, which fails as a consequence (a lost peer) or is still busy, exits with that code, through its
normal exit path when it gets there within ``CHILD_GRACE_S``, else from the observer (its loader workers follow it:
:func:`~ddp_recipes.data.loader_workers.loader_worker_init`). A failure rank 0 meets first stays rank 0's: the
observer leaves it alone.

Reaches Lightning's private launcher (its ``launch`` body, ``_call_children_scripts`` and
``_set_num_threads_if_needed``); checked on Lightning 2.6.x. tests/data/test_stream_outage.py fails if a release
changes how a failing child ends the launcher.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from typing_extensions import override

from ddp_recipes.ddp.failures import CHILD_GRACE_S, PEER_FAILURE_PREFIX, is_peer_failure
from ddp_recipes.lightning_seam.reach import SubprocessScriptLauncher, set_num_threads_if_needed
from ddp_recipes.storage.retry import reason

POLL_S = 0.2  # how often the observer looks at the children (a waitpid each: nothing)
PEER_FAILURE_CODE = 1  # what a rank that stops on a lost peer exits with (its traceback, or PeerWatch)


class RankObserver(threading.Thread):
    """Watches rank 0's children; the first one to fail names the job's exit code (see the module's text)."""

    def __init__(self, procs: list[Any], grace_s: float = CHILD_GRACE_S) -> None:
        super().__init__(daemon=True, name="ddp-recipes-rank-observer")  # ends with the process
        self.procs, self.grace_s = procs, grace_s
        self.first: tuple[int, int] | None = None  # (local rank, exit code) of the child that failed first
        self._lock = threading.Lock()
        self._main_failing = False

    def run(self) -> None:
        while True:
            codes = [proc.poll() for proc in self.procs]
            if all(code == 0 for code in codes):
                return
            failed = [(rank, code) for rank, code in enumerate(codes, start=1) if code]
            if failed:
                with self._lock:
                    if self._main_failing:
                        return  # rank 0 failed first: its own exit path stops the others and names the code
                    # Seen in one look: the one that did not stop on a lost peer is the cause.
                    self.first = sorted(failed, key=lambda f: f[1] == PEER_FAILURE_CODE)[0]
                return self._end_main()
            time.sleep(POLL_S)

    def main_failed(self, err: BaseException) -> tuple[int, int] | None:
        """Rank 0's own failure ``err`` reached the launcher (from here on rank 0 is on its exit path and the
        observer leaves it alone): the child failure it follows from, ``(local rank, code)``, or None when rank 0
        failed first. A lost peer waits up to the grace for that child's exit to show."""
        own_exit = isinstance(err, SystemExit | KeyboardInterrupt)  # a preemption's agreed code, Ctrl+C's path
        deadline = time.monotonic() + (self.grace_s if is_peer_failure(err) else 0.0)
        while True:
            with self._lock:
                if self.first is None and not own_exit:
                    failed = [(rank, proc.poll()) for rank, proc in enumerate(self.procs, start=1)]
                    failed = [f for f in failed if f[1]]
                    if failed:
                        self.first = sorted(failed, key=lambda f: f[1] == PEER_FAILURE_CODE)[0]
                if self.first is not None or own_exit or time.monotonic() >= deadline:
                    self._main_failing = True
                    return None if own_exit else self.first
            time.sleep(POLL_S / 4)

    def _end_main(self) -> None:
        """Give rank 0 the grace to end on its own (a lost peer raises at once under gloo); a rank 0 still
        running then (inside an NCCL collective, or waiting on its own loader) is ended here, with the code."""
        assert self.first is not None
        deadline = time.monotonic() + self.grace_s
        while time.monotonic() < deadline:
            time.sleep(POLL_S)
            with self._lock:
                if self._main_failing:
                    return
        rank, code = self.first
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()  # may hang in a collective: nothing short of SIGKILL ends it
                proc.wait()
        print(f"[rank 0] local rank {rank} {ended(code)} and this rank did not stop within {self.grace_s:g} s: "
              f"ending it, exit {exit_code(code)}; the first error is that rank's, above", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(exit_code(code))  # the main thread may be blocked in C: nothing short of exiting ends it


class ObservedLauncher(SubprocessScriptLauncher):
    """Lightning's subprocess launcher whose exit code, when a child rank fails first, is that rank's."""

    observer: RankObserver | None = None

    @override
    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        # Lightning 2.6's body, with the pack's observer in place of _launch_process_observer.
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if not self.cluster_environment.creates_processes_externally:
            self._call_children_scripts()
            self.observer = RankObserver(self.procs)
            self.observer.start()
        set_num_threads_if_needed(self.num_processes)
        try:
            return function(*args, **kwargs)
        except BaseException as err:
            if self.observer is None:
                raise
            first = self.observer.main_failed(err)
            if first is None:
                raise
            rank, code = first
            # Lightning's handler still runs the on_exception hooks and the teardown; then the job ends with the
            # code of the rank that failed first, whose own line says why.
            if is_peer_failure(err):
                print(f"[rank 0] {PEER_FAILURE_PREFIX} (local rank {rank} {ended(code)}), so this rank stops too, "
                      f"exit {exit_code(code)}; the first error is that rank's, above", file=sys.stderr, flush=True)
            else:
                print(f"[rank 0] stopping ({type(err).__name__}: {reason(err)}) after local rank {rank} "
                      f"{ended(code)}; exit {exit_code(code)}: the first error is that rank's, above",
                      file=sys.stderr, flush=True)
            raise SystemExit(exit_code(code)) from err


def exit_code(returncode: int) -> int:
    """A child's ``returncode`` as a shell reports it: a rank killed by signal N (-N) is 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


def ended(returncode: int) -> str:
    """How a child rank ended, in words."""
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"
