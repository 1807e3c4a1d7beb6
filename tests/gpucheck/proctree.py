"""Every process a command started, found and killed, including those that left its session or its tree.

    python -m tests.gpucheck.proctree [--parent PID] --report FILE -- COMMAND [ARGS...]

A process group (``killpg``) misses children that started their own session (the test launcher does, and so
may a user's script), and a parent chain breaks when a middle process dies (its orphans go to init). This
module runs ``COMMAND`` under a *shepherd*: a process that is a child subreaper (``prctl``), so every
orphan below it becomes its child and its tree stays whole. When ``COMMAND`` ends, the shepherd kills
whatever it left running; on SIGTERM (a timeout) it kills the whole tree and exits. ``FILE`` gets
``{"rc", "terminated", "leftovers"}``; the exit code is the command's (128 + N for a signal N). With
``--parent PID`` (the process that started the shepherd) the shepherd gets SIGTERM when that process ends,
however it ends (``PR_SET_PDEATHSIG``): a caller killed outright (SIGKILL, no handler runs) still takes the
tree with it, which in a session of its own no signal to the caller's group reaches.

A second mark covers a shepherd that is itself killed: :data:`TAG_VAR` in the environment, inherited by
every descendant that does not clear its environment; :func:`kill_tree` finds processes by both.
Linux only (``/proc``, ``prctl``); elsewhere only the direct child is reached.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

TAG_VAR = "DDP_RECIPES_PROCESS_TAG"
PROC = Path("/proc")
_PR_SET_CHILD_SUBREAPER = 36
_PR_SET_PDEATHSIG = 1


def become_subreaper() -> bool:
    """Make this process adopt its descendants' orphans (Linux >= 3.4); False where that is not possible."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def die_with(parent: int) -> bool:
    """SIGTERM to this process when ``parent`` ends (Linux); True when it has ended already."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):
        pass
    return os.getppid() != parent  # ended before the prctl: no signal will come


def _stat(pid: int) -> tuple[int, str] | None:
    """(parent pid, state letter) of ``pid``; None once it is gone."""
    try:
        fields = (PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), fields[0]


def alive(pid: int) -> bool:
    """Running (or stopped): neither gone nor a zombie waiting to be reaped."""
    stat = _stat(pid)
    return stat is not None and stat[1] not in ("Z", "X")


def _tagged(pid: int, tag: str) -> bool:
    try:
        return f"{TAG_VAR}={tag}".encode() in (PROC / str(pid) / "environ").read_bytes().split(b"\0")
    except OSError:
        return False


def tree(root: int | None, tag: str | None = None) -> set[int]:
    """The live processes below ``root`` by parent chain (``root`` too; None: none) and every live one
    carrying ``tag``; never this process."""
    children: dict[int, list[int]] = {}
    found: set[int] = set()
    try:
        pids = [int(entry.name) for entry in PROC.iterdir() if entry.name.isdigit()]
    except OSError:
        pids = []
    for pid in pids:
        stat = _stat(pid)
        if stat is None or stat[1] in ("Z", "X"):
            continue
        children.setdefault(stat[0], []).append(pid)
        if tag is not None and _tagged(pid, tag):
            found.add(pid)
    todo = [] if root is None else [root]
    found.update(todo)
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    found.discard(os.getpid())
    return {pid for pid in found if alive(pid)}


def _signal(pids: set[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def kill_tree(root: int | None, tag: str | None = None, wait_s: float = 10.0, reap: bool = False) -> set[int]:
    """SIGKILL ``root``, everything below it and everything tagged ``tag``; returns the pids signalled.
    ``root`` must be a process not yet reaped (a reaped pid may be reused): None to go by ``tag`` alone.

    Each round stops them all (SIGSTOP) and looks again before the kill, so that a parent cannot start a
    replacement in between (torchrun restarts its workers); rounds repeat until nothing is left or ``wait_s``
    passes. ``reap``: collect the exit status of every child of this process that has ended (the shepherd
    does; a caller holding ``subprocess.Popen`` objects must not, or their ``wait`` would read 0).
    """
    signalled: set[int] = set()
    deadline = time.monotonic() + wait_s
    while True:
        found = tree(root, tag)
        if not found:
            return signalled
        _signal(found, signal.SIGSTOP)
        found |= tree(root, tag)
        _signal(found, signal.SIGKILL)
        signalled |= found
        if reap:
            reap_children()
        if time.monotonic() > deadline:
            return signalled
        time.sleep(0.05)


def reap_children() -> None:
    """Collect every ended child of this process (as a subreaper: adopted orphans too)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _command_line(pid: int) -> str:
    try:
        return (PROC / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()[:200]
    except OSError:
        return "?"


def shepherd(cmd: list[str], report: Path, parent: int | None = None) -> int:
    """Run ``cmd`` as described in the module docstring; returns the exit code to leave with."""
    become_subreaper()
    me = os.getpid()
    terminated = False

    def on_term(signum: int, frame: object) -> None:
        nonlocal terminated
        terminated = True
        raise KeyboardInterrupt  # out of the wait below, into the cleanup

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    rc: int | None = None
    leftovers: list[dict[str, object]] = []
    try:
        if parent is not None and die_with(parent):  # after the handler: the death signal runs it
            terminated = True
            raise KeyboardInterrupt
        child = subprocess.Popen(cmd)
        while rc is None:  # reap everything (adopted orphans too) until the command itself ends
            pid, status = os.waitpid(-1, 0)
            if pid == child.pid:
                rc = os.waitstatus_to_exitcode(status)
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        left = tree(me) - {me}
        leftovers = [{"pid": pid, "cmd": _command_line(pid)} for pid in sorted(left)]
        kill_tree(me, reap=True)  # everything below: tree() never includes this process
        report.write_text(json.dumps({"rc": rc, "terminated": terminated,
                                      "leftovers": [] if terminated else leftovers}) + "\n")
    if rc is None:
        return 128 + signal.SIGTERM
    return rc if rc >= 0 else 128 - rc


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    parent = None
    if args[:1] == ["--parent"] and len(args) > 1 and args[1].isdigit():
        parent, args = int(args[1]), args[2:]
    if len(args) < 4 or args[0] != "--report" or args[2] != "--":
        print("usage: python -m tests.gpucheck.proctree [--parent PID] --report FILE -- COMMAND [ARGS...]",
              file=sys.stderr)
        return 2
    return shepherd(args[3:], Path(args[1]), parent)


if __name__ == "__main__":
    raise SystemExit(main())
