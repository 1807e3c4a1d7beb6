"""A hung run named while it is alive: which rank, in which phase, at which line of Python.

A rank that stops making progress (no training or validation batch finished for longer than a bound) writes what
every thread of it is doing, and where its loader workers are, to ``<output dir>/stall-reports/``, and posts its
phase and innermost line to the rendezvous store; after a short grace one rank (rank 0, or the lowest rank whose
Python still runs) prints one line naming the ranks that are not where the others are. Nothing here is a
collective: it runs in a thread beside a process group that may be wedged, and the run then goes on waiting
(the collective timeout still ends it, with the report's path in its message).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import sys
import sysconfig
import threading
import time
import traceback
from collections.abc import Callable
from types import FrameType
from typing import Any

from ddp_recipes.data.loader_workers import STACK_FILE_PREFIX, WORKER_STACK_SIGNAL
from ddp_recipes.storage import location
from ddp_recipes.storage.store import write_new

REPORT_DIR = "stall-reports"
AUTO_FLOOR_S = 60.0  # the automatic bound never goes below this: a slow step or save is not a hang
AUTO_STEPS = 20  # ... and is this many times the slowest interval seen between two finished batches
WRITE_WAIT_S = 5.0  # the line waits this long for the report file (local: done in milliseconds), then goes out
_STDLIB = sysconfig.get_paths()["stdlib"]
_INSTALLED = re.compile(r"/(site|dist)-packages/|/lib/python3\.\d+/")  # an installed package or a stdlib
_WATCHES = itertools.count()  # every rank makes its watches in the same order (one per fit)
last_report: list[str] = []  # the report folder of this process's latest stall (for the timeout's message)


def _ours(filename: str) -> bool:
    """The user's or the pack's code: not the standard library, not an installed third-party package."""
    if "/ddp_recipes/" in filename or "/recipes/" in filename:
        return True
    return not (filename.startswith((_STDLIB, "<")) or _INSTALLED.search(filename))


def phase_of(frames: list[tuple[str, int, str, str]]) -> tuple[str, str | None, bool]:
    """(phase, innermost line of user or pack code, waiting for peers) of a stack, innermost frame first.

    ``frames``: (file, line, function, source line). Waiting for peers: inside DDP's backward (the gradient
    all-reduce) or a collective the pack or Lightning issued; a collective the user's code called is a place the
    others may not be."""
    where = next((f"{os.path.basename(f)}:{n} in {fn}: {src}".rstrip(": ") for f, n, fn, src in frames
                  if _ours(f)), None)
    for i, (file, _, function, _) in enumerate(frames):
        if file.endswith(os.path.join("distributed", "distributed_c10d.py")) or "/c10d_logger" in file:
            caller = next((f for f, _, fn, _ in frames[i + 1:] if "torch/distributed" not in f), "")
            return f"collective {function}", where, not _ours(caller) or "/ddp_recipes/" in caller
        if "/torch/autograd/" in file:
            return "backward and gradient all-reduce", where, True
        if file.endswith(os.path.join("data", "dataloader.py")):
            waiting = function in ("_get_data", "_try_get_data")
            return "data fetch (waiting for its loader workers)" if waiting else "data fetch", where, False
        if function in ("save_checkpoint", "_save_checkpoint"):
            return "checkpoint save", where, False
        if "/torch/optim/" in file or function == "optimizer_step":
            return "optimizer step", where, False
        if function in ("training_step", "validation_step", "test_step", "predict_step") or (
                function.startswith("on_") and _ours(file)):
            return function, where, False
    return "outside a step", where, False


def _frames(frame: FrameType | None) -> list[tuple[str, int, str, str]]:
    return [(fs.filename, fs.lineno or 0, fs.name, fs.line or "")
            for fs in reversed(traceback.extract_stack(frame))] if frame is not None else []


def _worker_stacks(timeout_s: float = 2.0) -> dict[int, str]:
    """This rank's loader workers (its child processes), each with its stack where the pack's worker init armed
    the dump (:func:`~ddp_recipes.data.loader_workers.report_stacks_on_signal`), else its state from ``/proc``."""
    out: dict[int, str] = {pid: "" for pid in _children(os.getpid())}
    # A fork server's workers are its children, not the rank's (and name it as their parent): look one level further.
    owners = {os.getpid(), *out}
    deeper = [pid for child in out for pid in _children(child)]
    out.update({pid: "" for pid in deeper if _stack_file(pid, owners) is not None})
    dumped: dict[int, tuple[str, int]] = {}  # pid: (its dump file, the file's size before this dump)
    for pid in out:
        with contextlib.suppress(OSError):
            out[pid] = "state " + open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
            path = _stack_file(pid, owners)
            if WORKER_STACK_SIGNAL is not None and path is not None:
                dumped[pid] = (path, os.stat(path).st_size)  # the file keeps every dump: read only this one
                os.kill(pid, WORKER_STACK_SIGNAL)
    deadline = time.monotonic() + timeout_s
    for pid, (path, start) in dumped.items():
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), open(path) as f:
                f.seek(start)
                text = f.read()
                if "most recent call first" in text and text.endswith("\n"):
                    out[pid] = text
                    break
            time.sleep(0.05)
    return out


def _children(pid: int) -> list[int]:
    out: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(p) for p in f.read().split()]
    return out


def _stack_file(pid: int, owners: set[int]) -> str | None:
    """The dump file of ``pid`` if it is a loader worker of this rank (its name carries its parent's pid: the rank,
    or a fork server among ``owners``)."""
    names = tuple(f"{STACK_FILE_PREFIX}{owner}-" for owner in owners)
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            if any(name in os.readlink(f"/proc/{pid}/fd/{fd}") for name in names):
                return f"/proc/{pid}/fd/{fd}"
    return None


def _worker_where(stacks: dict[int, str]) -> str | None:
    """The innermost user or pack line in the workers' dumps (faulthandler writes the newest call first)."""
    for text in stacks.values():
        for line in text.splitlines():
            parts = line.strip().split('"')
            if line.strip().startswith("File") and len(parts) == 3 and _ours(parts[1]):
                number, _, function = parts[2].partition(" in ")
                return f"{os.path.basename(parts[1])}:{number.split()[-1]} in {function} (a loader worker)"
    return None


class HangWatch:
    """Watches this rank's progress from a thread; on a stall reports as the module docstring says.

    ``progress`` is the monotonic time of the last finished batch (set by the training loop's callback);
    ``bound`` returns the current bound in seconds; ``step`` the step the rank is at; ``store``: the rendezvous
    store (None at one process). Made in the thread that runs the fit: that thread's stack is the one read."""

    def __init__(self, *, rank: int, world_size: int, store: Any, out_dir: str, bound: Callable[[], float],
                 step: Callable[[], int], flag: str, prefix: str = "ddp_recipes/hang/") -> None:
        self.rank, self.world_size, self.store, self.out_dir = rank, world_size, store, out_dir
        self.bound, self.step, self.flag, self.prefix = bound, step, flag, prefix
        self.progress = time.monotonic()
        self._id, self._reports = next(_WATCHES), 0  # which fit and which stall of it: the key of one line
        self._printed = False  # this rank printed the line of the stall now reported
        self._main = threading.get_ident()  # the thread that runs the fit (made there), not always the main one
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ddp-recipes-hang-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        reported = None  # the progress time of the stall already reported
        while not self._stop.wait(min(1.0, max(0.05, self.bound() / 20))):
            idle, stalled_at = time.monotonic() - self.progress, self.progress
            if reported is not None and stalled_at != reported:
                if self._printed:  # the rank that named the stall says it is over: one line, not one per rank
                    print(f"[rank {self.rank}] training progresses again after the stall reported above",
                          file=sys.stderr, flush=True)
                reported, self._printed = None, False
            if reported is None and (idle > self.bound() or idle > self.bound() / 4 and self._peer_stalled(idle)):
                reported = stalled_at
                with contextlib.suppress(Exception):  # a report must never take the run down
                    self.report(idle)

    def _peer_stalled(self, idle: float) -> bool:
        """Whether another rank reported the stall this rank is in. Each rank derives the automatic bound from the
        steps it saw, so bounds differ: a rank that waited for its own would post after the reporting rank's grace,
        and be named as one whose Python is not running. Asked only while this rank has been idle a while."""
        with contextlib.suppress(Exception):  # a store that is gone: this rank's own bound still applies
            key = f"{self.prefix}stall"
            if self.store is not None and self.store.check([key]):
                return float(self.store.get(key)) > time.time() - idle  # reported since this rank's last batch
        return False

    def report(self, idle: float) -> None:
        """Write this rank's stacks, post its place, and (one rank) print the line naming the odd ranks."""
        frames = sys._current_frames()
        main = _frames(frames.get(self._main))
        phase, where, waiting = phase_of(main)
        workers = _worker_stacks() if phase.startswith("data fetch") else {}
        if "loader workers" in phase:
            where = _worker_where(workers) or where
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(time.time() - idle))
        path = str(location(self.out_dir) / REPORT_DIR / f"{stamp}-step{self.step()}-rank{self.rank}.txt")
        lines = [f"rank {self.rank} of {self.world_size}, pid {os.getpid()}, step {self.step()}: no batch finished for "
                 f"{idle:.0f} s (bound {self.bound():g} s, {self.flag})", f"phase: {phase}", f"innermost: {where}", ""]
        for ident, frame in frames.items():
            name = next((t.name for t in threading.enumerate() if t.ident == ident), str(ident))
            lines += [f"--- thread {name}", *traceback.format_stack(frame)]
        lines += [f"--- loader worker pid {pid}\n{text}" for pid, text in workers.items()]
        _write_briefly(path, "\n".join(lines).encode())
        last_report[:] = [str(location(self.out_dir) / REPORT_DIR)]
        post = {"rank": self.rank, "step": self.step(), "phase": phase, "where": where, "waiting": waiting,
                "at": time.time() - idle, "idle": idle}
        if self.store is None:
            return self._print([post], path)
        self.store.set(f"{self.prefix}{self.rank}", json.dumps(post))
        self.store.set(f"{self.prefix}stall", str(time.time()))  # the others report now, whatever their bound
        posts = self._collect(post["at"])
        self._reports += 1  # one line per stall, from one rank: a step can stall twice, a process group see two fits
        claim = f"{self.prefix}claim/{self._id}.{self._reports}/{min(p['step'] for p in posts)}"
        if min(p["rank"] for p in posts) == self.rank and self.store.add(claim, 1) == 1:
            self._print(posts, path)

    def _collect(self, at: float) -> list[dict[str, Any]]:
        """The posts of this stall (within one bound of this rank's), waiting a short grace for every rank's."""
        deadline = time.monotonic() + min(10.0, max(2.0, self.bound() / 4))
        while True:
            keys = [f"{self.prefix}{r}" for r in range(self.world_size)]
            present = [k for k in keys if self.store.check([k])]
            posts = [json.loads(v) for v in self.store.multi_get(present)] if present else []
            posts = [p for p in posts if abs(p["at"] - at) < max(self.bound(), 5.0)]
            if len(posts) == self.world_size or time.monotonic() > deadline:
                return posts
            time.sleep(0.2)

    def _print(self, posts: list[dict[str, Any]], path: str) -> None:
        self._printed = True
        print(f"[rank {self.rank}] {name_stall(posts, self.world_size, self.bound(), self.flag)}; every rank's "
              f"stacks: {os.path.dirname(path)}", file=sys.stderr, flush=True)


def _write_briefly(path: str, data: bytes) -> None:
    """Write the report from a thread of its own, waiting at most :data:`WRITE_WAIT_S` for it: a bucket (or mount)
    that stopped answering retries for minutes, and must not hold the line past the collective timeout."""

    def write() -> None:
        with contextlib.suppress(Exception):  # a report must never take the run down
            write_new(path, data, replace=True)

    writer = threading.Thread(target=write, name="ddp-recipes-hang-report-write", daemon=True)
    writer.start()
    writer.join(WRITE_WAIT_S)


def name_stall(posts: list[dict[str, Any]], world_size: int, bound: float, flag: str) -> str:
    """The one line: the ranks not where the others are (or that posted nothing), their phase and line."""
    idle = max(p["idle"] for p in posts)
    head = f"DDP hang: no batch finished for {idle:.0f} s (bound {bound:g} s, {flag})"
    silent = sorted(set(range(world_size)) - {p["rank"] for p in posts})
    places: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for p in posts:
        places.setdefault((p["step"], p["phase"], p["waiting"]), []).append(p)
    odd = [p for p in posts if not p["waiting"]]
    behind = min(p["step"] for p in posts)
    if any(p["step"] == behind for p in odd) and any(p["step"] > behind for p in posts):
        # On CUDA a waiting rank's host runs ahead of its device (the all-reduce is queued, not waited for) and
        # blocks steps later, outside any collective: the rank behind is the one the others wait for.
        odd = [p for p in odd if p["step"] == behind]
    if not odd and len(places) > 1:  # every rank waits, in different places: the smaller groups stand out
        largest = max(places.values(), key=len)
        odd = [p for group in places.values() if group is not largest for p in group]
    parts = [f"rank {p['rank']} is in {p['phase']} at step {p['step']} ({p['where'] or 'no user or pack frame'})"
             for p in sorted(odd, key=lambda p: p["rank"])]
    parts += [f"rank {r} posted nothing (its Python is not running: native code holding the GIL, or gone)"
              for r in silent]
    others = [p for p in posts if p not in odd]
    if others:
        where = {f"{p['phase']} at step {p['step']}" for p in others}
        parts.append(f"the other {len(others)} rank(s) wait in {', '.join(sorted(where))}")
    if not odd and not silent:
        parts = [f"every rank waits in {posts[0]['phase']} at step {posts[0]['step']}: none stands out (a collective "
                 "that does not complete: check the network, or TORCH_DISTRIBUTED_DEBUG=DETAIL)"]
    return f"{head}: {'; '.join(parts)}"
