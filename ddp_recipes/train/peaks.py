"""Dense peak FLOP/s per GPU and compute dtype: what MFU is measured against.

MFU divides achieved FLOP/s by a peak. Lightning's ``get_available_flops`` misses some names as
``torch.cuda.get_device_name`` spells them (``NVIDIA H200`` gives None; ``NVIDIA L40S`` is read as an
L4), and in 2.6 its H100 NVL / H200 rows are the datasheets' "with sparsity" figures, twice what dense
training can reach: MFU would read half (its development head, 2026-07, has the dense ones). This table
holds the vendor datasheets' *dense* tensor-core figures (a datasheet footnoted "with sparsity" is halved
here), matched on the names torch reports; for any other GPU :func:`peak` falls back to Lightning's table and says so.

``python -m ddp_recipes.bench peak --device-name NAME --precision P`` prints what a run would use (the command
is in ``ddp_recipes.bench.__main__``; this module is the table).
"""

from __future__ import annotations

import re
import warnings
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch

from ddp_recipes.config.choices import PEAK_DTYPES, PRECISIONS, check_choice
from ddp_recipes.lightning_seam.reach import no_ampere_check

T = 1e12
# What each precision computes its matmuls/convolutions in; 32-true is TF32 where TF32 is on. The pack's
# run precisions, plus Lightning's true-half ones (a Trainer built outside the recipes may use them).
PRECISION_DTYPES = {"32-true": "fp32", "bf16-mixed": "bf16", "16-mixed": "fp16", "bf16-true": "bf16",
                    "16-true": "fp16"}
PEAK_PRECISIONS: tuple[str, ...] = (*PRECISIONS, *PEAK_DTYPES)  # what `bench peak --precision` lists
_LIGHTNING_DTYPES: dict[str, Any] = {"fp32": torch.float32, "tf32": "tfloat32", "bf16": torch.bfloat16,
                                     "fp16": torch.float16, "fp8": getattr(torch, "float8_e4m3fn", "fp8")}


@dataclass(frozen=True)
class PeakRow:
    """One GPU: its dense peak FLOP/s per dtype (None: no such tensor-core path) and where they are from."""

    gpu: str
    pattern: str  # regex searched in the lower-cased torch device name
    fp32: float
    tf32: float | None
    bf16: float | None
    fp16: float | None
    fp8: float | None
    source: str

    def flops(self, dtype: str) -> float | None:
        return getattr(self, dtype)


_SPARSE = "dense = the datasheet's 'with sparsity' figure / 2"
# Hopper's dense figures (FP32, TF32, BF16, FP16, FP8): every SXM part (GH200 included) has one set, both
# NVL cards another.
_HOPPER_SXM = (67 * T, 494.5 * T, 989.5 * T, 989.5 * T, 1979 * T)
_HOPPER_NVL = (60 * T, 417.5 * T, 835.5 * T, 835.5 * T, 1670.5 * T)
# Most specific first: the first row whose pattern matches the name wins ("gh200" before "h200", "l40s"
# before "l40" before "l4", "h100 nvl" before "h100").
PEAKS: tuple[PeakRow, ...] = (
    PeakRow("GH200", r"\bgh200\b", *_HOPPER_SXM, f"NVIDIA GH200 Grace Hopper Superchip datasheet; {_SPARSE}"),
    PeakRow("H200 NVL", r"\bh200\b.*\bnvl", *_HOPPER_NVL,
            f"NVIDIA H200 Tensor Core GPU datasheet, H200 NVL column; {_SPARSE}"),
    PeakRow("H200 SXM", r"\bh200\b", *_HOPPER_SXM,
            f"NVIDIA H200 Tensor Core GPU datasheet, H200 SXM column; {_SPARSE}"),
    PeakRow("H100 NVL", r"\bh100\b.*\bnvl", *_HOPPER_NVL,
            f"NVIDIA H100 Tensor Core GPU datasheet, H100 NVL column (per GPU, 94 GB); {_SPARSE}"),
    # "NVIDIA H100 PCIe"; the 80 GB PCIe card also reports "NVIDIA H100 80GB HBM2e".
    PeakRow("H100 PCIe", r"\bh100\b.*(pcie|hbm2e)", 51 * T, 378 * T, 756.5 * T, 756.5 * T, 1513 * T,
            f"NVIDIA H100 Tensor Core GPU datasheet, H100 PCIe column; {_SPARSE}"),
    # "NVIDIA H100 80GB HBM3" (and any other H100 spelling) is the SXM5 part.
    PeakRow("H100 SXM", r"\bh100\b", *_HOPPER_SXM,
            f"NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column; {_SPARSE}"),
    PeakRow("B200", r"\bb200\b", 75 * T, 1100 * T, 2250 * T, 2250 * T, 4500 * T,
            f"NVIDIA HGX B200 specifications, per GPU (1000 W); {_SPARSE}"),
    # SXM4 and PCIe, 40 and 80 GB: one set of figures ("NVIDIA A100-SXM4-80GB", "NVIDIA A100-PCIE-40GB").
    PeakRow("A100", r"\ba100\b", 19.5 * T, 156 * T, 312 * T, 312 * T, None,
            f"NVIDIA A100 Tensor Core GPU datasheet; {_SPARSE}"),
    PeakRow("L40S", r"\bl40s\b", 91.6 * T, 183 * T, 362.05 * T, 362.05 * T, 733 * T,
            "NVIDIA L40S datasheet (dense column; the starred column is with sparsity)"),
    PeakRow("L40", r"\bl40\b", 90.5 * T, 90.5 * T, 181.05 * T, 181.05 * T, 362 * T,
            "NVIDIA L40 datasheet (dense column; the starred column is with sparsity)"),
    PeakRow("L4", r"\bl4\b", 30.3 * T, 60 * T, 121 * T, 121 * T, 242.5 * T,
            f"NVIDIA L4 Tensor Core GPU datasheet; {_SPARSE}"),
    # Volta and Turing: no TF32 and no bf16 tensor cores (bf16 there is emulated, not a peak to measure by).
    PeakRow("V100S PCIe", r"\bv100s\b", 16.4 * T, None, None, 130 * T, None, "NVIDIA V100S datasheet"),
    PeakRow("V100 SXM2", r"\bv100-sxm", 15.7 * T, None, None, 125 * T, None,
            "NVIDIA Tesla V100 datasheet, SXM2 column"),
    PeakRow("V100 PCIe", r"\bv100-pcie", 14 * T, None, None, 112 * T, None,
            "NVIDIA Tesla V100 datasheet, PCIe column"),
    PeakRow("T4", r"\bt4\b", 8.1 * T, None, None, 65 * T, None, "NVIDIA T4 Tensor Core GPU datasheet"),
)


@dataclass(frozen=True)
class Peak:
    """The peak a run would use: FLOP/s (None: unknown), the dtype it is for, and where it is from."""

    device_name: str
    precision: str
    dtype: str
    flops: int | None
    source: str  # "pack table: <row> (<datasheet>)", "lightning's get_available_flops", or why unknown

    def describe(self) -> str:
        """One line for a person: the figure and its source, or ``unknown`` and why."""
        head = f"{self.device_name} at {self.precision} ({self.dtype})"
        if self.flops is None:
            return f"{head}: unknown ({self.source}); MFU is reported as null"
        return f"{head}: {self.flops / 1e12:g} TFLOP/s dense = {self.flops:.4g} FLOP/s; source: {self.source}"


def find_row(device_name: str) -> PeakRow | None:
    """The table's row for a name as ``torch.cuda.get_device_name`` returns it; None when no row matches."""
    name = device_name.lower()
    return next((row for row in PEAKS if re.search(row.pattern, name)), None)


def compute_dtype(precision: str, tf32: bool, row: PeakRow | None = None) -> str:
    """The dtype whose peak a run at ``precision`` is measured against: a run precision (``32-true`` is
    ``tf32`` when TF32 is on and the GPU has TF32 tensor cores) or a dtype named directly."""
    if precision in PEAK_DTYPES:
        return precision
    if precision not in PRECISION_DTYPES:
        check_choice("precision", precision, PEAK_PRECISIONS)
    dtype = PRECISION_DTYPES[precision]
    if dtype == "fp32" and tf32 and (row is None or row.tf32 is not None):
        return "tf32"
    return dtype


def lightning_peak(device_name: str, dtype: str) -> int | None:
    """Lightning's ``get_available_flops`` for ``device_name`` (no GPU needed): it reads the name from
    ``torch.cuda.get_device_name``, which is stood in for during the call and restored after. ``fp32``
    means full FP32: its Ampere test, which would switch to TF32, is answered no (TF32 asks ``tf32``)."""
    from lightning.fabric.utilities.throughput import get_available_flops

    with ExitStack() as stack, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its "FLOPs not found" warning: unknown is said by the caller
        stack.enter_context(mock.patch.object(torch.cuda, "get_device_name", lambda *_: device_name))
        stack.enter_context(no_ampere_check())
        try:
            flops = get_available_flops(torch.device("cuda", 0), _LIGHTNING_DTYPES[dtype])
        except Exception:  # noqa: BLE001 - a name Lightning cannot parse is a name it does not know
            return None
    return int(flops) if flops else None


def peak(device_name: str, precision: str, tf32: bool = True) -> Peak:
    """The dense peak FLOP/s for ``device_name`` at ``precision`` (a run precision or a dtype key): the
    pack's table first, then Lightning's for GPUs the table has no row for. Raises ConfigError naming
    ``precision`` for a value that is neither."""
    row = find_row(device_name)
    dtype = compute_dtype(precision, tf32, row)
    if row is not None:
        flops = row.flops(dtype)
        if flops is None:
            return Peak(device_name, precision, dtype, None, f"the {row.gpu} has no {dtype} tensor cores")
        return Peak(device_name, precision, dtype, int(flops), f"pack table: {row.gpu} ({row.source})")
    flops = lightning_peak(device_name, dtype)
    if flops is None and dtype == "tf32":  # a pre-Ampere GPU unknown to us: FP32 is what it runs
        dtype, flops = "fp32", lightning_peak(device_name, "fp32")
    if flops is None:
        return Peak(device_name, precision, dtype, None, "neither the pack's table nor Lightning's knows it")
    return Peak(device_name, precision, dtype, flops, "lightning's get_available_flops (not in the pack's table)")


def device_peak(device: torch.device, precision: str) -> int | None:
    """Peak FLOP/s of a visible device at a run precision; TF32 counted for ``32-true`` when this process
    has it on (``torch.get_float32_matmul_precision() != "highest"``). None on CPU and for unknown GPUs."""
    if device.type != "cuda" or str(precision) not in (*PRECISION_DTYPES, *PEAK_DTYPES):
        return None  # e.g. 64-true or transformer-engine: no figure here, and no guess
    tf32 = torch.get_float32_matmul_precision() != "highest"
    return peak(torch.cuda.get_device_name(device), str(precision), tf32=tf32).flops


def format_table() -> str:
    """The table as markdown, TFLOP/s per dtype and the source of each row."""
    lines = ["| GPU | matches | FP32 | TF32 | BF16 | FP16 | FP8 | source |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for row in PEAKS:
        cells = [f"{v / T:g}" if v else "-" for v in (row.fp32, row.tf32, row.bf16, row.fp16, row.fp8)]
        lines.append(f"| {row.gpu} | `{row.pattern}` | " + " | ".join(cells) + f" | {row.source} |")
    return "\n".join(lines)
