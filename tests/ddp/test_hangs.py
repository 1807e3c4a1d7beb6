"""The hang report's and the straggler check's decisions, on made-up stacks and figures, and the loader workers'
stack dump on a real process. The same cases at 2 ranks, as they happen: tests/ddp/test_hangs_live.py."""

from __future__ import annotations

import multiprocessing
import os
import time

import pytest

from ddp_recipes.config.plan import DDPOptions
from ddp_recipes.data.loader_workers import report_stacks_on_signal
from ddp_recipes.ddp import hangs
from ddp_recipes.ddp.hangs import name_stall, phase_of
from ddp_recipes.errors import ConfigError
from ddp_recipes.train import rank_watch
from ddp_recipes.train.diagnostics import DDPDiagnostics
from ddp_recipes.train.rank_watch import RankWatch

SITE = "/env/lib/python3.12/site-packages"
BACKWARD = [(f"{SITE}/torch/autograd/graph.py", 1113, "_engine_run_backward", "return ..."),
            (f"{SITE}/torch/_tensor.py", 623, "backward", "torch.autograd.backward("),
            (f"{SITE}/lightning/pytorch/core/module.py", 1137, "backward", "loss.backward()"),
            ("/home/me/train.py", 80, "main", "trainer.fit(model)")]


def test_the_phase_and_line_of_a_stack():
    sleep = [("/usr/lib/python3.12/threading.py", 300, "wait", "waiter.acquire()"),
             ("/home/me/model.py", 42, "training_step", "self.ready.wait()"),
             (f"{SITE}/torch/nn/parallel/distributed.py", 1600, "forward", "..."), *BACKWARD[2:]]
    assert phase_of(sleep)[:1] == ("training_step",) and phase_of(sleep)[1].startswith("model.py:42 in training_step")
    assert phase_of(BACKWARD) == ("backward and gradient all-reduce", "train.py:80 in main: trainer.fit(model)", True)
    users = [(f"{SITE}/torch/distributed/c10d_logger.py", 81, "wrapper", ""),
             (f"{SITE}/torch/distributed/distributed_c10d.py", 4800, "barrier", ""),
             ("/home/me/model.py", 50, "training_step", "dist.barrier()")]
    phase, where, waiting = phase_of(users[1:])
    assert (phase, waiting) == ("collective barrier", False) and where.startswith("model.py:50")  # the user's call
    lightning = [users[1], (f"{SITE}/lightning/pytorch/strategies/ddp.py", 300, "barrier", "")]
    assert phase_of(lightning)[2]  # a collective Lightning issued: where every rank goes
    workers = [(f"{SITE}/torch/utils/data/dataloader.py", 1300, "_get_data", ""), *BACKWARD[3:]]
    assert phase_of(workers)[0] == "data fetch (waiting for its loader workers)"


def _post(rank, phase, waiting, step=6, where="model.py:42 in training_step"):
    return {"rank": rank, "step": step, "phase": phase, "where": where, "waiting": waiting, "at": 0.0, "idle": 9.0}


def test_the_line_names_the_rank_that_is_not_where_the_others_are():
    waiting = [_post(r, "backward and gradient all-reduce", True) for r in (0, 2, 3)]
    line = name_stall([*waiting, _post(1, "training_step", False)], 4, 8.0, "--hang-report-s")
    assert line.startswith("DDP hang: no batch finished for 9 s (bound 8 s, --hang-report-s): rank 1 is in "
                           "training_step at step 6 (model.py:42 in training_step)"), line
    assert "the other 3 rank(s) wait in backward and gradient all-reduce at step 6" in line
    silent = name_stall(waiting, 4, 8.0, "--hang-report-s")  # rank 1's Python never ran its report
    assert "rank 1 posted nothing" in silent and "every rank waits" not in silent
    ahead = [_post(0, "optimizer step", False, step=9, where="lightning step"), _post(1, "training_step", False)]
    cuda = name_stall(ahead, 2, 8.0, "--hang-report-s")  # CUDA: rank 0's host ran ahead of its queued all-reduce
    assert "rank 1 is in training_step at step 6" in cuda and "rank 0 is in" not in cuda, cuda
    assert "the other 1 rank(s) wait in optimizer step at step 9" in cuda
    same = name_stall([_post(r, "collective barrier", True) for r in range(2)], 2, 8.0, "--hang-report-s")
    assert "none stands out" in same


@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_a_stalled_loader_worker_is_dumped_by_its_rank(method):
    """A real child process armed as the pack's loader workers are: its rank reads the blocked line. Under a fork
    server (Python 3.14's default on Linux, or a loader's ``multiprocessing_context="forkserver"``) the worker is
    the server's child, not the rank's; the rank must still find it."""
    ctx = multiprocessing.get_context(method)
    ready = ctx.Event()
    child = ctx.Process(target=_blocked_worker, args=(ready,), daemon=True)
    child.start()
    try:
        assert ready.wait(60)
        stacks = hangs._worker_stacks()
        assert child.pid in stacks and "most recent call first" in stacks[child.pid], stacks
        assert hangs._worker_where({child.pid: stacks[child.pid]}).startswith("test_hangs.py:")
        assert "_blocked_worker" in hangs._worker_where(stacks)
    finally:
        child.kill()
        child.join()


def _blocked_worker(ready):
    report_stacks_on_signal()
    ready.set()
    time.sleep(600)  # the blocked read


def test_the_bound_follows_the_steps_seen_and_stays_under_the_timeout():
    watch = RankWatch(None, 600.0)
    assert watch.bound() == 300.0  # before any step: half the collective timeout
    watch._slowest = 0.5
    assert watch.bound() == hangs.AUTO_FLOOR_S  # 20 x 0.5 s: the floor
    watch._slowest = 10.0
    assert watch.bound() == 200.0
    watch._slowest = 100.0
    assert watch.bound() == 300.0
    assert RankWatch(7.0, 600.0).bound() == 7.0


def test_the_hang_bound_is_checked_once_where_it_is_owned():
    assert DDPOptions(hang_report_s="0").hang_report_s == 0.0
    assert DDPOptions(hang_report_s="12", timeout_s=60).hang_report_s == 12.0
    with pytest.raises(ConfigError, match=r"hang_report_s \(60 s\) must be below timeout_s \(60 s\)"):
        DDPOptions(hang_report_s=60, timeout_s=60)
    with pytest.raises(ConfigError, match="hang_report_s"):
        DDPOptions(hang_report_s=-1)


class _Trainer:
    global_step, loggers = 40, []


def _judge(rows_per_window):
    watch, diagnostics = RankWatch(None, 60.0), DDPDiagnostics()
    watch._diagnostics, watch._streak, watch._totals = diagnostics, (-1, "", 0), [[0.0, 0.0, 0] for _ in range(2)]
    for rows in rows_per_window:
        watch._judge(_Trainer(), rows, step_s=0.03)
    return diagnostics.findings, watch.figures


@pytest.mark.filterwarnings("ignore::ddp_recipes.train.diagnostics.DDPDiagnosticWarning")
def test_a_straggler_is_named_after_consecutive_windows_with_its_cause():
    slow_input = [[0, 0.001 * 10, 0.004 * 10, 10], [0, 0.020 * 10, 0.004 * 10, 10]]  # [window, wait s, forward s, n]
    findings, figures = _judge([slow_input] * (rank_watch.STRAGGLER_WINDOWS - 1))
    assert not findings  # not yet: one or two windows may be noise
    findings, figures = _judge([slow_input] * rank_watch.STRAGGLER_WINDOWS)
    assert [code for code, _ in findings] == ["input-bound"] and "rank 1 is a straggler" in findings[0][1]
    assert figures["slowest_rank"] == 1 and figures["fastest_rank"] == 0 and figures["ratio"] == 4.8
    slow_compute = [[0, 0.001 * 10, 0.004 * 10, 10], [0, 0.001 * 10, 0.020 * 10, 10]]
    findings, _ = _judge([slow_compute] * rank_watch.STRAGGLER_WINDOWS)
    assert [code for code, _ in findings] == ["compute-bound"] and "its forward" in findings[0][1]
    noisy = [slow_input, slow_compute, slow_input, [[0, 0.01, 0.04, 10]] * 2]  # never 3 alike in a row
    assert _judge(noisy)[0] == []
    small = [[0, 0.001 * 10, 0.004 * 10, 10], [0, 0.003 * 10, 0.004 * 10, 10]]  # 2 ms late: under the floor
    assert _judge([small] * 5)[0] == []


def test_no_rank_watch_at_one_process_and_one_at_two(tmp_path):
    from ddp_recipes import build_trainer

    one = build_trainer(devices=1, accelerator="cpu", default_root_dir=str(tmp_path), logger=False)
    assert not any(isinstance(c, RankWatch) for c in one.callbacks)
    two = build_trainer(devices=2, accelerator="cpu", hang_report_s=5, timeout_s=30, default_root_dir=str(tmp_path),
                        logger=False)
    watch = next(c for c in two.callbacks if isinstance(c, RankWatch))
    assert (watch.hang_report_s, watch.timeout_s, watch.flag) == (5.0, 30.0, "build_trainer(hang_report_s=...)")
    assert os.path.basename(hangs.REPORT_DIR) == "stall-reports"


def test_a_second_stall_reads_the_workers_new_stack_not_the_first(tmp_path):
    """The worker's dump file keeps every dump: a stall, a recovery and a second stall must show the second place."""
    ctx = multiprocessing.get_context("fork")
    first, moved, go = ctx.Event(), ctx.Event(), ctx.Event()
    child = ctx.Process(target=_worker_that_moves, args=(first, go, moved), daemon=True)
    child.start()
    try:
        assert first.wait(30)
        assert "_first_place" in hangs._worker_where(hangs._worker_stacks())
        go.set()
        assert moved.wait(30)
        time.sleep(0.2)  # into its second sleep
        assert "_second_place" in hangs._worker_where(hangs._worker_stacks())
    finally:
        child.kill()
        child.join()


def _worker_that_moves(first, go, moved):
    report_stacks_on_signal()
    _first_place(first, go)
    _second_place(moved)


def _first_place(first, go):
    first.set()
    go.wait(600)


def _second_place(moved):
    moved.set()
    time.sleep(600)


def test_a_second_stall_at_the_same_step_is_named_too(tmp_path, capsys):
    """A stall, a recovery and a second stall at the same optimizer step (accumulation, or validation after a
    stalled batch, or a second fit in the same process group) each get their line."""
    import torch.distributed as dist

    store = dist.HashStore()
    for _ in range(2):
        watch = hangs.HangWatch(rank=0, world_size=1, store=store, out_dir=str(tmp_path), bound=lambda: 1.0,
                                step=lambda: 6, flag="--hang-report-s")
        watch.report(2.0)
        watch.report(2.0)
    assert capsys.readouterr().err.count("DDP hang: no batch finished") == 4


def test_the_line_does_not_wait_for_a_bucket_that_stopped_answering(s3, capsys):
    """The report file goes to the run's bucket; a bucket that holds every request must not hold the line."""
    import threading

    import torch.distributed as dist

    out = f"{s3.bucket('hang-report-down')}/run"
    watch = hangs.HangWatch(rank=0, world_size=1, store=dist.HashStore(), out_dir=out, bound=lambda: 1.0,
                            step=lambda: 6, flag="--hang-report-s")
    s3.freeze(300)
    try:
        reporter = threading.Thread(target=watch.report, args=(2.0,), daemon=True)
        reporter.start()
        err, deadline = "", time.monotonic() + 60
        while "DDP hang" not in err and time.monotonic() < deadline:
            time.sleep(0.2)
            err += capsys.readouterr().err
        assert "DDP hang: no batch finished" in err and "hang-report-down/run/stall-reports" in err, err
    finally:
        s3.reset_faults()
    reporter.join(120)
    deadline = time.monotonic() + 60  # once the bucket answers, the report is there
    while not s3.keys("hang-report-down", "run/stall-reports/") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert s3.keys("hang-report-down", "run/stall-reports/")


def _started_watches(tmp_path, bounds):
    """One HangWatch per rank of a 2-rank world on one in-memory store, all idle since now, with these bounds."""
    import torch.distributed as dist

    store, progress = dist.HashStore(), time.monotonic()
    watches = [hangs.HangWatch(rank=r, world_size=2, store=store, out_dir=str(tmp_path), bound=lambda b=b: b,
                               step=lambda: 6, flag="--hang-report-s") for r, b in enumerate(bounds)]
    for watch in watches:
        watch.progress = progress
        watch.start()
    return watches


def _until_hang_line(capsys, timeout_s: float = 30) -> str:
    err, deadline = "", time.monotonic() + timeout_s
    while "DDP hang" not in err and time.monotonic() < deadline:
        time.sleep(0.2)
        err += capsys.readouterr().err
    return err


def test_ranks_whose_automatic_bounds_differ_report_the_same_stall(tmp_path, capsys):
    """Each rank derives its bound from the steps it saw: rank 1's is longer than rank 0's plus rank 0's grace.
    Rank 1 must still post its place in time, not be named as a rank whose Python is not running."""
    watches = _started_watches(tmp_path, (1.0, 3.9))
    try:
        err = _until_hang_line(capsys)
    finally:
        for watch in watches:
            watch.stop()
    assert "DDP hang" in err and "posted nothing" not in err, err


def test_a_recovered_stall_is_announced_once(tmp_path, capsys):
    """One line names the stall (from one rank); one line says it is over, from the same rank, not one per rank."""
    watches = _started_watches(tmp_path, (1.0, 1.0))
    try:
        err = _until_hang_line(capsys)
        time.sleep(3)  # the grace: both ranks have posted
        for watch in watches:
            watch.progress = time.monotonic() + 3600  # batches finish again
        time.sleep(1.5)
        err += capsys.readouterr().err
    finally:
        for watch in watches:
            watch.stop()
    assert err.count("DDP hang") == 1 and err.count("progresses again") == 1, err


def test_a_peers_earlier_report_does_not_trigger_a_new_one():
    """A report a peer made before this rank's last finished batch is of a stall that is over for this rank."""
    import torch.distributed as dist

    store = dist.HashStore()
    watch = hangs.HangWatch(rank=1, world_size=2, store=store, out_dir="unused", bound=lambda: 100.0,
                            step=lambda: 6, flag="--hang-report-s")
    assert not watch._peer_stalled(30.0)
    store.set(f"{watch.prefix}stall", str(time.time() - 40))  # reported, then this rank finished batches again
    assert not watch._peer_stalled(30.0)
    store.set(f"{watch.prefix}stall", str(time.time() - 20))  # reported while this rank has been idle
    assert watch._peer_stalled(30.0)


def test_a_bound_past_the_default_collective_timeout_is_refused():
    """With timeout_s unset the collective timeout is torch's default (30 min): a bound past it would report after
    the crash it is meant to come before."""
    import torch

    from ddp_recipes.config import plan

    assert plan.DEFAULT_TIMEOUT_S == torch.distributed.default_pg_timeout.total_seconds()
    with pytest.raises(ConfigError, match=r"hang_report_s \(2000 s\) must be below timeout_s \(1800 s, the default\)"):
        DDPOptions(hang_report_s=2000)
    assert DDPOptions(hang_report_s=1000).hang_report_s == 1000.0
