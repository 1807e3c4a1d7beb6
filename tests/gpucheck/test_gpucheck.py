"""gpu-check on CPU: verdicts, budgets and timeouts, whole process trees killed, the order of the checks, the
machine's own verdict (no CUDA; a driver that shows a GPU torch does not see), the report and the exit codes.

The GPU checks run only on a GPU; here small fake checks stand in for them: real commands that sleep,
start children in sessions of their own, leave orphans behind and exit with a code, run through the real
runner. That exercises the runner itself, no back-end is mocked.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import stat
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.gpucheck import check as gc
from tests.gpucheck import machine as machine_module
from tests.gpucheck import report, runner
from tests.gpucheck.machine import Driver, Machine, compile_blocker, compile_problem
from tests.gpucheck.proctree import alive
from tests.launch import ROOT, run, start

PY = sys.executable
QUIET = dict(progress=lambda _: None)

# A check's command that starts a child in a session of its own (as tests/launch.py does) and an orphan (its
# parent exits at once, in another session too), writes their pids, then sleeps or exits with CODE.
FAMILY = textwrap.dedent("""
    import subprocess, sys, time
    out, then = sys.argv[1], sys.argv[2]
    sleep = [sys.executable, "-c", "import time; time.sleep(120)"]
    child = subprocess.Popen(sleep, start_new_session=True)
    orphan = sys.executable, "-c", ("import subprocess, sys; p = subprocess.Popen(%r, start_new_session=True, "
                                    "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); print(p.pid)") % (sleep,)
    mid = subprocess.run(orphan, capture_output=True, text=True)
    open(out, "w").write(f"{child.pid} {mid.stdout.strip()}")
    if then == "sleep":
        time.sleep(120)
    sys.exit(int(then))
""")


def family(tmp_path: Path, name: str, then: str, timeout_s: float = 60, **kw) -> tuple[runner.Check, Path]:
    script, pids = tmp_path / "family.py", tmp_path / f"{name}.pids"
    script.write_text(FAMILY)
    return runner.Check(name, f"fake {name}", [PY, str(script), str(pids), then], timeout_s=timeout_s, **kw), pids


def fake(name: str, code: str, timeout_s: float = 60, **kw) -> runner.Check:
    return runner.Check(name, f"fake {name}", [PY, "-c", code], timeout_s=timeout_s, **kw)


def pids_of(path: Path) -> list[int]:
    return [int(p) for p in path.read_text().split()]


def all_gone(pids: list[int], within_s: float = 5.0) -> bool:
    deadline = time.monotonic() + within_s
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not any(alive(p) for p in pids)


# ---- the runner: verdicts, timeouts, budget, process trees ----------------------------------------------

SETUP_S = 8  # the first limit the fake check's family (four Python processes) gets to start in


def family_up(pids: Path) -> bool:
    return pids.exists() and len(pids.read_text().split()) == 2


def with_the_family_up(pids: Path, attempt: Callable[[float], Any]) -> tuple[Any, float]:
    """``attempt(limit)`` with a limit that the fake check's whole family started within: only a cut of the
    whole family proves what these tests assert. A loaded machine that had not started it by the limit gets
    the attempt again with twice the limit (up to 8 x SETUP_S); the limit used is returned with the result."""
    limit = SETUP_S
    while True:
        pids.unlink(missing_ok=True)
        result = attempt(limit)
        if family_up(pids) or limit >= 8 * SETUP_S:
            return result, limit
        limit *= 2


def test_a_hang_past_its_own_timeout_fails_and_its_whole_tree_dies(tmp_path):
    def attempt(limit: float) -> dict:
        check, _ = family(tmp_path, "hang", "sleep", timeout_s=limit)
        [result] = runner.run_checks([check], gpus=1, out_dir=tmp_path, budget_s=300, **QUIET)
        return result

    pids = tmp_path / "hang.pids"
    result, limit = with_the_family_up(pids, attempt)
    assert family_up(pids), result
    timed = re.search(r"timed out after (\d+) s, its own limit", result["reason"])
    assert result["verdict"] == "fail" and timed, result
    assert limit <= int(timed[1]) < 120, result  # cut at its own limit, not at the end of its 120 s sleep
    assert "4 process(es) killed" in result["reason"]  # the command, its child, the orphan, and the shepherd
    assert all_gone(pids_of(pids)), "a process of the check outlived its timeout (own session, or orphaned)"


def test_the_budget_cut_is_incomplete_not_a_failure_and_the_rest_is_not_started(tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "MIN_START_S", 1.0)

    def attempt(budget: float) -> tuple[list[dict], list[str]]:
        check, _ = family(tmp_path, "long", "sleep", timeout_s=100)  # its own limit: more than any budget here
        lines: list[str] = []
        return runner.run_checks([check, fake("next", "pass")], gpus=1, out_dir=tmp_path, budget_s=budget,
                                 progress=lines.append), lines

    pids = tmp_path / "long.pids"
    ((first, second), lines), budget = with_the_family_up(pids, attempt)
    assert first["verdict"] == "incomplete" and first["reason"].startswith("the budget ran out"), first
    assert "its own limit is 100 s" in first["reason"]
    assert second["verdict"] == "incomplete" and second["reason"].startswith("not started:")
    assert all_gone(pids_of(pids))
    # The progress line: its timeout is what was left of the budget (the same figure), never more than it.
    shown = re.match(r"\[gpu-check 1/2\] long: fake long \(timeout (\d+) s, (\d+) s of the budget left\)", lines[0])
    assert shown and shown[1] == shown[2] and int(shown[1]) <= budget, lines[0]


def test_what_a_check_leaves_running_is_killed_and_reported(tmp_path):
    check, pids = family(tmp_path, "leaky", "0")
    [result] = runner.run_checks([check], gpus=1, out_dir=tmp_path, budget_s=300, **QUIET)
    assert result["verdict"] == "pass"  # it did what it names; its leftovers are gone and said
    assert "left 2 process(es) running at its end, killed" in result["reason"]
    assert len(result["data"]["leftovers"]) == 2
    assert all_gone(pids_of(pids)), "a leftover would skew the next check's figures"


def test_exit_codes_and_unreadable_results_fail(tmp_path):
    check, pids = family(tmp_path, "bad", "3")
    unreadable = fake("unreadable", "pass", judge=gc.throughput_judge)  # writes no run.json
    bad, unread = runner.run_checks([check, unreadable], gpus=1, out_dir=tmp_path, budget_s=300, **QUIET)
    assert bad["verdict"] == "fail" and bad["reason"].startswith("exit 3")
    assert unread["verdict"] == "fail" and "could not read its result" in unread["reason"]
    assert all_gone(pids_of(pids))


def test_a_reason_says_how_the_command_ended_even_when_it_printed_nothing(tmp_path):
    assert runner.exit_text(-9, "") == "exit -9 (SIGKILL), no output"  # the shepherd itself killed
    assert runner.exit_text(137, "a\nb\n") == "exit 137 (SIGKILL): a | b"  # the shepherd's 128 + N
    assert runner.exit_text(3, "1\n2\n3\n4\n") == "exit 3: 2 | 3 | 4"
    # Killed with no output, and a process left behind: one reason, no empty tail.
    code = ("import os, signal, subprocess, sys; subprocess.Popen([sys.executable, '-c', 'import time; "
            "time.sleep(60)'], start_new_session=True); os.kill(os.getpid(), signal.SIGKILL)")
    [silent] = runner.run_checks([fake("silent", code, judge=gc.throughput_judge)], gpus=1, out_dir=tmp_path,
                                 budget_s=300, **QUIET)
    assert silent["verdict"] == "fail", silent
    assert silent["reason"].startswith("exit 137 (SIGKILL), no output; left 1 process(es) running"), silent


def test_what_this_machine_cannot_run_is_no_verdict_with_the_reason(tmp_path):
    checks = [fake("one", "pass"), fake("two", "pass", min_gpus=2), fake("compiled", "pass", compiled=True)]
    none = runner.run_checks(checks, gpus=0, out_dir=tmp_path, budget_s=300, **QUIET)
    assert [(r["verdict"], r["reason"]) for r in none] == [("no verdict", "no CUDA device")] * 3
    one = runner.run_checks(checks, gpus=1, out_dir=tmp_path, budget_s=300, compile_problem="no C compiler", **QUIET)
    assert [r["verdict"] for r in one] == ["pass", "no verdict", "no verdict"]
    assert one[1]["reason"] == "needs 2+ GPUs (1 visible)"
    assert one[2]["reason"] == "torch.compile cannot build code here: no C compiler"


def test_the_report_is_rewritten_after_every_check(tmp_path):
    seen: list[list[str]] = []
    runner.run_checks([fake("a", "pass"), fake("b", "pass")], gpus=1, out_dir=tmp_path, budget_s=300,
                      after_each=lambda done: seen.append([r["name"] for r in done]), **QUIET)
    assert seen == [["a"], ["a", "b"]]



def test_a_relative_out_dir_is_under_the_callers_directory(tmp_path, monkeypatch):
    """Checks run in the checkout; a relative --out-dir still names a folder under gpu-check's own directory,
    for what the checks write there as for the report."""
    monkeypatch.chdir(tmp_path)
    writes = runner.Check("writes", "writes into its work dir",
                          [PY, "-c", "import sys; open(sys.argv[1], 'w').write('ok')", "{work}/out.txt"], timeout_s=60)
    [result] = runner.run_checks([writes], gpus=1, out_dir=Path("results"), budget_s=300, **QUIET)
    assert result["verdict"] == "pass", result
    assert (tmp_path / "results" / "gpu-check" / "writes" / "out.txt").read_text() == "ok"

# ---- pytest checks ------------------------------------------------------------------------------------

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="{n}" failures="{f}"
errors="0" skipped="{s}">{cases}</testsuite></testsuites>"""


def junit(work: Path, passed: int, failed: int, skipped: int) -> Path:
    cases = "<testcase name='ok'/>" * passed
    cases += "<testcase name='test_bad'><failure message='AssertionError: 1 != 2'/></testcase>" * failed
    cases += "<testcase name='nccl'><skipped message='needs 2+ CUDA GPUs'/></testcase>" * skipped
    work.mkdir(parents=True, exist_ok=True)
    (work / "junit.xml").write_text(JUNIT.format(n=passed + failed + skipped, f=failed, s=skipped, cases=cases))
    return work


def test_pytest_verdicts(tmp_path):
    ok = runner.pytest_judge(0, junit(tmp_path / "a", 3, 0, 2), "")
    assert ok["verdict"] == "pass" and ok["reason"].startswith("3 passed, 2 skipped, 0 failed")
    assert ok["data"]["skipped_reasons"] == ["needs 2+ CUDA GPUs"]
    bad = runner.pytest_judge(1, junit(tmp_path / "b", 3, 1, 0), "")
    assert bad["verdict"] == "fail" and "test_bad: AssertionError: 1 != 2" in bad["reason"]
    # Only a machine with a GPU runs a gpu check: a run in which every test skipped is a failure there.
    none = runner.pytest_judge(0, junit(tmp_path / "c", 0, 0, 4), "")
    assert none["verdict"] == "fail" and none["reason"].startswith("no test ran on a machine with a GPU")
    assert runner.pytest_judge(2, junit(tmp_path / "d", 2, 0, 0), "interrupted")["verdict"] == "fail"


def test_a_cut_pytest_run_says_what_it_had_shown(tmp_path):
    (tmp_path / "output.log").write_text("tests/gpu/test_gpu.py::test_a PASSED [ 10%]\n"
                                         "tests/gpu/test_gpu.py::test_b SKIPPED (needs 2+ CUDA GPUs) [ 20%]\n"
                                         "tests/gpu/test_gpu.py::test_c FAILED [ 30%]\n"
                                         "tests/gpu/test_gpu.py::test_d \n")
    assert runner.pytest_partial(tmp_path, "") == ("before the cut: 1 failed, 1 passed, 1 skipped; running: "
                                                   "tests/gpu/test_gpu.py::test_d; failed: "
                                                   "tests/gpu/test_gpu.py::test_c", True)


def test_a_cut_check_whose_output_already_shows_a_failure_fails(tmp_path, monkeypatch):
    """The budget cut hides nothing when a test had already failed: fail, not incomplete; a cut run whose
    output shows no failure stays incomplete."""
    monkeypatch.setattr(runner, "MIN_START_S", 1.0)
    code = ("import sys, time; print('tests/gpu/test_gpu.py::test_a {}', flush=True); time.sleep(60)")
    checks = [fake(name, code.format(outcome), timeout_s=100, partial=runner.pytest_partial)
              for name, outcome in (("failed", "FAILED"), ("passed", "PASSED"))]
    done = [runner.run_checks([c], gpus=1, out_dir=tmp_path, budget_s=6, **QUIET)[0] for c in checks]
    assert done[0]["verdict"] == "fail" and "already shows a failure" in done[0]["reason"], done[0]
    assert "failed: tests/gpu/test_gpu.py::test_a" in done[0]["reason"]
    assert done[1]["verdict"] == "incomplete", done[1]


def test_gpu_pytest_collects_the_gpu_tier_files_only():
    """Collecting all of tests/ imports every test module (and the optional packages some import) before a
    single GPU test runs. The list must hold every file with a gpu-marked test."""
    cmd = gc.pytest_cmd("not kill_and_resume")
    assert cmd[-len(gc.GPU_TEST_FILES):] == list(gc.GPU_TEST_FILES) and "tests" not in cmd
    uses = re.compile(r"^(pytestmark = pytest\.mark\.gpu|\s*@pytest\.mark\.gpu\b)", re.MULTILINE)
    marked = {p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").rglob("test_*.py")
              if uses.search(p.read_text())}
    assert marked == set(gc.GPU_TEST_FILES)
    assert ["-m", "gpu"] in [cmd[i:i + 2] for i in range(len(cmd))]
    assert "-v" in cmd  # a cut run still shows its outcomes so far


def test_the_gpu_tier_needs_nothing_outside_the_checkout(tmp_path):
    """Only the working tree travels to a GPU machine: no gpu test reads ../shared. Its compile test trains on
    made-up MNIST files instead, which the recipe learns (checked here on CPU)."""
    from recipes import mnist
    from tests.helpers import write_synthetic_mnist

    for name in gc.GPU_TEST_FILES:
        assert "SHARED_DATA" not in (ROOT / name).read_text(), f"{name} reads the shared data"
    data = write_synthetic_mnist(tmp_path / "data", n_train=2048, n_test=256)
    summary = mnist.main(["--accelerator", "cpu", "--data-dir", str(data), "--no-download", "--max-steps", "40",
                          "--seed", "3", "--output-dir", str(tmp_path / "out")])
    assert summary["test_acc"] > 0.5  # chance is 0.1


# ---- the plan: order of value ---------------------------------------------------------------------------

def plan_args(*argv: str) -> argparse.Namespace:
    return gc._parser().parse_args(list(argv))


DEFAULTS = ["sync-debug", "resnet50-pack", "resnet50-raw", "pack-vs-raw", "gpu-tests", "cuda-kill-resume"]


def test_checks_run_in_order_of_value_and_the_defaults_are_what_a_slot_runs():
    assert [c.name for c in gc.plan_checks(plan_args(), gpus=1)] == DEFAULTS
    everything = [c.name for c in gc.plan_checks(plan_args("--compile", "--decode-gpu", "--bench"), gpus=1)]
    assert everything == [*DEFAULTS, "decode-gpu", "resnet50-pack-compiled", "resnet50-raw-compiled",
                          "pack-vs-raw-compiled", "bench-multi-gpu"]
    assert [c.name for c in gc.plan_checks(plan_args("--decode-gpu"), gpus=1)] == [*DEFAULTS, "decode-gpu"]
    compiled = {c.name: c for c in gc.plan_checks(plan_args("--compile"), gpus=1)}
    assert compiled["resnet50-pack-compiled"].compiled and not compiled["resnet50-pack"].compiled
    only = [c.name for c in gc.plan_checks(plan_args("--only", "resnet50-raw,resnet50-pack"), gpus=1)]
    assert only == ["resnet50-pack", "resnet50-raw", "pack-vs-raw"]  # the derived check comes with its inputs
    assert [c.name for c in gc.plan_checks(plan_args("--only", "resnet50-pack-compiled"), gpus=1)] == [
        "resnet50-pack-compiled"]  # --only reaches what the flags add


def test_the_defaults_end_well_inside_the_budget_and_each_timeout_fits_in_it():
    """The default checks' estimated seconds on one H100/H200 (cold) fill at most three quarters of the 7-minute
    budget, so that a sound pack ends 'pass', not 'incomplete', well within 8 minutes."""
    assert gc.TOTAL_BUDGET_S == 420
    every = [c for c in gc.plan_checks(plan_args("--compile", "--decode-gpu", "--bench"), gpus=8)
             if isinstance(c, runner.Check)]
    assert {c.name for c in every} == set(gc.ESTIMATE_S)
    assert all(gc.ESTIMATE_S[c.name] < c.timeout_s <= gc.TOTAL_BUDGET_S for c in every)
    defaults = [c for c in gc.plan_checks(plan_args(), gpus=8) if isinstance(c, runner.Check)]
    assert sum(gc.ESTIMATE_S[c.name] for c in defaults) <= 0.75 * gc.TOTAL_BUDGET_S
    # decode-gpu: a JPEG folder and two cold recipe processes (~45 s each, gpucheck's comment): a 60 s limit cut
    # a sound run and called it a failure (issue #39.4)
    assert next(c for c in every if c.name == "decode-gpu").timeout_s >= 100


def test_unknown_only_name_is_refused(capsys):
    with pytest.raises(SystemExit) as info:
        gc.main(["--only", "resnet50-pack,nope", "--out-dir", "unused"])
    assert info.value.code == 2 and "--only: no check named nope" in capsys.readouterr().err


# ---- derived checks, overall verdicts, figures --------------------------------------------------------

def run_row(name: str, rate: float, status: str = "pass") -> dict:
    return {"name": f"resnet50-{name}", "verdict": status, "reason": "", "seconds": 1.0,
            "data": {"images_per_s": rate, "step_ms_median": 1.0, "first_step_s": 1.0}}


def test_pack_vs_raw_and_mfu():
    eager, compiled = gc.pack_vs_raw(""), gc.pack_vs_raw("-compiled")
    done = {r["name"]: r for r in (run_row("pack", 950.0), run_row("raw", 1000.0), run_row("pack-compiled", 800.0),
                                   run_row("raw-compiled", 1000.0))}
    assert eager.compute(done)["verdict"] == "pass" and compiled.compute(done)["data"]["ratio"] == 0.8
    assert compiled.compute(done)["verdict"] == "fail"
    done["resnet50-raw"]["verdict"] = "incomplete"
    assert eager.compute(done)["verdict"] == "incomplete"  # never a failure the budget caused
    done["resnet50-raw"]["verdict"] = "fail"
    assert eager.compute(done)["verdict"] == "no verdict"  # the run itself carries the failure
    rows = report.throughput_rows([run_row("pack", 1000.0)], flops_per_sample=int(12e9), peak=1e15)
    assert rows[0]["achieved_tflops"] == 12.0 and rows[0]["mfu"] == 0.012
    assert report.throughput_rows([run_row("pack", 1000.0)], None, 1e15)[0]["mfu"] is None


def test_the_report_reads_cleanly(tmp_path, monkeypatch):
    """No stray spaces where a reference row names no GPU; 'no verdict' blames --only where --only chose."""
    built = report.build_report([], {}, 420, 1.0, [], report.reference_rows("bf16-mixed", None, None), {})
    lines = report.markdown(built).splitlines()
    assert "- bf16-mixed: no figure; unavailable" in "\n".join(lines) and not any("  " in x for x in lines), lines
    monkeypatch.setattr(gc, "inspect_machine", lambda check_compile: a_gpu_machine())  # 1 GPU
    assert gc.main(["--out-dir", str(tmp_path), "--only", "bench-multi-gpu"]) == 4  # needs 2+ GPUs
    saved = json.loads((tmp_path / "gpu-report.json").read_text())
    assert saved["meaning"] == "none of the checks --only bench-multi-gpu selects can run on this machine (the " \
                               "others were not asked for)", saved["meaning"]
    monkeypatch.setattr(gc, "plan_checks", lambda args, gpus: [fake("multi", "pass", min_gpus=2)])
    assert gc.main(["--out-dir", str(tmp_path)]) == 4
    saved = json.loads((tmp_path / "gpu-report.json").read_text())
    assert saved["meaning"] == "nothing could be checked on this machine"


def test_a_pass_with_checks_that_did_not_apply_names_them():
    """Exit 0 with the compiled checks 'no verdict' (no C toolchain) must not read as 'everything ran'."""
    results = [{"name": "sync-debug", "verdict": "pass", "reason": "", "seconds": 30},
               {"name": "resnet50-pack-compiled", "verdict": "no verdict", "reason": "no C compiler",
                "seconds": 0}]
    built = report.build_report(results, {}, 420, 1.0, [], [], {})
    assert built["exit_code"] == 0
    assert built["meaning"].endswith("not checked here (no verdict, see each reason): resnet50-pack-compiled")
    assert "not checked here" in report.markdown(built)
    everything = report.build_report(results[:1], {}, 420, 1.0, [], [], {})
    assert everything["meaning"] == "every check that applies here ran and passed"


def test_reference_rows_never_show_another_precisions_figure():
    [bf16] = report.reference_rows("bf16-mixed", 989e12, "NVIDIA H100 80GB HBM3")
    assert bf16["images_per_s"] is None and bf16["label"].startswith("unavailable")
    a100 = next(r for r in report.reference_rows("16-mixed", 989e12, "NVIDIA H100 80GB HBM3")
                if r["gpu"].startswith("A100"))
    assert a100["images_per_s"] == 2470.0 and a100["scaled_images_per_s"] == round(2470 * 989 / 312, 1)
    assert "scaled" in a100["label"] and "estimate" in a100["label"]


def decode_run(rate: float | None, wait: float | None, record: dict | None = None) -> dict:
    return {"images_per_s": rate, "input_wait_fraction": wait, "num_workers": 8, "steps": 16, "decode": record}


def write_decode(work: Path, gpu_record: dict, gpu_rate: float | None = 2900.0) -> Path:
    work.mkdir(parents=True, exist_ok=True)
    found = {"cpu": decode_run(1450.0, 0.412), "gpu": decode_run(gpu_rate, 0.013, gpu_record), "batch_size": 128}
    (work / "decode.json").write_text(json.dumps(found))
    return work


def test_decode_gpu_reports_both_rates_and_waits_and_fails_off_cuda_or_on_a_fallback(tmp_path):
    [check] = [c for c in gc.plan_checks(plan_args("--only", "decode-gpu"), gpus=1)]
    assert check.cmd[2:4] == ["tests.gpucheck.worker", "decode-gpu"] and check.judge is gc.decode_judge
    cuda = {"device": "cuda:0", "images": 2304, "cpu_fallbacks": 0}
    ok = check.judge(0, write_decode(tmp_path / "ok", cuda), "")
    assert ok["verdict"] == "pass", ok
    assert ok["reason"] == ("decode cpu: 1450.0 images/s, input wait 41.2% (8 workers); decode gpu: 2900.0 images/s, "
                            "input wait 1.3%; gpu/cpu = 2.00")
    assert ok["data"]["gpu_vs_cpu"] == 2.0 and ok["data"]["cpu"]["input_wait_fraction"] == 0.412
    slower = check.judge(0, write_decode(tmp_path / "slower", cuda, gpu_rate=1000.0), "")
    assert slower["verdict"] == "pass" and "gpu/cpu = 0.69" in slower["reason"]  # measured, not judged by speed
    refused = check.judge(0, write_decode(tmp_path / "refused", {**cuda, "cpu_fallbacks": 3}), "")
    assert refused["verdict"] == "fail" and refused["reason"].startswith("nvJPEG refused 3 of 2304 plain baseline")
    on_cpu = check.judge(0, write_decode(tmp_path / "cpu", {**cuda, "device": "cpu"}), "")
    assert on_cpu["verdict"] == "fail" and on_cpu["reason"].startswith("--decode gpu decoded on cpu, not CUDA")
    unmeasured = check.judge(0, write_decode(tmp_path / "none", cuda, gpu_rate=None), "")
    assert unmeasured["verdict"] == "fail" and "no steady-state rate" in unmeasured["reason"]
    assert (check.judge(1, tmp_path / "missing", "Traceback\nRuntimeError: boom")["reason"]
            == "exit 1: Traceback | RuntimeError: boom")
    # A cut during the second run still says what the first measured; the report's row carries the figures.
    (tmp_path / "cut").mkdir()
    (tmp_path / "cut" / "decode.json").write_text(json.dumps({"cpu": decode_run(1450.0, 0.4)}))
    assert check.partial(tmp_path / "cut", "") == ("decode cpu ran: 1450.0 images/s", False)
    assert check.partial(tmp_path / "nothing", "") == ("", False)
    built = report.build_report([{"name": "decode-gpu", "what": check.what, "seconds": 31.0, **ok}],
                                a_gpu_machine().to_dict(), 420, 31.0, [], [], {"batch_size": 128}, None, True)
    assert f"| decode-gpu | pass | 31.0 | {ok['reason']} |" in report.markdown(built)


@pytest.mark.slow  # two recipe runs, each its own process: about a minute on 2 loaded cores
def test_the_decode_gpu_check_runs_the_recipe_both_ways(tmp_path):
    """The check's own command, made small and run on the CPU through the real runner: it writes the folder,
    runs the recipe with --decode cpu and gpu, and its judge reads both summaries (and fails it here: the
    decode ran on the CPU, not on CUDA)."""
    [check] = [c for c in gc.plan_checks(plan_args("--only", "decode-gpu"), gpus=1)]
    check.cmd += ["--accelerator", "cpu", "--arch", "resnet18", "--image-size", "16", "--batch-size", "4", "--steps",
                  "3", "--precision", "32-true"]
    check.timeout_s = 240
    [result] = runner.run_checks([check], gpus=1, out_dir=tmp_path, budget_s=300, **QUIET)
    from ddp_recipes.data.decoders import image_decoders

    assert result["verdict"] == "fail" and result["reason"].startswith("--decode gpu decoded on cpu, not CUDA"), result
    data = result["data"]
    for decode in ("cpu", "gpu"):
        assert data[decode]["images_per_s"] > 0 and 0 <= data[decode]["input_wait_fraction"] <= 1
        assert data[decode]["steps"] == 3
    assert data["cpu"]["decode"] is None  # the PIL pipeline
    assert data["gpu"]["decode"] == {"device": "cpu", "images": 3 * 4 + 2 * 4, "cpu_fallbacks": 0,  # + sanity, test
                                     "decoder": image_decoders().name}
    work = tmp_path / "gpu-check" / "decode-gpu"
    assert len(list((work / "jpegs" / "train").rglob("*.jpg"))) == 16


@pytest.mark.parametrize(("verdicts", "expected"), [
    (["pass", "pass"], "pass"),
    (["pass", "no verdict"], "pass"),  # a check this machine cannot run does not stop a pass
    (["pass", "incomplete"], "incomplete"),
    (["pass", "incomplete", "fail"], "fail"),
    (["no verdict", "no verdict"], "no verdict"),  # nothing was checked
    ([], "no verdict"),
])
def test_the_overall_verdict_and_its_exit_code(verdicts, expected):
    results = [{"verdict": v} for v in verdicts]
    assert report.overall(results) == expected
    assert report.EXIT_CODES[expected] == {"pass": 0, "fail": 1, "incomplete": 3, "no verdict": 4}[expected]
    assert report.overall([{"verdict": "pass"}], finished=False) == "incomplete"
    assert report.overall([{"verdict": "pass"}], ("fail", "the driver shows 1 GPU")) == "fail"


# ---- main: the machine, the report files, the exit code -----------------------------------------------

def a_gpu_machine(**kw) -> Machine:
    facts = dict(gpus=1, gpu="Fake GPU", capability="9.0", peak_flops_per_sec=None, torch_cuda="13.0", cudnn=91900,
                 torch_error=None, cuda_visible_devices=None,
                 driver=Driver(tool="nvidia-smi", gpus=["Fake GPU, 1 MiB"]), versions={"torch": "2.11.0"},
                 python="3.12.1")
    return Machine(**{**facts, **kw})


def test_main_writes_the_report_and_exits_by_the_verdict(tmp_path, monkeypatch):
    monkeypatch.setattr(gc, "inspect_machine", lambda check_compile: a_gpu_machine())
    plans = {"fail": [fake("good", "pass"), fake("broken", "raise SystemExit(1)"), fake("multi", "pass", min_gpus=2)],
             "pass": [fake("good", "pass"), fake("multi", "pass", min_gpus=2)]}
    monkeypatch.setattr(gc, "plan_checks", lambda args, gpus: plans["fail"])
    assert gc.main(["--out-dir", str(tmp_path)]) == 1
    saved = json.loads((tmp_path / "gpu-report.json").read_text())
    assert saved["verdict"] == "fail" and saved["exit_code"] == 1 and saved["finished"] is True
    assert saved["counts"] == {"pass": 1, "fail": 1, "incomplete": 0, "no verdict": 1}
    md = (tmp_path / "gpu-report.md").read_text()
    assert md.startswith("# gpu-check: FAIL (exit 1)") and "| broken | fail |" in md
    monkeypatch.setattr(gc, "plan_checks", lambda args, gpus: plans["pass"])
    assert gc.main(["--out-dir", str(tmp_path)]) == 0  # what this machine cannot run does not fail it
    assert json.loads((tmp_path / "gpu-report.json").read_text())["checks"][1]["verdict"] == "no verdict"


def test_main_exits_3_when_the_budget_ran_out(tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "MIN_START_S", 1.0)
    monkeypatch.setattr(gc, "inspect_machine", lambda check_compile: a_gpu_machine())
    monkeypatch.setattr(gc, "plan_checks",
                        lambda args, gpus: [fake("good", "pass"), fake("slow", "import time; time.sleep(60)")])
    assert gc.main(["--out-dir", str(tmp_path), "--budget-s", "6"]) == 3
    saved = json.loads((tmp_path / "gpu-report.json").read_text())
    assert saved["verdict"] == "incomplete" and [c["verdict"] for c in saved["checks"]] == ["pass", "incomplete"]


def test_the_out_dir_gets_the_report_and_one_log_bundle_within_a_slots_limits(tmp_path, monkeypatch):
    """Checks that leave a JPEG, a checkpoint and a 27 MB log each in their work dir: the out dir gets the
    report and the log bundle only (at most 8 files, 16 MiB each, 64 MiB in all: what a slot brings back), the
    logs' heads and tails kept; the scratch folder is removed; the default out dir is outside the checkout."""
    from tests.gpucheck.bundle import FILES, LOGS, bundle_problems

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # where the scratch folder goes, to watch it
    (tmp_path / "tmp").mkdir()
    code = ("import sys, pathlib; w = pathlib.Path(sys.argv[1]); (w / 'x.jpg').write_bytes(bytes(10)); "
            "(w / 'last.ckpt').write_bytes(bytes(2**20)); print('first line'); sys.stdout.write('line\\n' * 5_400_000)")
    checks = [runner.Check(name, "writes", [PY, "-c", code, "{work}"], timeout_s=120) for name in ("a", "b")]
    monkeypatch.setattr(gc, "inspect_machine", lambda check_compile: a_gpu_machine())
    monkeypatch.setattr(gc, "plan_checks", lambda args, gpus: checks)
    out = tmp_path / "out"
    assert gc.main(["--out-dir", str(out)]) == 0
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == sorted(FILES)
    assert bundle_problems(out) == []
    logs = (out / LOGS).read_text()
    assert logs.count("first line") == 2 and "===== b: pass" in logs and "bytes left out" in logs
    assert list((tmp_path / "tmp").iterdir()) == []  # scratch removed
    default = Path(gc._parser().parse_args([]).out_dir)
    assert default.is_absolute() and ROOT not in default.parents


INTERRUPTIBLE = textwrap.dedent("""
    import sys, time
    from tests.gpucheck import check as gc
    from tests.gpucheck import runner
    from tests.gpucheck.test_gpucheck import a_gpu_machine, family
    from pathlib import Path
    tmp, case = Path(sys.argv[1]), sys.argv[2]

    def slow_judge(rc, work, tail):
        (tmp / "judging").write_text("")  # the signal comes while gpu-check itself is busy, no check running
        time.sleep(120)
        return runner.verdict("pass")

    def slow_inspection(check_compile):
        (tmp / "inspecting").write_text("")  # nvidia-smi, or the C toolchain's probe, taking its time
        time.sleep(120)

    if case == "judge":
        check = runner.Check("judged", "a slow judge", [sys.executable, "-c", "pass"], 60, judge=slow_judge)
    else:
        check, pids = family(tmp, "hang", "sleep", timeout_s=300)
    gc.inspect_machine = slow_inspection if case == "inspect" else (lambda check_compile: a_gpu_machine())
    gc.plan_checks = lambda args, gpus: [check,
                                         runner.Check("after", "never started", [sys.executable, "-c", "pass"], 60)]
    raise SystemExit(gc.main(["--out-dir", str(tmp / "out")]))
""")


def stoppable(tmp_path: Path, case: str):
    script = tmp_path / "stopped.py"
    script.write_text(INTERRUPTIBLE)
    return start([script, tmp_path, case], port=False, quiet=None)


def stopped(tmp_path: Path, case: str, mark: str, what: str) -> dict[str, Any]:
    """Run the interruptible gpu-check ``case``, SIGTERM it once ``mark`` exists, and return its saved report
    after checking that it exited 3 (incomplete)."""
    proc = stoppable(tmp_path, case)
    proc.wait_until(lambda: (tmp_path / mark).exists(), timeout=120, what=what)
    proc.signal(signal.SIGTERM)
    done = proc.finish(timeout=120)
    assert done.returncode == 3, done.stderr[-2000:]
    return json.loads((tmp_path / "out" / "gpu-report.json").read_text())


def test_a_stopped_gpu_check_kills_the_running_tree_and_says_incomplete(tmp_path):
    """SIGTERM (the slot ending) while a check runs: its tree dies, the report says incomplete, exit 3."""
    saved = stopped(tmp_path, "hang", "hang.pids", "the check's children")
    assert saved["verdict"] == "incomplete" and [c["verdict"] for c in saved["checks"]] == ["incomplete"] * 2
    assert "stopped (SIGTERM)" in saved["checks"][0]["reason"]
    assert all_gone(pids_of(tmp_path / "hang.pids"))



def test_a_signal_while_gpu_check_itself_works_still_stops_it(tmp_path):
    """SIGTERM between checks (a judge reading results, the FLOP count): it must not be taken for that step's
    own error (a failed check, a missing MFU) and the run go on; it stops the run, incomplete."""
    saved = stopped(tmp_path, "judge", "judging", "the judge at work")
    assert [c["verdict"] for c in saved["checks"]] == ["incomplete"] * 2, saved["checks"]


def test_a_stop_while_the_machine_is_inspected_still_leaves_a_report(tmp_path):
    """Inspecting the machine (nvidia-smi, the C toolchain's probe) can take minutes: a SIGTERM then is a stop
    like any other, with a report that says incomplete, not a death that leaves none."""
    saved = stopped(tmp_path, "inspect", "inspecting", "the machine's inspection")
    assert saved["verdict"] == "incomplete" and saved["finished"] is True
    assert [(c["name"], c["verdict"]) for c in saved["checks"]] == [
        ("machine", "incomplete"), ("hang", "incomplete"), ("after", "incomplete")]
    assert "stopped (SIGTERM) while inspecting the machine" in saved["checks"][0]["reason"]
    assert (tmp_path / "out" / "gpu-report.md").read_text().startswith("# gpu-check: INCOMPLETE (exit 3)")


def test_a_killed_gpu_check_takes_the_running_tree_with_it(tmp_path):
    """SIGKILL to gpu-check (a slot's hard limit): no handler runs, yet the running check's tree, in a session
    of its own, must not go on using the GPU (and skew the figures of a rerun on the same machine)."""
    proc = stoppable(tmp_path, "hang")
    pids = proc.wait_until(lambda: (tmp_path / "hang.pids").exists() and pids_of(tmp_path / "hang.pids"),
                           timeout=120, what="the check's children")
    proc.signal(signal.SIGKILL)
    proc.finish(timeout=60)
    assert all_gone(pids, within_s=30), "the check outlived gpu-check"


def gpu_check(tmp_path: Path, env: dict[str, str]) -> tuple[int, dict, str]:
    """The real command, as on a machine: it inspects the machine itself."""
    done = run(["-m", "tests.gpucheck", "--out-dir", tmp_path / "out"], env=env, port=False, threads=None,
               quiet=None, timeout=300)
    return done.returncode, json.loads((tmp_path / "out" / "gpu-report.json").read_text()), done.stdout + done.stderr


def fake_nvidia_smi(folder: Path) -> Path:
    """A stand-in for the driver's tool showing one H200 (this machine has no NVIDIA driver)."""
    folder.mkdir(parents=True, exist_ok=True)
    tool = folder / "nvidia-smi"
    tool.write_text("#!/bin/sh\nif [ \"$1\" = \"\" ]; then echo '| NVIDIA-SMI 580.95.05  Driver Version: 580.95.05  "
                    "CUDA Version: 13.0 |'; else echo 'NVIDIA H200, 143771 MiB, 580.95.05'; fi\n")
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    return folder


# On a GPU machine the real device is seen: these two run where there is none (CI, a developer's machine).
no_real_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="a real GPU is visible here")


@no_real_gpu
def test_no_cuda_device_is_no_verdict_with_its_own_exit_code(tmp_path):
    path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep)
                           if not (Path(p) / "nvidia-smi").exists())
    code, saved, output = gpu_check(tmp_path, {"CUDA_VISIBLE_DEVICES": "", "PATH": path})
    assert code == 4 and saved["verdict"] == "no verdict" and saved["exit_code"] == 4, output[-2000:]
    assert saved["checks"][0]["name"] == "cuda" and saved["checks"][0]["reason"].startswith("no CUDA device")
    assert {c["verdict"] for c in saved["checks"]} == {"no verdict"} and saved["throughput"] == []
    names = [c["name"] for c in saved["checks"]]
    assert names[1:4] == ["sync-debug", "resnet50-pack", "resnet50-raw"]
    assert (tmp_path / "out" / "gpu-report.md").read_text().startswith("# gpu-check: NO VERDICT (exit 4)")
    assert "gpu-check: no verdict (exit 4)" in output and "pass" not in saved["meaning"]
    from tests.gpucheck.bundle import FILES, bundle_problems

    assert sorted(p.name for p in (tmp_path / "out").rglob("*")) == sorted(FILES)  # where told, nothing else
    assert bundle_problems(tmp_path / "out") == []


@no_real_gpu
def test_a_driver_that_shows_a_gpu_torch_does_not_see_is_a_failure(tmp_path):
    tools = fake_nvidia_smi(tmp_path / "bin")
    env = {"PATH": f"{tools}{os.pathsep}{os.environ.get('PATH', '')}"}
    code, saved, output = gpu_check(tmp_path, {**env, "CUDA_VISIBLE_DEVICES": "0"})
    assert code == 1 and saved["verdict"] == "fail", output[-2000:]
    problem = saved["machine_problem"]
    assert "NVIDIA H200" in problem and "driver 580.95.05" in problem and "driver CUDA 13.0" in problem
    assert f"torch {torch.__version__}" in problem and "sees none" in problem
    assert f"CUDA build {torch.version.cuda or 'none: CPU-only'}" in problem
    # Hidden on purpose: nothing to judge, not the machine's fault.
    code, saved, _ = gpu_check(tmp_path, {**env, "CUDA_VISIBLE_DEVICES": ""})
    assert code == 4 and "CUDA_VISIBLE_DEVICES='' hides the 1 GPU(s)" in saved["machine_problem"]


def test_the_gpu_tiers_compile_tests_skip_where_the_compiled_checks_have_no_verdict(tmp_path):
    """Without a C compiler or Python.h the compiled checks are 'no verdict'; the gpu tier's tests that
    torch.compile must then skip with that reason (``@pytest.mark.compiles``), not fail gpu-tests."""
    import importlib
    import inspect

    compiling = []
    for path in gc.GPU_TEST_FILES:
        module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
        for name, fn in vars(module).items():
            if name.startswith("test_") and re.search(r'"--compile"|torch\.compile\(', inspect.getsource(fn)):
                compiling.append(name)
                assert any(m.name == "compiles" for m in getattr(fn, "pytestmark", [])), f"{path}::{name}: no mark"
    assert len(compiling) >= 2, compiling  # the 1-GPU and the NCCL one at least: the scan found them
    # The mark through pytest itself, with no compiler on PATH: skipped, with compile_problem's own reason.
    (tmp_path / "test_probe.py").write_text("import pytest\n\n\n@pytest.mark.compiles\ndef test_probe():\n    pass\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers = compiles: torch.compiles\n")
    probe = ["-m", "pytest", "-p", "tests.marks", "-p", "no:cacheprovider", "-rs", "-c", tmp_path / "pytest.ini",
             tmp_path / "test_probe.py"]
    bare = run(probe, env={"PATH": str(tmp_path), "CC": ""}, port=False, quiet=None, timeout=300)
    assert bare.returncode == 0 and "1 skipped" in bare.stdout, bare.stdout[-2000:]
    assert "torch.compile cannot build code here: no C compiler" in bare.stdout, bare.stdout[-2000:]
    if compile_blocker() is None:  # where the toolchain is whole, the mark lets the test run
        whole = run(probe, port=False, quiet=None, timeout=300)
        assert whole.returncode == 0 and "1 passed" in whole.stdout, whole.stdout[-2000:]


def test_the_compiles_mark_and_the_compiled_checks_ask_one_probe(monkeypatch):
    """A machine where Triton cannot find libcuda.so.1 (or write its cache) has no verdict for the compiled
    checks: the gpu tier's compile tests must skip there for the same reason, not fail gpu-tests."""
    from tests import marks

    why = "Triton cannot find libcuda.so.1 (no ldconfig entry)"
    monkeypatch.setattr(machine_module, "compile_problem", lambda include_dir=None: None)
    monkeypatch.setattr(machine_module, "triton_runtime_problem", lambda: why)
    assert marks.compile_problem.__wrapped__() == why
    monkeypatch.setattr(machine_module, "compile_blocker", lambda: "the one probe")
    assert marks.compile_problem.__wrapped__() == "the one probe"


def test_compile_problem_names_a_missing_compiler_or_header(tmp_path, monkeypatch):
    """Triton builds a C helper on first use: without a compiler or Python.h the compiled checks cannot run,
    and say why (this machine has both; each is taken away in turn)."""
    import shutil

    if not (shutil.which("gcc") or shutil.which("clang")):
        pytest.skip("no C compiler on this machine to take away")
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    assert "is not there" in compile_problem()
    monkeypatch.delenv("CC")
    assert "no Python.h in" in compile_problem(include_dir=str(tmp_path))
    real = compile_problem()  # the real toolchain builds the probe; then only Triton may be missing
    assert real is None or real.startswith("Triton is not installed")
    monkeypatch.setenv("PATH", str(tmp_path))  # neither gcc nor clang
    assert compile_problem().startswith("no C compiler")


def test_the_slot_runs_nothing_twice_and_compiled_runs_are_short():
    """The budget (7 minutes on a cold H200) has no room for a test that repeats a dedicated check, and a
    compiled run's time is its compilation: its steady steps are fewer than the eager runs'."""
    args = gc._parser().parse_args(["--compile"])
    checks = {c.name: c for c in gc.plan_checks(args, 1)}
    tier = checks["gpu-tests"].cmd
    expression = tier[tier.index("-k") + 1]
    assert "not kill_and_resume" in expression and "not bench_raw_path_on_one_gpu" in expression
    assert tier[tier.index("-m", 2) + 1] == "gpu"  # --compile: the compiles tests too
    default_tier = next(c for c in gc.plan_checks(plan_args(), 1) if c.name == "gpu-tests").cmd
    assert default_tier[default_tier.index("-m", 2) + 1] == "gpu and not compiles"
    assert checks["cuda-kill-resume"].cmd[checks["cuda-kill-resume"].cmd.index("-k") + 1] == gc.RESUME_TEST
    from tests.gpu import test_gpu

    assert hasattr(test_gpu, "test_bench_raw_path_on_one_gpu")
    assert hasattr(test_gpu, "test_cuda_kill_and_resume_auto_is_bit_identical")

    def steps(name: str) -> tuple[int, int]:
        cmd = checks[name].cmd
        return int(cmd[cmd.index("--warmup-steps") + 1]), int(cmd[cmd.index("--steps") + 1])

    assert steps("resnet50-pack") == (args.warmup_steps, args.steps)
    assert steps("resnet50-pack-compiled") == steps("resnet50-raw-compiled") == (gc.COMPILED_WARMUP, gc.COMPILED_STEPS)
    assert sum(steps("resnet50-pack-compiled")) < sum(steps("resnet50-pack"))
    # No timed step is the first log step (batch LOG_EVERY_N_STEPS - 1: a new branch, maybe a recompile), even
    # with a shorter --warmup-steps.
    from ddp_recipes.bench.harness.components import LOG_EVERY_N_STEPS

    assert gc.COMPILED_WARMUP >= LOG_EVERY_N_STEPS
    short = {c.name: c for c in gc.plan_checks(plan_args("--warmup-steps", "3", "--compile"), 1)}
    for name in ("resnet50-pack", "resnet50-raw", "resnet50-pack-compiled"):
        cmd = short[name].cmd
        assert int(cmd[cmd.index("--warmup-steps") + 1]) >= LOG_EVERY_N_STEPS, name


# ---- sync-debug spans log steps (issue #39.4) -----------------------------------------------------------------

def test_sync_debug_passes_the_loggers_reads_at_log_steps_and_fails_any_other(tmp_path):
    """A step that does not log may make no host sync; a log step may read the values the logger wrote, one
    each, no more; a window with no log step cannot pass."""
    from tests.gpucheck.worker import sync_report

    def judged(sites, logged):
        (tmp_path / "sync.json").write_text(json.dumps(sync_report(sites, logged, 3, 14)))
        return gc.sync_judge(0, tmp_path, "")

    loss_read = "logger_connector.py:120 metrics_to_scalars"
    ok = judged([(4, loss_read), (9, loss_read), (9, loss_read)], {4: 2, 9: 2})
    assert ok["verdict"] == "pass" and "2 log steps read 3 value(s)" in ok["reason"], ok["reason"]
    plain = judged([(4, loss_read), (6, "step.py:10 item")], {4: 2, 9: 2})
    assert plain["verdict"] == "fail" and "do not log" in plain["reason"] and "step.py:10" in plain["reason"]
    greedy = judged([(4, loss_read)] * 3, {4: 2, 9: 2})
    assert greedy["verdict"] == "fail" and "log step 4 made 3 host sync(s) for the 2 value(s)" in greedy["reason"]
    assert judged([], {})["verdict"] == "fail"  # the window missed every log step


def test_an_out_dir_that_cannot_hold_the_report_is_refused_before_anything_runs(tmp_path, monkeypatch, capsys):
    """A file as --out-dir, or a folder under a file: one line naming the flag, exit 2, before the machine is
    inspected (it used to end in a traceback when the first report was written, after the first check)."""
    def inspect(check_compile):
        raise AssertionError("the machine was inspected before --out-dir was checked")

    monkeypatch.setattr(gc, "inspect_machine", inspect)
    a_file = tmp_path / "report.txt"
    a_file.write_text("kept")
    for bad in (a_file, a_file / "sub"):
        with pytest.raises(SystemExit) as info:
            gc.main(["--out-dir", str(bad)])
        err = capsys.readouterr().err
        assert info.value.code == 2 and err.count("\n") == 1 and f"--out-dir {bad}" in err, err
    assert a_file.read_text() == "kept"
