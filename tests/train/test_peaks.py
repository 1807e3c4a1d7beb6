"""The dense peak FLOP/s table MFU is measured against, its Lightning fallback, and `bench peak`."""

from __future__ import annotations

import pytest
import torch

from ddp_recipes.bench.__main__ import main as bench_main
from ddp_recipes.errors import ConfigError
from ddp_recipes.train import peaks

TF = 1e12


@pytest.mark.parametrize(
    ("name", "gpu", "bf16_tflops", "tf32_tflops"),
    [
        ("NVIDIA H200", "H200 SXM", 989.5, 494.5),  # Lightning: None
        ("NVIDIA H200 NVL", "H200 NVL", 835.5, 417.5),
        ("NVIDIA H100 NVL", "H100 NVL", 835.5, 417.5),  # Lightning 2.6: 1978.8, a sparsity figure
        ("NVIDIA H100 80GB HBM3", "H100 SXM", 989.5, 494.5),
        ("NVIDIA H100 PCIe", "H100 PCIe", 756.5, 378),
        ("NVIDIA GH200 480GB", "GH200", 989.5, 494.5),  # not the H200 row, though the name holds "h200"
        ("NVIDIA B200", "B200", 2250, 1100),
        ("NVIDIA A100-SXM4-80GB", "A100", 312, 156),
        ("NVIDIA A100-PCIE-40GB", "A100", 312, 156),
        ("NVIDIA L40S", "L40S", 362.05, 183),  # Lightning reads it as an L4: 121
        ("NVIDIA L4", "L4", 121, 60),
    ],
)
def test_dense_peaks_for_names_as_torch_reports_them(name, gpu, bf16_tflops, tf32_tflops):
    assert peaks.find_row(name).gpu == gpu
    bf16 = peaks.peak(name, "bf16-mixed")
    assert bf16.flops == pytest.approx(bf16_tflops * TF) and bf16.dtype == "bf16"
    assert bf16.source.startswith(f"pack table: {gpu} (")
    assert peaks.peak(name, "16-mixed").flops == bf16.flops  # fp16 and bf16 tensor cores run at one rate
    tf32 = peaks.peak(name, "32-true")  # TF32 on: the pack's default for 32-true
    assert tf32.dtype == "tf32" and tf32.flops == pytest.approx(tf32_tflops * TF)
    full = peaks.peak(name, "32-true", tf32=False)
    assert full.dtype == "fp32" and full.flops < tf32.flops


@pytest.mark.parametrize(("name", "gpu", "fp32", "fp16"),
                         [("Tesla V100-SXM2-32GB", "V100 SXM2", 15.7, 125),
                          ("Tesla V100-PCIE-16GB", "V100 PCIe", 14, 112), ("Tesla T4", "T4", 8.1, 65)])
def test_pre_ampere_gpus_count_fp32_for_32_true_and_know_no_bf16(name, gpu, fp32, fp16):
    assert peaks.find_row(name).gpu == gpu
    run = peaks.peak(name, "32-true")  # TF32 asked, but there are no TF32 tensor cores: FP32 is the peak
    assert run.dtype == "fp32" and run.flops == pytest.approx(fp32 * TF)
    assert peaks.peak(name, "16-mixed").flops == pytest.approx(fp16 * TF)
    bf16 = peaks.peak(name, "bf16-mixed")
    assert bf16.flops is None and "no bf16 tensor cores" in bf16.source


def test_the_packs_dense_rows_answer_where_lightnings_table_is_off_or_silent():
    # Lightning 2.6's H100 NVL row is a datasheet "with sparsity" figure (1978.8 TF/s); its development head
    # (2026-07) holds the dense one. Either way the pack's row answers, and Lightning's is never below it.
    nvl = peaks.peak("NVIDIA H100 NVL", "bf16")
    assert nvl.source.startswith("pack table") and nvl.flops == pytest.approx(835.5 * TF)
    lightning_h100_nvl = peaks.lightning_peak("NVIDIA H100 NVL", "bf16")
    assert lightning_h100_nvl == nvl.flops or lightning_h100_nvl > 2 * nvl.flops, lightning_h100_nvl
    assert peaks.lightning_peak("NVIDIA H200", "bf16") is None  # the name Lightning misses (2.6 and its head)
    assert peaks.peak("NVIDIA H200", "bf16").source.startswith("pack table")


def test_unknown_rows_fall_back_to_lightning_and_unknown_names_say_unknown():
    a10g = peaks.peak("NVIDIA A10G", "bf16-mixed")
    assert peaks.find_row("NVIDIA A10G") is None
    assert a10g.flops == 125 * TF and a10g.source.startswith("lightning")
    assert peaks.peak("NVIDIA A10G", "32-true").flops == 62.5 * TF  # Lightning's tfloat32 row
    assert peaks.peak("NVIDIA A10G", "32-true", tf32=False).flops == 31.2 * TF  # its full-FP32 row
    nobody = peaks.peak("NVIDIA Imaginary 9000", "bf16-mixed")
    assert nobody.flops is None and "unknown" in nobody.describe()


def test_lightning_fallback_leaves_torch_as_it_was():
    before = torch.cuda.get_device_name
    peaks.lightning_peak("NVIDIA A10G", "fp32")
    assert torch.cuda.get_device_name is before


def test_every_row_names_its_source_and_orders_its_dtypes():
    for row in peaks.PEAKS:
        assert "datasheet" in row.source or "specifications" in row.source
        values = [v for v in (row.fp32, row.tf32, row.bf16, row.fp16, row.fp8) if v]
        assert values == sorted(values)  # fp32 <= tf32 <= bf16 = fp16 <= fp8
    assert "| H200 SXM |" in peaks.format_table()


def test_cpu_devices_and_unknown_precisions_have_no_peak():
    assert peaks.device_peak(torch.device("cpu"), "bf16-mixed") is None
    with pytest.raises(ConfigError, match="precision"):
        peaks.peak("NVIDIA H200", "fp64")


def test_bench_peak_prints_the_figure_or_unknown(capsys):
    assert bench_main(["peak", "--device-name", "NVIDIA H200", "--precision", "bf16-mixed"]) == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith("NVIDIA H200 at bf16-mixed (bf16): 989.5 TFLOP/s") and "H200 SXM" in out
    assert bench_main(["peak", "--device-name", "NVIDIA Imaginary 9000", "--precision", "fp8"]) == 0
    assert "unknown" in capsys.readouterr().out


@pytest.mark.parametrize(("args", "flag"), [(["--device-name", "NVIDIA H200", "--precision", "fp64"], "--precision"),
                                            (["--precision", "bf16"], "--device-name")])
def test_bench_peak_bad_input_is_one_line_exit_2(capsys, args, flag):
    if flag == "--device-name" and torch.cuda.is_available():
        pytest.skip("a visible GPU is the default --device-name")
    with pytest.raises(SystemExit) as exc:
        bench_main(["peak", *args])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and flag in err and "Traceback" not in err
