"""Preemption at 2 ranks with the signal at awkward moments: every rank stops at the same step, the one after
the boundary where the first signal was seen, saves it, and exits with the agreed signal (issue #31).

``tests/scenarios/preemption_scenario.py`` makes a rank signal itself at a chosen moment of a chosen step (before or
after the step's gradient all-reduce, after the boundary check, during mid-epoch or epoch-end validation, in
the first micro-batch of an accumulation window), on one rank, on both at different steps, and with each
rank started by SLURM instead of Lightning. Counted in steps, never timed.
"""

from __future__ import annotations

import json
import os
import signal
import stat
from pathlib import Path

import pytest

from tests.helpers import free_port
from tests.launch import saved_step, start

ROOT = Path(__file__).resolve().parents[2]
SCENARIO = ROOT / "tests" / "scenarios" / "preemption_scenario.py"
TERM, USR1 = 128 + signal.SIGTERM, 128 + signal.SIGUSR1

# (plan, accumulation, the step every rank stops and saves at, the exit code of every rank); one case in the
# fast suite (each is a 2-rank fit), every moment in the slow one.
CASES = {
    "one-rank-after-its-all-reduce": ("1:3:backward", 1, 4, TERM),
    "accumulation-first-micro-batch": pytest.param(*("1:3:forward", 2, 4, TERM), marks=pytest.mark.slow),
    "one-rank-before-its-all-reduce": pytest.param(*("0:3:forward", 1, 4, TERM), marks=pytest.mark.slow),
    "one-rank-before-optimizer-step": pytest.param(*("1:2:optimizer", 1, 3, TERM), marks=pytest.mark.slow),
    "one-rank-after-the-boundary-check": pytest.param(*("1:3:after-boundary", 1, 5, TERM), marks=pytest.mark.slow),
    "both-ranks-different-steps": pytest.param(*("1:3:optimizer,0:4:forward", 1, 4, TERM), marks=pytest.mark.slow),
    "both-ranks-same-boundary": pytest.param(*("0:3:backward,1:3:after-boundary", 1, 4, TERM), marks=pytest.mark.slow),
    "mid-epoch-validation": pytest.param(*("1:3:validation", 1, 5, TERM), marks=pytest.mark.slow),
    "epoch-end-validation": pytest.param(*("0:6:validation", 1, 6, TERM), marks=pytest.mark.slow),
    "last-step-of-the-epoch": pytest.param(*("1:5:backward", 1, 6, TERM), marks=pytest.mark.slow),
    "accumulation-last-micro-batch": pytest.param(*("0:3:optimizer", 2, 4, TERM), marks=pytest.mark.slow),
}


def _outcome(out: Path) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def _check(out: Path, stderr: str, stop: int, code: int) -> None:
    ranks = _outcome(out)
    assert [r["step"] for r in ranks] == [stop, stop] and [r["code"] for r in ranks] == [code, code], \
        (ranks, stderr[-3000:])
    assert saved_step(out / "checkpoints" / "last.ckpt") == stop
    lines = [line for line in stderr.splitlines() if line.startswith("preempted by")]
    assert len(lines) == 1 and f"at step {stop} " in lines[0], stderr[-3000:]
    assert "Traceback" not in stderr


@pytest.mark.parametrize(("plan", "accumulate", "stop", "code"),
                         list(CASES.values()), ids=list(CASES))
def test_every_rank_stops_at_the_agreed_step(plan, accumulate, stop, code, tmp_path):
    done = start([SCENARIO, tmp_path, plan, accumulate]).finish(timeout=300)
    assert done.returncode == code, done.stderr[-3000:]
    _check(tmp_path, done.stderr, stop, code)


def test_without_last_ckpt_every_rank_still_stops_at_the_agreed_step_and_saves_nothing(tmp_path):
    # enable_checkpointing=False: the agreement replaces Lightning's per-step broadcast here too
    # (tests/cross_cutting/test_step_collectives.py counts it), so it must still stop every rank together.
    done = start([SCENARIO, tmp_path, "1:3:backward", 1, "no-checkpointing"]).finish(timeout=300)
    assert done.returncode == TERM, done.stderr[-3000:]
    assert [r["step"] for r in _outcome(tmp_path)] == [4, 4] and [r["code"] for r in _outcome(tmp_path)] == [TERM] * 2
    lines = [line for line in done.stderr.splitlines() if line.startswith("preempted by")]
    assert lines == ["preempted by SIGTERM at step 4 (epoch 0): nothing saved (this run has no last.ckpt)"], done.stderr
    assert not list(tmp_path.rglob("*.ckpt")) and "Traceback" not in done.stderr


@pytest.mark.slow  # two more ranks' start-up; the fast set has one SLURM task in tests/checkpointing/test_resume.py
def test_slurm_requeue_signal_to_one_task_stops_both_and_requeues_once(tmp_path):
    """Two srun tasks (one process each, as SLURM starts them); SIGUSR1 reaches task 1 only."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'scontrol.log'}\n")
    scontrol.chmod(scontrol.stat().st_mode | stat.S_IEXEC)
    out = tmp_path / "run"
    out.mkdir()
    port = free_port()
    tasks = []
    for rank in range(2):
        slurm = {"SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2", "SLURM_JOB_ID": "4242", "SLURM_PROCID": str(rank),
                 "SLURM_LOCALID": str(rank), "SLURM_NODEID": "0", "SLURM_JOB_NAME": "train",
                 "SLURM_NODELIST": "localhost", "MASTER_ADDR": "127.0.0.1", "PATH": f"{bin_dir}:{os.environ['PATH']}"}
        tasks.append(start([SCENARIO, out, "1:3:backward:SIGUSR1"], env=slurm, port=port))
    done = [task.finish(timeout=300) for task in tasks]
    assert [d.returncode for d in done] == [USR1, USR1], done[1].stderr[-3000:]
    _check(out, done[0].stderr, 4, USR1)
    assert (tmp_path / "scontrol.log").read_text().split() == ["requeue", "4242"]  # rank 0, once
