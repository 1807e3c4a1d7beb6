"""The communication model: ring / central arithmetic, predictions, the PyTorch-benchmark check, the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ddp_recipes.bench.__main__ import main as bench_main
from ddp_recipes.bench.commodel import (
    LINKS,
    LinkPreset,
    bucket_sizes,
    central_allreduce_seconds,
    exposed_ms,
    predict,
    predict_table,
    ring_allreduce_seconds,
    validate_against_pytorch_benchmark,
)

RESNET50 = 25_557_032
STEP_MS = 32 / 329 * 1e3
NO_LATENCY = LinkPreset("test", bandwidth_GBps=10.0, latency_us=0.0, source="test")


def predict_main(argv: list[str]) -> int:
    """``python -m ddp_recipes.bench predict ...``."""
    return bench_main(["predict", *argv])


def test_presets_are_complete_and_effective_below_line_rate():
    assert set(LINKS) == {"nvlink2", "nvlink3", "nvlink4", "pcie3", "pcie4", "pcie5",
                          "ib100", "ib200", "ib400", "eth10", "eth25"}
    for p in LINKS.values():
        assert p.source and p.bandwidth_GBps > 0 and p.latency_us > 0
        assert p.bandwidth_GBps < p.line_rate_GBps


def test_ring_is_free_on_one_device_and_s_over_b_on_two():
    assert ring_allreduce_seconds(1e9, 1, "nvlink2") == 0.0
    assert central_allreduce_seconds(1e9, 1, "nvlink2") == 0.0
    assert ring_allreduce_seconds(1e9, 2, NO_LATENCY) == pytest.approx(1e9 / 10e9)
    link = LINKS["ib100"]
    latency = 2 * link.latency_us * 1e-6
    assert ring_allreduce_seconds(1e8, 2, link) - latency == pytest.approx(1e8 / (link.bandwidth_GBps * 1e9))


def test_ring_bandwidth_term_tends_to_2s_over_b_and_central_grows_with_n():
    s = 1e9
    assert ring_allreduce_seconds(s, 1000, NO_LATENCY) == pytest.approx(2 * s / 10e9, rel=1e-2)
    for n in (4, 8, 16, 64):
        assert central_allreduce_seconds(s, n, "ib100") > ring_allreduce_seconds(s, n, "ib100")
    assert central_allreduce_seconds(s, 16, NO_LATENCY) == pytest.approx(2 * 15 * s / 10e9)


def test_buckets_put_the_partial_one_last():
    mib = 1024 * 1024
    assert bucket_sizes(60 * mib, 25 * mib) == [25 * mib, 25 * mib, 10 * mib]
    assert bucket_sizes(25 * mib, 25 * mib) == [25 * mib]
    assert bucket_sizes(3 * mib, 25 * mib) == [3 * mib]


def test_exposed_time_limits():
    # Fast comm: only the last bucket (ready when backward ends) is exposed.
    assert exposed_ms([1.0, 1.0, 0.5], [2, 2, 1], backward_ms=100.0) == pytest.approx(0.5)
    # One bucket: all of it is exposed.
    assert exposed_ms([7.0], [1], backward_ms=100.0) == pytest.approx(7.0)
    # Comm longer than backward: at least comm - backward is exposed.
    assert exposed_ms([60.0, 60.0], [1, 1], backward_ms=50.0) >= 120.0 - 50.0


def test_prediction_is_weak_scaling_and_bounded():
    one = predict(STEP_MS, RESNET50, 1, "eth10")
    assert one["speedup"] == pytest.approx(1.0) and one["exposed_comm_ms"] == 0.0
    for name in LINKS:
        effs = []
        for n in (2, 4, 8, 16):
            p = predict(STEP_MS, RESNET50, n, name)
            assert 0 < p["speedup"] <= n and 0 < p["central_speedup"] <= n
            assert p["step_ms_n"] >= p["step_ms_1"] * (1 + p["ddp_overhead"]) - 1e-9
            effs.append(p["efficiency"])
        assert all(a >= b - 1e-12 for a, b in zip(effs, effs[1:], strict=False)), (name, effs)


def test_faster_link_and_smaller_gradients_give_higher_speedup():
    big = 300e6  # parameters: comm-bound on slow links
    slow = [predict(STEP_MS, big, 8, name)["speedup"] for name in ("eth10", "eth25", "ib100", "ib200", "ib400")]
    assert slow == sorted(slow) and slow[0] < slow[-1]
    assert predict(STEP_MS, big, 8, "nvlink4")["speedup"] > predict(STEP_MS, big, 8, "pcie3")["speedup"]
    fp32 = predict(STEP_MS, big, 8, "eth25", bytes_per_param=4)
    bf16 = predict(STEP_MS, big, 8, "eth25", bytes_per_param=2)
    assert bf16["speedup"] > fp32["speedup"] and bf16["comm_ms"] == pytest.approx(fp32["comm_ms"] / 2, rel=0.05)


def test_ring_beats_central_at_scale():
    p = predict(STEP_MS, RESNET50, 16, "ib100")
    assert p["central_speedup"] < p["speedup"]


def test_predict_table_covers_links_and_devices():
    rows = predict_table(STEP_MS, RESNET50, ["nvlink2", "eth10"], devices=(2, 4))
    assert [(r["link"], r["devices"]) for r in rows] == [("nvlink2", 2), ("nvlink2", 4), ("eth10", 2), ("eth10", 4)]
    assert len(predict_table(STEP_MS, RESNET50)) == len(LINKS) * 4


def test_matches_pytorch_ddp_benchmark_within_5_points():
    v = validate_against_pytorch_benchmark()
    assert v["published_efficiency"] == pytest.approx(307 / 329)
    assert abs(v["error_points"]) <= 5.0 and v["ok"]
    assert abs(v["predicted_efficiency"] - 0.93) <= 0.05


@pytest.mark.parametrize("bad", [["--step-ms", "0"], ["--step-ms", "-5"], ["--params", "0"],
                                 ["--devices", "0"], ["--bytes-per-param", "-1"], ["--ddp-overhead", "-0.1"]])
def test_predict_main_rejects_bad_numbers_naming_the_flag(bad, capsys):
    args = {"--step-ms": "100", "--params": "1e6", "--devices": "4", "--link": "ib100"}
    args[bad[0]] = bad[1]
    with pytest.raises(SystemExit) as exc:
        predict_main([x for kv in args.items() for x in kv])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert bad[0] in err and "\n" not in err


def test_predict_main_unknown_link_lists_choices(capsys):
    with pytest.raises(SystemExit) as exc:
        predict_main(["--step-ms", "100", "--params", "1e6", "--devices", "4", "--link", "carrier-pigeon"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "--link" in err and "nvlink2" in err and "eth25" in err and "\n" not in err


def test_predict_main_missing_and_malformed_flags_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        predict_main(["--step-ms", "100"])
    assert exc.value.code == 2 and "--params" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        predict_main(["--step-ms", "fast", "--params", "1", "--devices", "2", "--link", "ib100"])
    assert exc.value.code == 2 and "--step-ms" in capsys.readouterr().err


def test_predict_main_prints_json(capsys):
    assert predict_main(["--step-ms", f"{STEP_MS}", "--params", str(RESNET50), "--devices", "8",
                         "--link", "nvlink2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["devices"] == 8 and out["link"] == "nvlink2"
    assert 0 < out["efficiency"] <= 1 and out["speedup"] == pytest.approx(8 * out["efficiency"])
    assert out["link_preset"]["source"]


def test_predict_main_lists_links(capsys):
    assert predict_main(["--list-links"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in LINKS)


def test_published_scaling_table_is_pinned():
    """Every published point docs/benchmark.md cites beside the model (its "The scaling model" section shows
    this table)."""
    from ddp_recipes.bench.commodel import published_scaling_table

    rows = published_scaling_table()
    pinned = {  # (precision, GPUs): (published %, model %)
        ("fp32", 2): (94.2, 96.9), ("fp32", 4): (94.2, 96.8), ("fp32", 8): (93.3, 96.7), ("fp32", 16): (93.0, 90.0),
        ("TF32", 8): (96.6, 97.0), ("AMP", 8): (84.1, 96.9),
    }
    got = {(r["precision"], r["devices"]): (round(100 * r["published_efficiency"], 1),
                                           round(100 * r["predicted_efficiency"], 1)) for r in rows}
    assert got == pinned
    # The faster the step, the more the model misses: AMP's gap is many times the whole all-reduce.
    amp = next(r for r in rows if r["precision"] == "AMP")
    assert amp["gap_ms"] > 10 * amp["comm_ms"]
    page = (Path(__file__).resolve().parents[2] / "docs" / "benchmark.md").read_text()
    assert format_scaling_table(rows) in page, \
        "docs/benchmark.md's scaling table is stale: paste format_scaling_table()"


def format_scaling_table(rows: list[dict]) -> str:
    """:func:`published_scaling_table` as docs/benchmark.md's markdown table."""
    lines = ["| published point | GPUs | link | 1-GPU step ms | published | model | model - published | "
             "all-reduce ms | step gap ms |", "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        name = "PyTorch DDP benchmark" if r["source"].startswith("pytorch") else "NVIDIA DeepLearningExamples"
        lines.append(f"| {name}, ResNet-50 {r['precision']}, {r['gpu']} | {r['devices']} | {r['link']} | "
                     f"{r['step_ms_1']:.1f} | {100 * r['published_efficiency']:.1f}% | "
                     f"{100 * r['predicted_efficiency']:.1f}% | {r['error_points']:+.1f} pp | {r['comm_ms']:.1f} | "
                     f"{r['gap_ms']:.1f} |")
    return "\n".join(lines)


def test_prediction_says_what_it_leaves_out():
    from ddp_recipes.bench.commodel import LEAVES_OUT, predict

    inside = predict(100.0, 25e6, 8, "nvlink3")
    assert inside["bound"] == "upper" and inside["leaves_out"] == list(LEAVES_OUT)
    assert "input pipeline" in " ".join(inside["leaves_out"])
    assert predict(100.0, 25e6, 16, "ib200")["bound"].startswith("none")
