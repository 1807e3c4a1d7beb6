"""The one way tests start processes: a recipe, a scenario script, torchrun, the doctor.

``run([...])`` runs ``python <args>`` to the end and returns a ``subprocess.CompletedProcess``;
``start([...])`` starts it in the background and returns a :class:`Background` to wait on (a file, a saved
step, a line), signal and finish. Both run the command in its own session, so a timeout or a kill reaches
the whole process tree (Lightning's ranks, loader workers, compile workers), and both write output to
files, never pipes (a full pipe would block a run the test is waiting on). The environment is the test's
own plus what every launch needs (see :func:`launch_env`); a failure message names the command and shows
the tail of its output.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from tests.helpers import free_port

ROOT = Path(__file__).resolve().parents[1]
# On every child's PYTHONPATH: its sitecustomize makes a deprecation raised by the pack's own code an error there,
# as pyproject.toml's filterwarnings does in the pytest process (a child's warnings never reach pytest).
CHILD_SITE = ROOT / "tests" / "childsite"
TAIL = 3000  # characters of output a failure message shows


def launch_env(*, port: int | bool = True, threads: int | None = 1, quiet: bool | None = True, pythonpath: bool = True,
               drop: Iterable[str] = (), drop_prefixes: tuple[str, ...] = (),
               extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment for a child: ``port`` sets MASTER_PORT (True: a free one; False: unset,
    what the test's own environment has); ``threads`` sets OMP_NUM_THREADS (None: left alone), the cores are
    shared; ``quiet`` sets PYTHONWARNINGS=ignore, ``quiet=False`` removes it (for tests that look for
    warnings), ``None`` leaves it; ``pythonpath`` puts the repository root first on PYTHONPATH, so the checkout
    under test wins (False: removed, only what a user has); either way :data:`CHILD_SITE` goes on it, so a
    deprecation raised by the pack's own code fails the child as it fails the suite; ``drop``/``drop_prefixes``
    remove inherited variables (launcher variables, injected faults); ``extra`` is set last. ``PL_GLOBAL_SEED``
    never passes: a child is a fresh script, and ``lightning.seed_everything`` in an earlier test of this process
    set it here."""
    dropped = {*drop, "PL_GLOBAL_SEED"}
    env = {k: v for k, v in os.environ.items() if k not in dropped and not k.startswith(drop_prefixes or ("\0",))}
    if port is not False:
        env["MASTER_PORT"] = str(free_port() if port is True else port)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    if quiet:
        env["PYTHONWARNINGS"] = "ignore"
    elif quiet is False:
        env.pop("PYTHONWARNINGS", None)
    if pythonpath:
        rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in (str(ROOT), str(CHILD_SITE))]
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(CHILD_SITE), *rest])
    else:
        env["PYTHONPATH"] = str(CHILD_SITE)  # not the checkout: only what a user has, and the warning filters
    env.update(extra or {})
    return env


def _read(f: IO[str] | None) -> str:
    """What a child has written to ``f`` so far, without moving the offset the child writes at."""
    if f is None:
        return ""
    fd = f.fileno()
    data = os.pread(fd, os.fstat(fd).st_size, 0).decode(errors="replace")
    return data.replace("\r\n", "\n").replace("\r", "\n")  # as text=True pipes read it


STARTED: list[Background] = []  # every command started, in order: tests/conftest.py ends a test's leftovers


class Background:
    """A command started by :func:`start`: its own session, output in files (``log``: both streams there)."""

    def __init__(self, args: Sequence[Any], *, cwd: Path | str = ROOT, env: Mapping[str, str] | None = None,
                 torchrun: int | None = None, log: Path | None = None, **env_options: Any) -> None:
        full_env = launch_env(extra=env, **env_options)
        prefix: list[str] = []
        if torchrun:
            prefix = ["-m", "torch.distributed.run", "--nproc-per-node", str(torchrun),
                      "--master-port", full_env["MASTER_PORT"]]
        self.args = [sys.executable, *prefix, *map(str, args)]
        self.log = log
        if log is not None:
            self._out: IO[str] = open(log, "w+")  # noqa: SIM115 (closed in finish)
            self._err: IO[str] | None = None
        else:
            self._out, self._err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(self.args, cwd=cwd, env=full_env, stdout=self._out,
                                     stderr=self._err if self._err is not None else subprocess.STDOUT,
                                     start_new_session=True)
        self.pid = self.proc.pid
        self._final: tuple[str, str] | None = None
        STARTED.append(self)

    def end_leftovers(self) -> None:
        """SIGKILL whatever of its session still runs (the command, or children it left behind): a test that failed
        between :func:`start` and :meth:`finish` must not leave processes waiting forever. The session's id is
        the command's pid, which is not reused while any process of the session lives."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    # ---- output ----
    @property
    def stdout(self) -> str:
        return self._final[0] if self._final else _read(self._out)

    @property
    def stderr(self) -> str:
        """Standard error (with ``log``: both streams, merged)."""
        if self._final:
            return self._final[1]
        return _read(self._err) if self._err is not None else _read(self._out)

    @property
    def output(self) -> str:
        """Everything it printed: stdout then stderr (with ``log``: the merged stream)."""
        return self.stdout if self.log is not None else self.stdout + self.stderr

    def describe(self, why: str) -> str:
        """``why``, the command, and the tail of its output: what a failure message shows."""
        code = self.proc.poll()
        state = "running" if code is None else f"exit {code}"
        return f"{why} ({state}): {shlex.join(self.args)}\n{self.output[-TAIL:]}"

    # ---- signals ----
    def poll(self) -> int | None:
        return self.proc.poll()

    def signal(self, sig: int, *, group: bool = False) -> None:
        """``sig`` to the launched process (the launcher: Lightning's rank 0) or, ``group=True``, to every
        process it started (ranks and loader workers, as a container stop does)."""
        if group:
            try:
                os.killpg(self.pid, sig)
            except ProcessLookupError:
                pass
        else:
            self.proc.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL to the whole process tree, no grace; reaped."""
        self.signal(signal.SIGKILL, group=True)
        self.proc.wait()

    # ---- waiting ----
    def wait(self, timeout: float, stalled: str | None = None) -> int:
        """The exit code; past ``timeout`` the tree is killed and the test fails with ``stalled``."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(self.describe(stalled or f"still running after {timeout} s")) from None

    def finish(self, timeout: float = 600, check: bool = False) -> subprocess.CompletedProcess:
        """Wait (see :meth:`wait`) and collect exit code, stdout and stderr; ``check``: fail unless it exited 0."""
        code = self.wait(timeout)
        if not self._final:
            self._final = (self.stdout, self.stderr)
            for f in (self._out, self._err):
                if f is not None:
                    f.close()
        if check:
            assert code == 0, self.describe("failed")
        return subprocess.CompletedProcess(self.args, code, *self._final)

    def wait_until(self, found: Callable[[], Any], timeout: float, what: str, poll_s: float = 0.02) -> Any:
        """Poll ``found()`` until it returns something truthy and return that; if the process ends first or
        ``timeout`` passes, kill the tree and fail naming ``what``."""
        deadline = time.monotonic() + timeout
        while True:
            value = found()
            if value:
                return value
            if self.proc.poll() is not None:
                raise AssertionError(self.describe(f"ended before {what}"))
            if time.monotonic() > deadline:
                self.kill()
                raise AssertionError(self.describe(f"no {what} within {timeout} s"))
            time.sleep(poll_s)

    def wait_for_file(self, path: Path, timeout: float = 240) -> str:
        """The text of ``path`` once it exists."""
        self.wait_until(path.exists, timeout, f"{path.name} appeared", poll_s=0.2)
        return path.read_text()

    def wait_for_step(self, checkpoint: Path, step: int, timeout: float = 240) -> int:
        """The global step saved in ``checkpoint`` once it is >= ``step``."""
        def seen() -> list[int]:
            now = saved_step(checkpoint)
            return [now] if now >= step else []

        return self.wait_until(seen, timeout, f"a checkpoint at step {step}")[0]

    def wait_for_line(self, text: str, timeout: float = 240) -> str:
        """The first output line that contains ``text``."""
        return self.wait_until(lambda: next((line for line in self.output.splitlines() if text in line), None),
                               timeout, f"a line with {text!r}", poll_s=0.1)


def saved_step(path: Path) -> int:
    """The ``global_step`` of a checkpoint, -1 while it is not there (or, never with the atomic writer, half
    written)."""
    import torch

    try:
        return int(torch.load(path, map_location="cpu", weights_only=True, mmap=True)["global_step"])
    except Exception:
        return -1


def start(args: Sequence[Any], **options: Any) -> Background:
    """``python <args>`` in the background; options as :class:`Background` (``cwd``, ``env``, ``torchrun``,
    ``log``, and :func:`launch_env`'s ``port``, ``threads``, ``quiet``, ``pythonpath``, ``drop``,
    ``drop_prefixes``)."""
    return Background(args, **options)


def run(args: Sequence[Any], *, timeout: float = 300, check: bool = False, **options: Any
        ) -> subprocess.CompletedProcess:
    """``python <args>`` to the end (the tree killed past ``timeout``); ``check``: fail unless it exits 0."""
    return start(args, **options).finish(timeout=timeout, check=check)
