"""`python -m ddp_recipes.bench` end to end at toy size (no timing is asserted), and its bad input."""

from __future__ import annotations

import json

import pytest
import torch

from ddp_recipes.bench.__main__ import main
from ddp_recipes.bench.speedup.run import BenchConfig
from tests import launch


@pytest.mark.slow  # over 30 s: the fast suite keeps its 10-minute budget
def test_tiny_end_to_end_writes_all_outputs(tmp_path):
    out = tmp_path / "bench"
    # threads=None: the bench sets each run's thread budget itself, from what it finds
    proc = launch.run(["-m", "ddp_recipes.bench", "--recipe", "mnist", "--devices", "1,2", "--steps", "2",
                       "--warmup-steps", "1", "--repeats", "1", "--accelerator", "cpu", "--out", str(out)],
                      timeout=400, port=False, threads=None, check=True)
    assert {p.name for p in out.iterdir()} >= {"results.json", "report.md", "speedup.png", "runs"}
    results = json.loads((out / "results.json").read_text())
    measured = {(r["impl"], r["devices"]) for r in results["runs"]}
    assert measured == {(impl, n) for impl in ("pack", "plain", "raw") for n in (1, 2)}, (results["warnings"],
                                                                                          proc.stderr[-3000:])
    for run in results["runs"]:
        assert run["measured_steps"] == 2 and run["global_samples_per_s"] > 0
        assert len(run["peak_mem_mb_per_rank"]) == run["devices"]
        assert run["torch_threads"] == results["config"]["threads"]  # the stated thread budget was applied
    assert set(results["overhead_ratio"]) == {"1", "2"}
    assert results["allreduce"][0]["devices"] == 2 and results["allreduce"][0]["nbytes"] == 101_770 * 4
    assert results["ceiling"]["workers"] == 2
    assert len(results["prediction"]["rows"]) == 11 * 4  # every link preset at N = 2, 4, 8, 16
    assert "| pack | 2 |" in proc.stdout  # the markdown table is printed too
    # The MLP: forward 2 x (784x128 + 128x10), backward the weight gradients again plus layer 2's input grad.
    assert results["flops"]["per_sample"] == 4 * (784 * 128 + 128 * 10) + 2 * 128 * 10
    assert results["flops"]["peak_per_device"] is None  # a CPU: no peak, so no MFU (never a guess)
    for run in results["runs"]:
        assert run["mfu"] is None and run["achieved_flops_per_sec_per_device"] > 0
    assert all(0 <= r["input_wait_fraction"] <= 1 for r in results["runs"] if r["impl"] == "pack")
    assert proc.stdout.strip().splitlines()[-1].startswith("bench: pack_speedup@2=")
    assert "[6/6] round 1: raw" in proc.stderr  # progress display
    assert [d["devices"] for d in results["diagnostics_overhead"]] == [1, 2]
    assert set(results["plain_overhead_spread"]) == {"1", "2"}  # the pack against plain Lightning, paired
    assert {"DDPDiagnostics", "LastCheckpoint", "ThroughputMeter"} <= set(results["hook_overhead"]["2"])
    for impl in ("pack", "plain", "raw"):  # each rank built only its share of the synthetic set, and said so
        for n in (1, 2):
            run = json.loads((out / "runs" / f"{impl}-{n}-round1.json").read_text())
            assert run["synthetic_samples_per_rank"] * n == run["synthetic_samples_global"] == (1 + 2 + 1) * 32 * n
            assert run["cudnn_benchmark"] is True and run["synthetic_data_on"] == "cpu"
    assert results["config"]["cudnn_benchmark"].startswith("on in pack, raw and dp alike")
    assert all(d["ms_per_step"] >= 0 for d in results["diagnostics_overhead"])


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--devices", "2,4"], "--devices"),
        (["--devices", "one"], "--devices"),
        (["--accelerator", "cpu", "--precision", "16-mixed"], "--precision"),
        (["--recipe", "mnist", "--arch", "resnet50"], "--arch"),
        (["--steps", "1"], "--steps"),
        (["--warmup-steps", "0"], "--warmup-steps"),
        (["--accelerator", "cuda"], "--accelerator"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(tmp_path, capsys, args, flag):
    if flag == "--accelerator":
        pytest.importorskip("torch")
        import torch

        if torch.cuda.is_available():
            pytest.skip("a CUDA device is visible")
    with pytest.raises(SystemExit) as exc:
        main([*args, "--out", str(tmp_path / "b")])
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err.strip().splitlines()[-1]
    assert not (tmp_path / "b").exists()


def test_defaults_fit_a_cpu_host():
    settings = BenchConfig(accelerator="cpu").resolve()
    assert settings["arch"] == "resnet18" and settings["image_size"] == 32 and settings["precision"] == "32-true"
    assert settings["devices"] == [1, 2] and settings["threads"] >= 1


def test_predict_subcommand_prints_json(capsys):
    assert main(["predict", "--step-ms", "97.26", "--params", "25557032", "--devices", "8", "--link", "nvlink2"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert 0 < result["efficiency"] <= 1 and result["speedup"] == pytest.approx(8 * result["efficiency"])


def test_repeats_interleave_pairs_and_report_the_median_ratio(tmp_path, monkeypatch):
    """Rounds alternate pack/raw at each N; a burst of host load in one round cannot decide the verdict."""
    from ddp_recipes.bench.speedup import run as bench

    calls = []
    slow_round = 1  # the host is 3x slower for all of round 1

    def fake_worker(impl, n, settings, out_dir, tag=""):
        round_no = sum(1 for c in calls if c == (impl, n))
        calls.append((impl, n))
        rate = {"raw": 100.0, "plain": 97.0}.get(impl, 98.0) * n / (3 if round_no == slow_round else 1)
        return {"impl": impl, "devices": n, "global_samples_per_s": rate, "step_ms_median": 1000 / rate,
                "step_ms_p10": 1.0, "step_ms_p90": 2.0, "peak_mem_mb_per_rank": [1.0] * n, "measured_steps": 2}

    monkeypatch.setattr(bench, "run_worker", fake_worker)
    monkeypatch.setattr(bench, "parallel_ceiling", lambda n: {"workers": n, "ceiling": 1.9, "relative_mean": 0.95,
                                                                "usable_cpus": 2})
    monkeypatch.setattr(bench, "_prediction", lambda results, raw: None)
    results = bench.run_bench(bench.BenchConfig(recipe="mnist", devices="1,2", accelerator="cpu", repeats=3,
                                                out=str(tmp_path)))
    assert calls == [("pack", 1), ("plain", 1), ("raw", 1), ("pack", 2), ("plain", 2), ("raw", 2),
                     ("raw", 1), ("plain", 1), ("pack", 1), ("raw", 2), ("plain", 2), ("pack", 2),
                     ("pack", 1), ("plain", 1), ("raw", 1), ("pack", 2), ("plain", 2), ("raw", 2)]
    assert results["overhead_ratio"] == {1: pytest.approx(0.98), 2: pytest.approx(0.98)}
    assert results["plain_overhead_spread"][2]["median"] == pytest.approx(98 / 97)
    assert results["overhead_spread"][2]["pairs"] == 3
    rows = {(r["impl"], r["devices"]): r for r in results["runs"]}
    assert rows[("raw", 2)]["global_samples_per_s"] == 200.0 and rows[("raw", 2)]["rounds"] == 3
    assert rows[("raw", 2)]["samples_per_s_range"] == [pytest.approx(200 / 3), 200.0]
    from ddp_recipes.bench.speedup.report import markdown_report

    assert "median of 3 interleaved pairs" in markdown_report(results)


def test_a_ceiling_probe_beaten_by_a_measured_speedup_is_probed_again_and_reported_as_a_range(tmp_path, monkeypatch):
    from ddp_recipes.bench.speedup import run as bench
    from ddp_recipes.bench.speedup.report import markdown_report

    probes = iter([1.2, 1.9])  # the first while other work shared the host
    monkeypatch.setattr(bench, "run_worker", lambda impl, n, settings, out_dir, tag="": {
        "impl": impl, "devices": n, "global_samples_per_s": 100.0 * n ** 0.97, "step_ms_median": 10.0,
        "step_ms_p10": 1.0, "step_ms_p90": 2.0, "peak_mem_mb_per_rank": [1.0] * n, "measured_steps": 2})
    monkeypatch.setattr(bench, "parallel_ceiling", lambda n: {"workers": n, "ceiling": next(probes),
                                                                "relative_mean": 0.6, "usable_cpus": 2})
    monkeypatch.setattr(bench, "_prediction", lambda results, raw: None)
    results = bench.run_bench(bench.BenchConfig(recipe="mnist", devices="1,2", accelerator="cpu", repeats=1,
                                                out=str(tmp_path)))
    assert results["ceiling"]["probes"] == [1.2, 1.9]  # 1.96x measured beat the first probe
    words = " ".join([markdown_report(results), *results["warnings"]])
    assert "1.20x-1.90x" in words and "disturbed" in words and "impossible" not in words


def _jpeg_folder(root, per_class: int = 20):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for cls in ("cat", "dog"):
        (root / cls).mkdir(parents=True)
        for i in range(per_class):
            Image.fromarray(rng.integers(0, 255, (40, 56, 3), dtype=np.uint8)).save(root / cls / f"{i}.jpg")
    return root


def test_loader_bench_times_each_decode_path_per_worker_count(tmp_path, capsys):
    from ddp_recipes.data.decoders import image_decoders

    folder = _jpeg_folder(tmp_path / "imgs")
    out = tmp_path / "loader.json"
    assert main(["loader", "--data-dir", str(folder), "--workers", "0,1", "--batch-size", "8", "--batches", "2",
                 "--image-size", "32", "--repeats", "1", "--target-images-per-s", "5000", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    # The decoder library is a dimension of the paths that decode with one: both where torchcodec imports.
    libraries = ["torchcodec", "torchvision"] if image_decoders().name == "torchcodec" else ["torchvision"]
    cells = {(r["decode"], r["decoder"], r["workers"]): r for r in result["rows"]}
    decoding = {(d, lib, w) for d in ("tensor", "gpu") for lib in libraries for w in (0, 1)}
    assert result["decoders"] == libraries and set(cells) == {("pil", None, w) for w in (0, 1)} | decoding
    assert all(r["images_per_s"] > 0 and r["images_per_s_rounds"] == [r["images_per_s"]] for r in cells.values())
    assert all(r["workers_for_target"] >= 1 for (d, _, _), r in cells.items() if d != "gpu")
    # Without CUDA the gpu path runs the recipe's --decode gpu code on the CPU, and the table says so.
    for library in libraries:
        gpu = cells[("gpu", library, 1)]
        assert gpu["device"] == "cpu" and gpu["cpu_fallbacks"] == 0 and gpu["images_per_s_per_worker"] is None
    printed = capsys.readouterr().out
    assert result["images"] == 40 and f"| tensor | {libraries[0]} | 1 |" in printed and "| pil | - | 1 |" in printed
    assert f"| gpu (on cpu) | {libraries[-1]} | 1 |" in printed and "not nvJPEG on a GPU" in printed


def test_loader_bench_writes_real_size_synthetic_jpegs(tmp_path, capsys):
    out = tmp_path / "loader.json"
    assert main(["loader", "--synthetic", "16", "--workers", "0", "--decode", "pil,gpu", "--batch-size", "4",
                 "--batches", "2", "--image-size", "32", "--repeats", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["synthetic"] == 16 and result["images"] == 16 and result["data_dir"] is None
    assert {r["decode"] for r in result["rows"]} == {"pil", "gpu"}
    assert "16 synthetic JPEGs (about 500 x 375, made by the bench)" in capsys.readouterr().out


@pytest.mark.parametrize(("args", "needle"), [
    (["--decode", "pil,jpegturbo"], "--decode"),
    (["--decoders", "pillow"], "--decoders takes auto or torchcodec, torchvision (got 'pillow')"),
    (["--workers", "two"], "--workers"),
    (["--batch-size", "64"], "one epoch must hold"),
    # 40 images: 5 batches of 8, but 1 + 2 x 2 are skipped before the clock starts (it reported 0.0 images/s)
    (["--workers", "2", "--batch-size", "8", "--batches", "1"], "holds 40 image(s) in 2 class folder(s); one epoch "
                                                                "must hold 5 untimed batch(es)"),
    (["--synthetic", "64"], "--data-dir DIR (an ImageFolder tree) or --synthetic N"),
    (["--gpu-decode", "--device", "cpu"], "--gpu-decode" if torch.cuda.is_available() else "needs a CUDA GPU"),
])
def test_loader_bench_bad_input_is_one_line(tmp_path, capsys, args, needle):
    folder = _jpeg_folder(tmp_path / "imgs")
    with pytest.raises(SystemExit) as exit_info:
        main(["loader", "--data-dir", str(folder), *args])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and needle in err and err.count("\n") == 0


def test_loader_bench_gpu_decode_needs_cuda(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("CUDA is visible")
    with pytest.raises(SystemExit):
        main(["loader", "--data-dir", str(_jpeg_folder(tmp_path / "imgs")), "--gpu-decode"])
    assert "--gpu-decode needs a CUDA GPU" in capsys.readouterr().err


def test_loader_bench_refuses_an_empty_decode_list(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["loader", "--data-dir", str(_jpeg_folder(tmp_path / "imgs")), "--decode", ","])
    assert "--decode names no decode path" in capsys.readouterr().err
