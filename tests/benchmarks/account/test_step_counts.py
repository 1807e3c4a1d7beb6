"""The bench's whole-iteration count (``benchmarks/account/step_counts.py``) and the fields ``benchmarks overhead`` and
the bench workers report from it (counts only: nothing here is timed)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from benchmarks.account import step_counts
from benchmarks.account.step_counts import PythonCollectives, WholeIterations, per_step


@pytest.fixture
def one_rank_group():
    """A 1-rank gloo process group in this process, destroyed after."""
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield
    dist.destroy_process_group()


def test_each_iteration_counts_its_reads_its_python_collectives_and_what_it_issued(one_rank_group):
    original = dist.all_reduce
    t = torch.ones(2)
    with PythonCollectives() as calls:
        assert dist.all_reduce is not original
        counted = WholeIterations(calls, after=1, count=2)
        for step in range(4):
            counted.mark(step, logs=step == 2)
            if step == 1:
                t.sum().item()
                dist.all_reduce(t)  # called from Python: named and issued
            if step == 2:
                bool(t.sum() > 0)
                # Reached past the wrapper, as C++ code (DDP's reducer) is: issued, not named.
                torch.distributed.distributed_c10d.all_reduce(t)
            dist.all_reduce(t)  # outside the window at steps 0 and 3: not counted anywhere
        counted.close("fit_end")
    assert dist.all_reduce is original  # given back
    assert [(r["steps_done"], r["reads"], r["python"], r["issued"], r["spans"]) for r in counted.rows] == [
        (1, 1, ["all_reduce", "all_reduce"], 2, "step"), (2, 1, ["all_reduce"], 2, "step")]
    assert counted.rows[0]["ops"]["aten::sum"] == 1 and counted.ops()["aten::sum"] == 2  # every op, by name
    counts = per_step(counted.rows)
    assert counts["quiet"]["reads"] == 1 and counts["quiet"]["python"] == 2 and counts["quiet"]["issued"] == 2
    assert counts["log"]["python"] == 1 and counts["log"]["python_names"] == ["all_reduce"]


def test_per_step_leaves_out_ddps_own_call_and_iterations_that_held_an_epoch_end():
    rows = [{"spans": "step", "logs": False, "reads": 0, "python": ["_broadcast_coalesced"], "issued": 3},
            {"spans": "step", "logs": False, "reads": 0, "python": ["_broadcast_coalesced", "broadcast"], "issued": 4},
            {"spans": "epoch_end", "logs": False, "reads": 9, "python": ["all_gather"] * 3, "issued": 9}]
    counts = per_step(rows)
    assert counts["quiet"]["iterations"] == 2 and counts["quiet"]["reads_max"] == 0
    assert counts["quiet"]["python"] == 0.5 and counts["quiet"]["python_max"] == 1
    assert counts["quiet"]["python_names"] == ["_broadcast_coalesced", "broadcast"] and counts["log"] is None
    assert step_counts.DDP_OWN == ("_broadcast_coalesced",)


def _overhead(tmp_path, count_steps: int) -> dict:
    from benchmarks.__main__ import main

    out = tmp_path / "overhead.json"
    assert main(["overhead", "--steps", "4", "--warmup-steps", "2", "--rounds", "2", "--batch-size", "16",
                 "--count-steps", str(count_steps), "--out", str(out)]) == 0
    return json.loads(out.read_text())


def test_bench_overhead_counts_reads_and_collectives_per_step_for_pack_and_plain(tmp_path, capsys):
    result = _overhead(tmp_path, count_steps=20)
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert "host reads per step pack 0 (log steps " in line and "Python collectives per step pack 0" in line
    assert "best of each " in line and "overhead pack/plain " in line
    assert sorted(r["label"] for r in result["rows"]) == ["pack", "pack", "plain", "plain"]  # 2 rounds each
    for row in result["rows"]:
        (counts,) = row["counts"]  # one rank
        assert counts["quiet"]["iterations"] == 18 and counts["log"]["iterations"] == 2  # steps 7..26
        assert counts["quiet"]["python"] == counts["log"]["python"] == 0  # one process: no group
        if row["label"] == "pack":
            assert counts["quiet"]["reads"] == 0  # the contract, seen by the bench
        assert row["steps"] == 4  # the timed steps are as many as without counting
    summary = result["summary"]
    assert summary["pack_over_plain"]["n"] == 2  # a ratio per round
    (pack,) = summary["counts"]["pack"]
    assert pack["quiet"]["iterations"] == 36 and pack["quiet"]["reads"]["max"] == 0
    (plain,) = summary["counts"]["plain"]
    assert plain["log"]["reads"]["min"] >= 1  # a log step reads what the logger writes
    assert "run" not in result["settings"]  # the CLI's handler is not written as a setting


def test_bench_overhead_without_counting_says_so(tmp_path, capsys):
    result = _overhead(tmp_path, count_steps=0)
    assert result["rows"][0]["counts"] is None and result["summary"]["counts"]["pack"] is None
    assert "host reads per step pack not counted" in capsys.readouterr().out


@pytest.mark.parametrize("impl", ["raw", "pack", "plain"])
def test_a_bench_worker_counts_after_its_timed_steps_and_times_as_many_as_without(tmp_path, impl):
    from benchmarks.account.worker import main

    out = tmp_path / f"{impl}.json"
    main([impl, "--out", str(out), "--recipe", "mnist", "--arch", "mlp", "--batch-size", "8", "--steps", "3",
          "--warmup-steps", "1", "--count-steps", "10", "--seed", "1"])
    run = json.loads(out.read_text())
    assert run["measured_steps"] == 3  # the counted iterations are not timed
    (counts,) = run["step_counts_per_rank"]  # one rank
    assert counts["quiet"]["python"] == 0  # one process: no group
    if impl != "plain":  # (plain Lightning's reads are Lightning's to decide)
        assert counts["quiet"]["reads"] == 0
    if impl == "raw":  # it logs nothing
        assert counts["quiet"]["iterations"] == 10 and counts["log"] is None
    else:  # steps 5..14: step 10 logs
        assert counts["quiet"]["iterations"] == 9 and counts["log"]["iterations"] == 1
        assert [row["step"] for row in run["step_count_rows_per_rank"][0]] == list(range(5, 15))


def test_bench_overhead_refuses_a_negative_count(tmp_path, capsys):
    from benchmarks.__main__ import main

    with pytest.raises(SystemExit) as exc:
        main(["overhead", "--count-steps", "-1", "--out", str(tmp_path / "o.json")])
    assert exc.value.code == 2 and "--count-steps" in capsys.readouterr().err.strip().splitlines()[-1]
