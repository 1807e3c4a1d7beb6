"""gpu-check's runner: each check a command under its own timeout, all of them inside one budget, each
ending as one of four verdicts.

* ``pass``: it ran and showed what it names.
* ``fail``: it ran and did not, or it hung (past its *own* timeout), or its output could not be read.
* ``incomplete``: the *budget* ran out: cut while running (it would have had more time on its own), or
  not started because too little budget was left; nothing was shown either way. A check cut by the budget
  whose output so far already shows a failure (a failed test) is ``fail``: the cut hides nothing.
* ``no verdict``: it cannot run on this machine (fewer GPUs than it needs, no toolchain for
  ``torch.compile``, no CUDA at all), with the reason.

Every command runs under :mod:`tests.gpucheck.proctree`'s shepherd, so a timeout kills the whole tree,
also the children that started their own session, and whatever a check leaves running is killed when it
ends (it would skew the next check's figures).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.gpucheck.proctree import TAG_VAR, kill_tree, tree

ROOT = Path(__file__).resolve().parents[2]  # the checkout: every check runs from it, from source
VERDICTS = ("pass", "fail", "incomplete", "no verdict")
MIN_START_S = 20.0  # less budget than this left: a check is not started (incomplete) rather than cut at once
TERM_GRACE_S = 10.0  # how long the shepherd gets to kill its tree after SIGTERM before everything is SIGKILLed

Result = dict[str, Any]
Judge = Callable[[int, Path, str], Result]  # (exit code, work dir, output tail) -> verdict


@dataclass
class Check:
    """One verification: a command, judged from its exit code and the files it writes in its work dir."""

    name: str
    what: str  # one line for the report
    cmd: list[str]  # "{work}" in an argument is the check's work dir
    timeout_s: float  # its own limit: past it, the check hung (fail)
    min_gpus: int = 1
    compiled: bool = False  # needs torch.compile to build code on this machine
    judge: Judge | None = None
    # What it showed before a cut, for the reason, and whether that already holds a failure.
    partial: Callable[[Path, str], tuple[str, bool]] | None = None
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class Derived:
    """A verdict computed from earlier checks' results (no command, no time)."""

    name: str
    what: str
    inputs: tuple[str, ...]  # the checks it reads; kept by --only when they all are
    compute: Callable[[dict[str, Result]], Result]


def verdict(status: str, reason: str = "", **data: Any) -> Result:
    assert status in VERDICTS, status
    return {"verdict": status, "reason": reason, **({"data": data} if data else {})}


def last_lines(text: str, n: int) -> str:
    return " | ".join(line.strip() for line in text.strip().splitlines()[-n:])


def exit_text(rc: int, tail: str, n: int = 3) -> str:
    """A command's end for a reason: ``exit 1: <its last n lines>``; a signal by name (``exit -9 (SIGKILL)``,
    or ``exit 137 (SIGKILL)``: the shepherd's 128 + N), and ``no output`` rather than nothing."""
    code, sig = f"exit {rc}", -rc if rc < 0 else rc - 128
    if sig in {s.value for s in signal.Signals}:
        code += f" ({signal.Signals(sig).name})"
    lines = last_lines(tail, n)
    return f"{code}: {lines}" if lines else f"{code}, no output"


def exit_code_judge(rc: int, work: Path, tail: str) -> Result:
    return verdict("pass") if rc == 0 else verdict("fail", exit_text(rc, tail))


def _environment(check: Check, tag: str) -> dict[str, str]:
    path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(ROOT)]
    return {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONPATH": os.pathsep.join([str(ROOT), *path]),
            TAG_VAR: tag, **check.env}


def run_one(check: Check, timeout_s: float, work: Path, budget_cut: bool) -> Result:
    """Run ``check`` for at most ``timeout_s``. ``budget_cut``: that limit is the budget's remainder, shorter
    than the check's own timeout, so running into it is ``incomplete``, not ``fail``."""
    work = work.resolve()  # the command runs in the checkout: a relative path would name a folder there
    work.mkdir(parents=True, exist_ok=True)
    log, proc_report = work / "output.log", work / "processes.json"
    proc_report.unlink(missing_ok=True)
    tag = f"gpucheck-{os.getpid()}-{check.name}-{uuid.uuid4().hex[:8]}"
    cmd = [sys.executable, "-m", "tests.gpucheck.proctree", "--parent", str(os.getpid()), "--report",
           str(proc_report), "--", *(part.replace("{work}", str(work)) for part in check.cmd)]
    started = time.monotonic()
    killed: set[int] = set()
    with log.open("w") as sink:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT, env=_environment(check, tag),
                                start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=timeout_s)
        except BaseException as stop:  # the timeout, or gpu-check itself interrupted: the tree goes either way
            rc = None
            killed = stop_tree(proc, tag)
            if not isinstance(stop, subprocess.TimeoutExpired):
                raise
    seconds = round(time.monotonic() - started, 1)
    stray = kill_tree(None, tag)  # anything still carrying the tag escaped the shepherd: never left running
    tail = log.read_text(errors="replace")[-4000:]
    if rc is None:
        got, failed = check.partial(work, tail) if check.partial else ("", False)
        where = f"; {got}" if got else ""
        n = len(killed | stray)
        if budget_cut and failed:
            result = verdict("fail", f"the budget ran out {seconds:.0f} s into it, and its output so far already "
                             f"shows a failure{where}; {n} process(es) killed")
        elif budget_cut:
            result = verdict("incomplete", f"the budget ran out {seconds:.0f} s into it (its own limit is "
                             f"{check.timeout_s:.0f} s); {n} process(es) killed{where}")
        else:
            result = verdict("fail", f"timed out after {seconds:.0f} s, its own limit (hung, or far slower than "
                             f"expected); {n} process(es) killed{where}; its output: the log bundle")
    else:
        try:
            result = (check.judge or exit_code_judge)(rc, work, tail)
        except Exception as err:  # noqa: BLE001 - a judge that cannot read the output is that check's failure
            result = verdict("fail", f"could not read its result ({type(err).__name__}: {err}); "
                             f"{exit_text(rc, tail, 2)}")
        left = _leftovers(proc_report) + [{"pid": pid, "cmd": "(escaped its shepherd)"} for pid in sorted(stray)]
        if left:
            result["reason"] += (f"{'; ' if result['reason'] else ''}left {len(left)} process(es) running at its "
                                 f"end, killed: {left[0]['cmd']}")
            result.setdefault("data", {})["leftovers"] = left
    return {"name": check.name, "what": check.what, **result, "seconds": seconds}


def stop_tree(proc: subprocess.Popen, tag: str) -> set[int]:
    """SIGTERM to the shepherd (it kills its tree), then SIGKILL to whatever is left of the tree and the tag."""
    pids = tree(proc.pid, tag)
    try:
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=TERM_GRACE_S)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    pids |= kill_tree(proc.pid, tag) if proc.poll() is None else kill_tree(None, tag)
    proc.wait()
    return pids


def _leftovers(report: Path) -> list[dict[str, Any]]:
    try:
        return list(json.loads(report.read_text()).get("leftovers") or [])
    except (OSError, ValueError):
        return []


def blocker(check: Check, gpus: int, compile_problem: str | None) -> str | None:
    """Why ``check`` cannot run on this machine (its verdict is then ``no verdict``), or None."""
    if gpus < check.min_gpus:
        return "no CUDA device" if gpus == 0 else f"needs {check.min_gpus}+ GPUs ({gpus} visible)"
    if check.compiled and compile_problem:
        return f"torch.compile cannot build code here: {compile_problem}"
    return None


def run_checks(checks: list[Check | Derived], gpus: int, out_dir: Path, budget_s: float,
               compile_problem: str | None = None, started: float | None = None,
               progress: Callable[[str], None] | None = None,
               after_each: Callable[[list[Result]], None] | None = None,
               into: list[Result] | None = None) -> list[Result]:
    """Every check in order, each given ``min(its timeout, budget left)``; the budget counts from
    ``started`` (``time.monotonic()``; default now). Results are appended to ``into`` (default: a new list),
    which also holds what was done when an exception stops the run; ``after_each`` sees them after every
    check (the report is rewritten then, so a slot that ends mid-run still leaves one)."""
    say = progress or (lambda line: print(line, file=sys.stderr, flush=True))
    started = time.monotonic() if started is None else started
    results: list[Result] = [] if into is None else into
    for i, check in enumerate(checks, 1):
        head = f"[gpu-check {i}/{len(checks)}] {check.name}"
        if isinstance(check, Derived):
            result = {"name": check.name, "what": check.what, "seconds": 0.0,
                      **check.compute({r["name"]: r for r in results})}
        elif (why := blocker(check, gpus, compile_problem)) is not None:
            result = {"name": check.name, "what": check.what, "seconds": 0.0, **verdict("no verdict", why)}
        else:
            left = budget_s - (time.monotonic() - started)
            if left < MIN_START_S:
                result = {"name": check.name, "what": check.what, "seconds": 0.0, **verdict(
                    "incomplete", f"not started: {max(left, 0):.0f} s of the {budget_s:.0f} s budget left")}
            else:
                timeout = min(check.timeout_s, left)
                say(f"{head}: {check.what} (timeout {timeout:.0f} s, {left:.0f} s of the budget left) ...")
                result = run_one(check, timeout, out_dir / "gpu-check" / check.name,
                                 budget_cut=timeout < check.timeout_s)
        say(f"{head}: {result['verdict']}" + (f": {result['reason']}" if result["reason"] else "")
            + (f" ({result['seconds']} s)" if result["seconds"] else ""))
        results.append(result)
        if after_each is not None:
            after_each(results)
    return results


# ---- pytest checks ------------------------------------------------------------------------------------

_OUTCOME = re.compile(r"^(\S+::\S+)\s+(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b", re.MULTILINE)


def pytest_partial(work: Path, tail: str) -> tuple[str, bool]:
    """What a cut pytest run (``-v``) showed before the cut: its outcomes so far and the test it was in, and
    whether a test had failed (or errored) by then."""
    text = (work / "output.log").read_text(errors="replace") if (work / "output.log").exists() else tail
    outcomes = _OUTCOME.findall(text)
    counts: dict[str, int] = {}
    for _, outcome in outcomes:
        counts[outcome.lower()] = counts.get(outcome.lower(), 0) + 1
    running = [line.split()[0] for line in text.splitlines() if "::" in line and not _OUTCOME.match(line)]
    done = ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "no test finished"
    failed = [name for name, outcome in outcomes if outcome in ("FAILED", "ERROR")]
    return (f"before the cut: {done}" + (f"; running: {running[-1]}" if running else "")
            + (f"; failed: {failed[0]}" if failed else ""), bool(failed))


def pytest_judge(rc: int, work: Path, tail: str) -> Result:
    """pytest's junit XML: counts and the failed tests' names. On a machine with a GPU (the only place a gpu
    check runs), a run in which no test ran is a failure: the tier is there to run."""
    import xml.etree.ElementTree as ET

    suite = ET.parse(work / "junit.xml").getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    failed = [f"{case.get('name')}: {(bad.get('message') or '').splitlines()[0][:200] if bad.get('message') else ''}"
              for case in suite.iter("testcase") for bad in case if bad.tag in ("failure", "error")]
    skipped = sorted({(s.get("message") or "").strip() for case in suite.iter("testcase")
                      for s in case if s.tag == "skipped"})
    summary = f"{passed} passed, {counts['skipped']} skipped, {len(failed)} failed"
    data = {"failed": failed, "skipped_reasons": skipped, **counts}
    if failed or rc != 0:
        why = f"exit {rc}; {failed[0]}" if failed else exit_text(rc, tail, 2)
        return verdict("fail", f"{summary}; {why}", **data)
    if passed == 0:
        return verdict("fail", f"no test ran on a machine with a GPU ({summary}): {'; '.join(skipped)[:300]}", **data)
    return verdict("pass", summary + (f" ({'; '.join(skipped)[:200]})" if skipped else ""), **data)
