"""`python -m benchmarks.memory` end to end at toy size (no memory or timing value is asserted), and
its bad input."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks.memory.run import main

TOY = ["--arch", "resnet18", "--batch-size", "2", "--image-size", "32", "--steps", "1", "--threads", "1",
       "--accelerator", "cpu"]


@pytest.mark.slow  # two measured runs of the memory bench
def test_toy_run_of_two_variants_writes_json_table_and_summary(tmp_path, capsys):
    out = tmp_path / "bench"
    code = main([*TOY, "--variants", "baseline,grad-checkpointing", "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err[-3000:]
    results = json.loads((out / "memory.json").read_text())
    assert results["config"]["arch"] == "resnet18" and results["config"]["num_classes"] == 1000
    assert results["errors"] == [] and results["method"]
    runs = {r["variant"]: r for r in results["runs"]}
    assert set(runs) == {"baseline", "grad-checkpointing"}
    assert runs["grad-checkpointing"]["grad_checkpointing"] and not runs["baseline"]["grad_checkpointing"]
    for r in runs.values():
        for key in ("step_peak_mb", "tensor_peak_mb", "process_peak_mb", "state_mb", "step_ms_median",
                    "first_step_ms"):
            assert r[key] > 0, (r["variant"], key, r[key])
        assert len(r["step_ms"]) == 1 and math.isfinite(r["first_loss"])
        assert r["precision"] == "32-true" and r["torch_threads"] == 1
        assert r["reduction_pct"] is not None and r["slowdown"] > 0
        if r["method"] == "rss-hwm-reset":  # Linux: the workers ran with the pinned mmap threshold
            assert r["malloc_mmap_threshold"] == str(64 * 1024)
    summary = results["summary"]
    assert summary["baseline_mb"] > 0 and summary["checkpointing_mb"] > 0 and summary["step_cost"] > 0
    assert isinstance(summary["target_met"], bool)
    assert (out / "memory-runs" / "grad-checkpointing.json").exists()  # one fresh process per variant
    assert "| grad-checkpointing |" in captured.out  # the markdown table is printed
    last = captured.out.strip().splitlines()[-1]
    fields = dict(part.split("=") for part in last.removeprefix("memory: ").split())
    assert last.startswith("memory: ") and set(fields) == {"baseline_mb", "checkpointing_mb", "reduction", "step_cost"}
    assert float(fields["baseline_mb"]) > 0 and fields["reduction"].endswith("%") and fields["step_cost"].endswith("x")


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--arch", "resnet101"], "--arch"),
        (["--batch-size", "0"], "--batch-size"),
        (["--image-size", "16"], "--image-size"),
        (["--steps", "0"], "--steps"),
        (["--variants", "baseline,fp8"], "--variants"),
        (["--variant", "baseline"], "--json"),  # worker mode needs its output file
        (["--mmap-threshold-kb", "-1"], "--mmap-threshold-kb"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(tmp_path, capsys, args, flag):
    with pytest.raises(SystemExit) as exc:
        main([*args, "--out", str(tmp_path / "b")])
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err

