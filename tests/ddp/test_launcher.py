"""The pack's ``--devices N`` launcher observer (ddp_recipes/ddp/launcher.py) with real child processes: the first
child that fails names the job's exit code; a rank 0 that does not stop on its own is ended with it, its other
children killed. End to end at 2 ranks: tests/data/test_stream_outage.py (slow)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

from ddp_recipes.ddp.launcher import RankObserver, ended, exit_code
from tests.launch import run


def test_a_child_killed_by_a_signal_is_reported_as_a_shell_does():
    assert exit_code(2) == 2 and exit_code(-signal.SIGKILL) == 137
    assert ended(2) == "exited with code 2" and ended(-signal.SIGKILL) == "was killed by SIGKILL"


OBSERVED = textwrap.dedent("""
    import subprocess, sys, time
    from ddp_recipes.ddp.launcher import RankObserver
    failing = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5); raise SystemExit(2)"])
    stuck = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print(stuck.pid, flush=True)
    RankObserver([failing, stuck], grace_s=1.0).start()
    time.sleep(600)  # rank 0 blocked (in a collective, on its loader): it never stops on its own
""")


def test_a_rank_0_that_does_not_stop_is_ended_with_the_failed_childs_code_and_its_other_children_killed():
    done = run(["-c", OBSERVED], timeout=60, port=False)
    stuck = int(done.stdout.split()[0])
    assert done.returncode == 2, done.stderr
    assert "local rank 1 exited with code 2 and this rank did not stop within 1 s: ending it, exit 2" in done.stderr
    try:
        with open(f"/proc/{stuck}/stat") as stat:
            assert stat.read().rsplit(")", 1)[1].split()[0] == "Z", "the stuck child still runs"
    except FileNotFoundError:
        pass  # gone (reaped)


def test_a_failure_rank_0_meets_first_stays_its_own():
    """Rank 0 failed first: a child that then stops on the lost peer (code 1) names nothing, ends nothing."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3); raise SystemExit(1)"])
    observer = RankObserver([child], grace_s=0.5)
    observer.start()
    assert observer.main_failed(ValueError("rank 0's own error")) is None
    child.wait()
    observer.join(timeout=5)
    assert not observer.is_alive() and observer.first is None
