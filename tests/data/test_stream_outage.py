"""A store outage mid-run ends the job as docs/streaming.md says, at 2 ranks with a loader worker each: the
launcher exits 2 whichever rank fails first, no process of the job (ranks, loader workers) is left once it has
exited, and the one line says whether a checkpoint is kept, and where; for the stream's bucket and for
``--output-dir``'s (moto's S3 server through tests/s3server.py).

Also: a stream run and a folder run at 2 ranks with loader workers print each library warning once, not once per
rank or worker.
"""

from __future__ import annotations

import collections
import os
import signal
import time
from pathlib import Path

import pytest

from ddp_recipes.data.convert import main as convert
from tests.data.stream_checks import PROG
from tests.data.test_stream_stops import from_nth_train_get
from tests.helpers import last_ckpt
from tests.launch import ROOT, run, saved_step, start
from tests.marks import needs_litdata
from tests.resume_scenario import RESNET, args
from tests.s3server import object_upload

pytestmark = needs_litdata
OUTAGE_FIRST = ROOT / "tests" / "scenarios" / "outage_first.py"
LEFT_S = 20  # a process of the job still there this long after the launcher's exit is left behind (a retrying
# loader worker outlives its rank by its backoff, about 45 s here)


@pytest.fixture(scope="module")
def outage_stream(images, s3, tmp_path_factory) -> str:
    """One sample per chunk (each image is over 1 KiB): the n-th chunk request is the n-th sample read."""
    url = f"{s3.bucket('outage')}/one"
    assert convert([str(images), url, "--chunk-bytes", "1KiB", "--workers", "1", "--staging",
                    str(tmp_path_factory.mktemp("staging"))]) == 0
    return url


def stream_args(data_dir: str, every_n: int) -> list[str]:
    """2 ranks, 1 loader worker each, a checkpoint every ``every_n`` steps (6 steps an epoch; 0: at its end)."""
    argv = args(Path("unused"), 2, "--max-epochs", "2", "--checkpoint-every-n-steps", str(every_n))
    argv[argv.index("--data") + 1], argv[argv.index("--data-dir") + 1] = "stream", data_dir
    return argv


def session_pids(session: int) -> list[int]:
    """The live processes of a session (a launched command's, see tests/launch.py), zombies left out."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[3]) == session and fields[0] != "Z":  # (state, ppid, pgrp, session, ...)
                pids.append(int(entry.name))
    return pids


def left_behind(session: int, within_s: float) -> list[str]:
    """The processes of ``session`` still running ``within_s`` after its launcher exited (killed then), each with
    its parent and command line; empty when the job is gone."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not session_pids(session):
            return []
        time.sleep(0.2)
    left = []
    for pid in session_pids(session):
        try:
            ppid = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1]
            cmd = (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:150]
            left.append(f"pid {pid} (parent {ppid}): {cmd}")
        except OSError:
            continue
    os.killpg(session, signal.SIGKILL)
    return left


@pytest.mark.slow  # two 2-rank runs, each until the store fails
@pytest.mark.parametrize(("first", "every_n"), [(1, 2), (0, 0)],
                         ids=["rank1-first-after-a-save", "rank0-first-no-save"])
def test_an_outage_exits_2_leaves_no_process_and_says_what_is_kept(first, every_n, outage_stream, s3, tmp_path):
    """The whole store answers 503 from the 21st chunk request on (each rank's loader has read its first 8 samples
    before training starts, and 2 more by then), in epoch 0; rank ``first`` gives up first (2 attempts), while the
    other rank's loader worker is still retrying. The launcher exits 2 (not 137: Lightning's observer SIGKILLed it
    when a child failed), nothing of the job runs once it has exited (rank 0's worker was left orphaned, retrying
    and logging for minutes), and the one line says what is kept: the step-2 ``last.ckpt`` it names with a
    checkpoint every 2 steps, "none was saved" with one at the epoch's end only (not "its last checkpoint is kept"
    either way)."""
    out = tmp_path / "run"
    s3.fail(10**6, after=from_nth_train_get(21))
    try:
        proc = start([OUTAGE_FIRST, *stream_args(outage_stream, every_n), "--output-dir", out],
                     env={"DDP_RECIPES_CACHE_DIR": str(tmp_path / "machine"), "OUTAGE_FIRST_RANK": str(first)})
        code = proc.wait(timeout=600)
        left = left_behind(proc.pid, LEFT_S)  # with the store still down: a retrying orphan would still be there
    finally:
        s3.reset_faults()
    stderr = proc.finish().stderr
    assert code == 2 and not left, (code, left, stderr[-4000:])
    said = [line for line in stderr.splitlines() if line.startswith(PROG)]
    assert len(said) == 1 and "reading train sample" in said[0], stderr[-4000:]
    assert "failed after 2 attempts" in said[0], said[0]  # rank `first`'s own failure is the one reported
    saved = saved_step(last_ckpt(out))
    if every_n:
        assert saved == 2, saved
        assert said[0].endswith(f"training stopped; its last checkpoint is kept ({last_ckpt(out)}, step {saved}): "
                                "rerun with --resume auto once the store answers"), said[0]
    else:
        assert saved == -1, saved
        assert said[0].endswith("training stopped before its first checkpoint (none was saved): rerun the same "
                                "command once the store answers"), said[0]


@pytest.mark.slow  # a 2-rank run until its bucket fails
def test_an_outage_of_the_output_dirs_bucket_exits_2_and_names_the_checkpoint_kept(images, s3, tmp_path):
    """``--output-dir`` on a bucket that answers 503 from the second checkpoint upload on (the first, at step 2,
    went through): rank 0 fails the save after the retries; exit 2, no process left, and the line names
    ``--output-dir`` and the step-2 checkpoint that ``--resume auto`` continues from."""
    out = s3.bucket("outage-out") + "/run"
    uploads = [0]

    def second_upload(method: str, path: str) -> bool:
        uploads[0] += object_upload(method, path)
        return uploads[0] >= 2

    s3.fail(10**6, after=second_upload)
    try:
        proc = start([*RESNET, *args(images, 2, "--max-epochs", "1", "--checkpoint-every-n-steps", "2"),
                      "--output-dir", out], env={"DDP_RECIPES_STORAGE_BASE_DELAY_S": "0.05"})
        code = proc.wait(timeout=600)
        left = left_behind(proc.pid, LEFT_S)
    finally:
        s3.reset_faults()
    stderr = proc.finish().stderr
    assert code == 2 and not left, (code, left, stderr[-4000:])
    said = [line for line in stderr.splitlines() if line.startswith(PROG)]
    assert len(said) == 1 and said[0].startswith(f"{PROG}--output-dir: upload of {out}/"), stderr[-4000:]
    assert said[0].endswith(f"training stopped; its last checkpoint is kept ({out}/checkpoints/last.ckpt, step 2): "
                            "rerun with --resume auto once the store answers"), said[0]


def repeated_lines(output: str) -> dict[str, int]:
    """The lines printed more than once (a rule of dashes, blank lines and the per-rank start lines aside)."""
    counts = collections.Counter(line.strip() for line in output.splitlines())
    return {line: n for line, n in counts.items() if n > 1 and len(line) > 20 and set(line) - set("-|= ")}


@pytest.mark.slow  # two 2-rank runs
@pytest.mark.parametrize("data", ["stream", "imagefolder"])
def test_each_library_warning_is_printed_once_at_2_ranks_with_loader_workers(data, images, local_stream, tmp_path):
    """litdata warned that drop_last was disabled once per rank and per loader worker (6 times in one epoch here,
    10 in a user's run), about an option of litdata's iteration, which the pack never uses; no warning may repeat."""
    argv = args(images, 2, "--max-epochs", "1", "--num-workers", "2")
    argv[argv.index("--data") + 1] = data
    argv[argv.index("--data-dir") + 1] = str(local_stream if data == "stream" else images)
    done = run([*RESNET, *argv, "--output-dir", tmp_path / "out"], timeout=600, quiet=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "drop_last" not in done.stderr
    assert repeated_lines(done.stderr) == {}, done.stderr[-3000:]  # (stdout: progress bars, redrawn)
