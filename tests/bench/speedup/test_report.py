"""The report (from a synthetic results dict) and the host probes; no timing is asserted."""

from __future__ import annotations

import json

import pytest

from ddp_recipes.bench.commodel import predict_table, validate_against_pytorch_benchmark
from ddp_recipes.bench.hostinfo import host_facts, parallel_ceiling, parallel_warning
from ddp_recipes.bench.speedup.report import (
    compute_speedups,
    markdown_report,
    overhead_ratios,
    summary_line,
    write_report,
)


def _run(impl: str, devices: int, rate: float, step_ms: float) -> dict:
    return {"impl": impl, "devices": devices, "global_samples_per_s": rate,
            "per_device_samples_per_s": rate / devices, "step_ms_median": step_ms,
            "step_ms_p10": step_ms * 0.9, "step_ms_p90": step_ms * 1.2,
            "peak_mem_mb_per_rank": [100.0 + i for i in range(devices)]}


def _results() -> dict:
    return {
        "host": {"cpu_count": 2, "usable_cpus": 2, "torch": "2.x", "lightning": "2.6", "cuda_devices": []},
        "config": {"model": "mnist-mlp", "batch_size": 64, "steps": 20},
        "ceiling": {"workers": 2, "ceiling": 0.9, "relative": [0.45, 0.45], "relative_mean": 0.45,
                    "usable_cpus": 2},
        "runs": [_run("pack", 1, 100.0, 640.0), _run("pack", 2, 180.0, 711.0),
                 _run("raw", 1, 110.0, 582.0), _run("raw", 2, 187.0, 684.0)],
        "allreduce": [{"devices": 2, "nbytes": 4_000_000, "fp32_ms": 3.0, "bf16_ms": 1.6, "exposed_ms": 1.1}],
        "prediction": {"step_ms": 640.0, "params": 1e6, "bytes_per_param": 4,
                       "rows": predict_table(640.0, 1e6, ["nvlink2", "eth10"]),
                       "validation": validate_against_pytorch_benchmark()},
        "warnings": ["2 workers get 0.90 of a core each"],
    }


def test_speedups_are_relative_to_the_same_impl():
    runs = {(r["impl"], r["devices"]): r for r in compute_speedups(_results()["runs"])}
    assert runs["pack", 1]["speedup"] == pytest.approx(1.0)
    assert runs["pack", 2]["speedup"] == pytest.approx(1.8) and runs["pack", 2]["efficiency"] == pytest.approx(0.9)
    assert runs["raw", 2]["speedup"] == pytest.approx(1.7)
    lonely = compute_speedups([_run("dp", 2, 50.0, 10.0)])
    assert lonely[0]["speedup"] is None  # no 1-device run to compare with


def test_overhead_ratio_is_pack_over_raw_throughput():
    ratios = overhead_ratios(_results()["runs"])
    assert ratios == {1: pytest.approx(100 / 110), 2: pytest.approx(180 / 187)}
    assert overhead_ratios([_run("pack", 2, 50.0, 1.0)]) == {}  # no raw run to compare with


def test_write_report_files_and_contents(tmp_path):
    paths = write_report(_results(), tmp_path / "out")
    assert {p.name for p in paths.values()} == {"results.json", "report.md", "speedup.png"}
    data = json.loads(paths["json"].read_text())
    speedups = {(r["impl"], r["devices"]): r["speedup"] for r in data["runs"]}
    assert speedups["pack", 2] == pytest.approx(1.8)
    assert data["overhead_ratio"]["2"] == pytest.approx(180 / 187)  # JSON keys are strings
    md = paths["markdown"].read_text()
    assert "| pack | 2 | 180.0 | 90.0 |" in md and "| raw | 1 | 110.0 |" in md
    assert "| nvlink2 |" in md and "| eth10 |" in md and "2 workers get" in md
    png = paths["plot"].read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 5000


def test_report_tolerates_a_minimal_results_dict(tmp_path):
    paths = write_report({"runs": [_run("pack", 1, 10.0, 5.0)]}, tmp_path)
    assert "| pack | 1 |" in paths["markdown"].read_text()
    assert paths["plot"].stat().st_size > 0


def test_without_matplotlib_the_report_is_written_and_the_bench_names_the_extra(tmp_path, monkeypatch, capsys):
    """matplotlib is the ``plot`` extra: without it the report and the JSON are written, the plot is not, and
    the bench says in one line what to install."""
    import argparse
    import dataclasses
    import sys

    from ddp_recipes.bench.speedup import run as speedup
    from ddp_recipes.bench.speedup.report import PLOT_NEEDS

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    paths = write_report(_results(), tmp_path / "out")
    assert set(paths) == {"json", "markdown"} and not (tmp_path / "out" / "speedup.png").exists()
    assert "| pack | 2 | 180.0 | 90.0 |" in paths["markdown"].read_text()
    monkeypatch.setattr(speedup, "run_bench", lambda cfg: _results())
    cfg = speedup.BenchConfig(recipe="mnist", accelerator="cpu", out=str(tmp_path / "bench"))
    assert speedup.run_command(argparse.Namespace(**dataclasses.asdict(cfg))) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert PLOT_NEEDS in lines and "pip install 'matplotlib>=3.8.4' (the pack's plot extra)" in PLOT_NEEDS
    assert lines[-1].startswith("bench: ")


def test_markdown_and_summary_line():
    results = _results()
    md = markdown_report(results)
    assert "0.90x one alone" in md and "| 2 | 4.0 | 3.00 | 1.60 | 1.10 |" in md
    line = summary_line(results)
    assert "\n" not in line and line.startswith("bench: ")
    fields = dict(f.split("=") for f in line.split()[1:])
    assert fields["pack_speedup@2"] == "1.80" and fields["raw_speedup@2"] == "1.70"
    assert fields["ceiling@2"] == "0.90" and fields["warnings"] == "1"


def test_parallel_ceiling_reports_sane_keys():
    c = parallel_ceiling(2, seconds=0.1)
    assert c["workers"] == 2 and len(c["relative"]) == 2 and c["alone_rate"] > 0
    assert all(r > 0 for r in c["relative"]) and c["ceiling"] == pytest.approx(sum(c["relative"]))


def test_parallel_warning_thresholds():
    assert parallel_warning(2, {"workers": 2, "ceiling": 1.95, "relative_mean": 0.97, "usable_cpus": 2}) is None
    warn = parallel_warning(2, {"workers": 2, "ceiling": 0.9, "relative_mean": 0.45, "usable_cpus": 2})
    assert warn and "0.90" in warn
    assert parallel_warning(1, None) is None
    assert "usable CPUs" in parallel_warning(10_000, None)


def test_a_probe_below_a_measured_speedup_is_called_disturbed_never_an_impossibility():
    # make bench once said "a CPU speedup above ~1.54x is impossible here" beside a measured 1.80-1.86x: the probe
    # had run while other work shared the host.
    results = _results()  # probe 0.90x, pack measured 1.80x at 2
    md = markdown_report(results)
    low = {"workers": 2, "ceiling": 0.9, "relative_mean": 0.45, "usable_cpus": 2}
    warned = parallel_warning(2, low, measured=1.8)
    for text in (md, warned):
        assert "disturbed" in text and "1.80x" in text
    reprobed = {**low, "probes": [0.9, 1.2]}
    assert "0.90x-1.20x" in parallel_warning(2, reprobed, measured=1.8)
    assert parallel_warning(2, {**low, "probes": [0.9, 1.85]}, measured=1.8) is None  # the re-probe found the cores
    assert "disturbed" not in parallel_warning(2, low, measured=0.85)  # a speedup at or below it: the host's limit
    for text in (md, warned, parallel_warning(2, low), parallel_warning(10_000, None)):
        assert not any(word in text for word in ("impossible", "cannot exceed")), text


def test_the_ceiling_words_never_contradict_their_own_figures():
    # Compared at the precision they are printed with: 1.5449 measured beside a 1.5401 probe printed "reach 1.54x
    # one alone's rate, below the measured 1.54x", and two probes 0.003 apart a range "1.54x-1.54x".
    from ddp_recipes.bench.hostinfo import ceiling_words

    probe = {"workers": 2, "ceiling": 1.5401, "relative_mean": 0.77, "usable_cpus": 2}
    assert "disturbed" not in ceiling_words(probe, 1.5449) and "below" not in ceiling_words(probe, 1.5449)
    assert "below the measured 1.55x" in ceiling_words(probe, 1.5462)
    assert "1.54x-1.54x" not in ceiling_words({**probe, "probes": [1.5401, 1.5432]})


def test_host_facts_keys():
    facts = host_facts()
    assert {"cpu_count", "usable_cpus", "torch", "lightning", "cuda_devices", "torch_threads"} <= set(facts)
    assert facts["usable_cpus"] >= 1


def _full_results() -> dict:
    from ddp_recipes.bench.commodel import LINKS

    results = _results()
    results["prediction"]["rows"] = predict_table(97.0, 25.6e6, list(LINKS))  # ResNet-50-sized, all 11 links
    return results


def test_prediction_groups_merge_links_that_predict_the_same_curve():
    from ddp_recipes.bench.commodel import LINKS
    from ddp_recipes.bench.speedup.report import prediction_groups

    rows = _full_results()["prediction"]["rows"]
    groups = prediction_groups(rows)
    assert sorted(link for g in groups for link in g["links"]) == sorted(LINKS)  # every link, once
    assert 1 < len(groups) < len(LINKS)
    nvlinks = next(g for g in groups if "nvlink4" in g["links"])
    assert {"nvlink3", "nvlink2"} <= set(nvlinks["links"])  # ~97% at every N: one line
    eth10 = next(g for g in groups if "eth10" in g["links"])
    assert eth10["links"] == ["eth10"]  # 42% at N=16: a curve of its own
    for g in groups:  # members really are within the tolerance of the drawn curve
        for link in g["links"]:
            own = {r["devices"]: r["efficiency"] for r in rows if r["link"] == link}
            assert all(abs(own[n] - e) <= 0.005 for n, e in g["points"] if n > 1)
    assert prediction_groups(rows, tolerance=0.0) and len(prediction_groups(rows, tolerance=0.0)) == len(LINKS)


def test_plot_draws_efficiency_with_one_line_per_distinct_prediction(tmp_path):
    import matplotlib.pyplot as plt

    from ddp_recipes.bench.speedup.report import plot_speedup, prediction_groups, speedup_figure

    results = _full_results()
    fig = speedup_figure(results)
    try:
        ax = fig.axes[0]
        labels = [line.get_label() for line in ax.get_lines()]
        predicted = [lb for lb in labels if lb.startswith("predicted")]
        assert "efficiency" in ax.get_ylabel()
        assert len(predicted) == len(set(predicted)) < 11  # one line per distinct curve, not per link
        curves = [tuple(line.get_ydata()) for line in ax.get_lines() if line.get_label().startswith("predicted")]
        assert len(set(curves)) == len(curves)
        assert {"measured pack", "measured raw", "ideal (100%)"} <= set(labels)
        ceiling = [lb for lb in labels if lb.startswith("host parallel ceiling")]
        assert len(ceiling) == 1 and "reach 0.90x" in ceiling[0] and "disturbed" in ceiling[0]  # 1.8x measured
        pack = next(line for line in ax.get_lines() if line.get_label() == "measured pack")
        assert list(pack.get_ydata()) == pytest.approx([100.0, 90.0])  # 180/100 = 1.8x on 2 = 90%
        assert any(t.get_text() == "1.80x" for t in ax.texts)  # the speedup beside its point
        axis_tol = max(0.005, 0.015 * (1.02 - ax.get_ylim()[0] / 100))
        assert len(predicted) == len(prediction_groups(results["prediction"]["rows"], tolerance=axis_tol))
        fig.canvas.draw()  # readable whole: the legend below the data, the title inside the figure
        renderer = fig.canvas.get_renderer()
        assert fig.legends[0].get_window_extent(renderer).y1 <= ax.get_window_extent(renderer).y0
        title = ax.title.get_window_extent(renderer)
        assert 0 <= title.x0 and title.x1 <= fig.bbox.width
    finally:
        plt.close(fig)
    png = plot_speedup(results, tmp_path / "speedup.png").read_bytes()
    assert png.startswith(b"\x89PNG")
