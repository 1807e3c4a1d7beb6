"""gpu-check's logic on CPU: budgets and timeouts, verdicts, the report files and the exit code.

The GPU checks themselves run only on a GPU (``make gpu-check``); here fake checks stand in for them.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from ddp_recipes.bench import gpucheck as gc
from tests.launch import run

PY = sys.executable


def fake(name: str, code: str, timeout_s: float = 30, **kw) -> gc.Check:
    return gc.Check(name, f"fake {name}", [PY, "-c", code], timeout_s=timeout_s, **kw)


def test_a_check_past_its_timeout_fails_and_its_process_group_is_killed(tmp_path):
    pid_file = tmp_path / "child.pid"
    # The check starts a grandchild (as Lightning starts ranks) and both sleep far past the timeout.
    code = (f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    started = time.monotonic()
    [result] = gc.run_checks([fake("sleepy", code, timeout_s=2)], gpus=1, out_dir=tmp_path, progress=lambda _: None)
    assert time.monotonic() - started < 30
    assert result["verdict"] == "fail" and "timed out after 2 s" in result["reason"]
    child = int(pid_file.read_text())
    assert not alive(child), "the check's grandchild outlived its timeout"


def alive(pid: int) -> bool:
    """Running, not a zombie waiting for a reaper (an orphan's reaper may be slow, or absent in a container)."""
    time.sleep(0.3)
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_the_total_budget_cuts_a_timeout_then_skips_what_is_left(tmp_path, monkeypatch):
    monkeypatch.setattr(gc, "MIN_START_S", 0.5)
    lines: list[str] = []
    checks = [fake("long", "import time; time.sleep(60)", timeout_s=100), fake("next", "pass")]
    first, second = gc.run_checks(checks, gpus=1, out_dir=tmp_path, budget_s=2.0, progress=lines.append)
    assert first["verdict"] == "fail" and "timed out after 2 s" in first["reason"]  # 2 s budget, not 100 s
    assert second["verdict"] == "skipped" and "total budget of 2 s spent" in second["reason"]
    assert any(line.startswith("[gpu-check 1/2] long:") for line in lines)  # progress lines


def test_gpu_counts_skip_with_the_reason(tmp_path):
    checks = [fake("one", "pass"), fake("two", "pass", min_gpus=2)]
    none = gc.run_checks(checks, gpus=0, out_dir=tmp_path, progress=lambda _: None)
    assert [(r["verdict"], r["reason"]) for r in none] == [("skipped", "no CUDA device")] * 2
    one = gc.run_checks(checks, gpus=1, out_dir=tmp_path, progress=lambda _: None)
    assert [r["verdict"] for r in one] == ["pass", "skipped"] and one[1]["reason"] == "needs 2+ GPUs (1 visible)"


def test_exit_code_and_a_judge_that_cannot_read_its_output(tmp_path):
    bad = fake("bad", "import sys; print('boom'); sys.exit(3)")
    unreadable = fake("unreadable", "pass", judge=gc.throughput_judge)  # writes no run.json
    r_bad, r_unreadable = gc.run_checks([bad, unreadable], gpus=1, out_dir=tmp_path, progress=lambda _: None)
    assert r_bad["verdict"] == "fail" and r_bad["reason"].startswith("exit 3") and "boom" in r_bad["reason"]
    assert r_unreadable["verdict"] == "fail" and "could not read its result" in r_unreadable["reason"]


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="{n}" failures="{f}"
errors="0" skipped="{s}">{cases}</testsuite></testsuites>"""


def junit(work: Path, passed: int, failed: int, skipped: int) -> None:
    cases = "<testcase name='ok'/>" * passed
    cases += "<testcase name='test_bad'><failure message='AssertionError: 1 != 2'/></testcase>" * failed
    cases += "<testcase name='nccl'><skipped message='needs 2+ CUDA GPUs'/></testcase>" * skipped
    work.mkdir(parents=True, exist_ok=True)
    (work / "junit.xml").write_text(JUNIT.format(n=passed + failed + skipped, f=failed, s=skipped, cases=cases))


def test_pytest_verdicts(tmp_path):
    junit(tmp_path / "a", 3, 0, 2)
    ok = gc.pytest_judge(0, tmp_path / "a", "")
    assert ok["verdict"] == "pass" and ok["reason"] == "3 passed, 2 skipped, 0 failed"
    assert ok["data"]["skipped_reasons"] == ["needs 2+ CUDA GPUs"]
    junit(tmp_path / "b", 3, 1, 0)
    bad = gc.pytest_judge(1, tmp_path / "b", "")
    assert bad["verdict"] == "fail" and "test_bad: AssertionError: 1 != 2" in bad["reason"]
    junit(tmp_path / "c", 0, 0, 4)
    assert gc.pytest_judge(0, tmp_path / "c", "")["verdict"] == "skipped"
    junit(tmp_path / "d", 2, 0, 0)
    assert gc.pytest_judge(2, tmp_path / "d", "interrupted")["verdict"] == "fail"  # a non-zero exit fails


def run_row(name: str, rate: float) -> dict:
    return {"name": f"resnet50-{name}", "verdict": "pass", "reason": "", "seconds": 1.0,
            "data": {"images_per_s": rate, "step_ms_median": 1.0, "first_step_s": 1.0}}


def test_pack_vs_raw_mfu_and_the_reference_rows():
    results = [run_row("pack", 950.0), run_row("raw", 1000.0), run_row("pack-compiled", 800.0),
               run_row("raw-compiled", 1000.0)]
    eager, compiled = gc.pack_vs_raw(results)
    assert (eager["verdict"], compiled["verdict"]) == ("pass", "fail") and compiled["data"]["ratio"] == 0.8
    results[1]["verdict"] = "fail"
    assert gc.pack_vs_raw(results)[0]["verdict"] == "skipped"
    rows = gc.throughput_rows([run_row("pack", 1000.0)], flops_per_sample=int(12e9), peak=1e15)
    assert rows[0]["achieved_tflops"] == 12.0 and rows[0]["mfu"] == 0.012
    assert gc.throughput_rows([run_row("pack", 1000.0)], None, 1e15)[0]["mfu"] is None
    [bf16] = gc.reference_rows("bf16-mixed", 989e12, "NVIDIA H100 80GB HBM3")
    assert bf16["images_per_s"] is None and bf16["label"].startswith("unavailable")  # never a made-up figure
    fp16 = gc.reference_rows("16-mixed", 989e12, "NVIDIA H100 80GB HBM3")
    a100 = next(r for r in fp16 if r["gpu"].startswith("A100"))
    assert a100["images_per_s"] == 2470.0 and a100["scaled_images_per_s"] == round(2470 * 989 / 312, 1)
    assert "scaled" in a100["label"] and "estimate" in a100["label"]


def test_report_files_verdict_and_main_exit_code(tmp_path, monkeypatch):
    monkeypatch.setattr(gc, "device_facts", lambda: {"gpus": 1, "torch": "x", "gpu": "Fake GPU",
                                                     "peak_flops_per_sec": None})
    monkeypatch.setattr(gc, "plan_checks", lambda args, gpus: [fake("good", "pass"), fake("broken", "raise SystemExit(1)"),
                                                                fake("multi", "pass", min_gpus=2)])
    monkeypatch.setattr(gc, "resnet50_flops", lambda batch: None)
    assert gc.main(["--out-dir", str(tmp_path)]) == 1
    report = json.loads((tmp_path / "gpu-report.json").read_text())
    assert report["verdict"] == "fail" and report["counts"] == {"pass": 1, "fail": 1, "skipped": 1}
    assert [c["verdict"] for c in report["checks"]] == ["pass", "fail", "skipped"]
    md = (tmp_path / "gpu-report.md").read_text()
    assert md.startswith("# gpu-check: FAIL (1 pass, 1 fail, 1 skipped)") and "| broken | fail |" in md
    monkeypatch.setattr(gc, "plan_checks", lambda args, gpus: [fake("good", "pass"), fake("multi", "pass", min_gpus=2)])
    assert gc.main(["--out-dir", str(tmp_path)]) == 0  # skipped checks do not fail the run


def test_unknown_only_name_is_refused(capsys):
    with pytest.raises(SystemExit) as info:
        gc.main(["--only", "resnet50-pack,nope", "--out-dir", "unused"])
    assert info.value.code == 2 and "--only: no check named nope" in capsys.readouterr().err


def test_gpu_check_without_cuda_skips_every_check_and_exits_0(tmp_path):
    """The real command with no visible GPU, as on a CPU machine: a report, every check skipped, exit 0."""
    proc = run(["-m", "ddp_recipes.bench.gpucheck", "--out-dir", tmp_path], env={"CUDA_VISIBLE_DEVICES": ""},
               port=False, threads=None, quiet=None, check=True)
    report = json.loads((tmp_path / "gpu-report.json").read_text())
    names = [c["name"] for c in report["checks"]]
    assert {"gpu-tests", "cuda-kill-resume", "sync-debug", "resnet50-pack", "resnet50-raw-compiled",
            "bench-multi-gpu"} <= set(names)
    assert all((c["verdict"], c["reason"]) == ("skipped", "no CUDA device") for c in report["checks"])
    assert report["verdict"] == "pass" and report["gpu"] is None and report["throughput"] == []
    assert report["reference"][0]["label"].startswith("unavailable")
    assert "skipped: no CUDA device" in proc.stderr and (tmp_path / "gpu-report.md").exists()
