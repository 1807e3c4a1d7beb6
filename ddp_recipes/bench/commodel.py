"""An analytic model of DDP's gradient all-reduce: predicted speedup from a single-device step time.

Weak scaling (per-device batch fixed). Gradients (``params x bytes_per_param``) in ``bucket_mb`` buckets,
reduced in reverse layer order; one ring all-reduce of ``s`` bytes on N devices costs ``2(N-1)/N * s/B +
2(N-1)*alpha`` (Patarasuk & Yuan 2009; B is NCCL's bus bandwidth), a central server ``2(N-1) * s/B + 2*alpha``.
Backward is ``overlap`` (2/3) of the step, gradients coming out uniformly; a bucket's all-reduce starts when it is
full and the previous one is done; what runs past backward is *exposed*. DDP's own compute cost is a factor
``1 + ddp_overhead`` (3%: PyTorch's ResNet-50 on a V100, 329 vs 319 img/s). ``step_N = step_1 * (1 +
ddp_overhead) + exposed``; ``speedup = N * step_1 / step_N``.

A prediction is an upper bound (``predict`` says so: ``bound``, ``leaves_out``): it leaves out NCCL contending with
backward, stragglers, the input pipeline and hierarchical/in-network all-reduce.
:func:`validate_against_pytorch_benchmark` and :func:`published_scaling_table` hold it against published points
(docs/benchmark.md). Link presets give an *effective* bus bandwidth (nccl-tests' large-message ``busbw``) and a
per-ring-step latency; multi-node presets are the ring's slowest hop with one NIC per GPU.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ddp_recipes.config.cli import fail

DEFAULT_DDP_OVERHEAD = 0.03  # 329/319 - 1 = 3.1%: PyTorch DDP benchmark, ResNet-50, 1 V100, with vs without DDP
DEFAULT_OVERLAP = 2 / 3  # backward share of a step: ~2x forward FLOPs
DEFAULT_BUCKET_MB = 25.0  # DDP's bucket_cap_mb default (MiB)
MiB = 1024 * 1024


@dataclass(frozen=True)
class LinkPreset:
    """One interconnect, as the ring all-reduce sees it."""

    name: str
    bandwidth_GBps: float  # effective per-direction, per-GPU bus bandwidth usable by ring all-reduce (1e9 B/s)
    latency_us: float  # per ring step (alpha): launch, synchronisation and wire latency of one hop
    source: str  # where the numbers come from
    note: str = ""
    line_rate_GBps: float | None = None  # per-direction signalling rate after line coding, for contrast


_NCCL_BUSBW = "nccl-tests all_reduce_perf busbw for large messages (NCCL docs, PERFORMANCE.md)"
_PER_NIC = "one NIC per GPU; divide by k when k GPUs share a NIC"
_TCP = "no RDMA: every hop goes through the kernel's TCP stack"


def _pcie(gen: int, gts: int, line_rate: float, effective: float) -> LinkPreset:
    """A PCIe generation after 3.0: x16 at ``gts`` GT/s, 128b/130b coding, Gen3's ~77% packet efficiency."""
    return LinkPreset(f"pcie{gen}", effective, 10.0, line_rate_GBps=line_rate,
                      source=f"PCIe {gen}.0 x16: {gts} GT/s x 16 x 128b/130b = {line_rate:g} GB/s per direction; "
                             f"~{effective:g} GB/s effective (same ~77% packet efficiency as Gen3)")


def _infiniband(generation: str, gbps: int, effective: float, latency_us: float, layout: str) -> LinkPreset:
    """A 4x InfiniBand link of ``gbps`` Gb/s with one NIC per GPU, at nccl-tests' effective bus bandwidth."""
    return LinkPreset(f"ib{gbps}", effective, latency_us, line_rate_GBps=gbps / 8, note=_PER_NIC,
                      source=f"InfiniBand {generation} 4x: {gbps} Gb/s = {gbps / 8:g} GB/s per direction; "
                             f"~{effective:g} GB/s is the {_NCCL_BUSBW} with one {generation} NIC per GPU ({layout})")


LINKS: dict[str, LinkPreset] = {p.name: p for p in (
    LinkPreset("nvlink2", 130.0, 5.0, line_rate_GBps=150.0,
               source=f"V100 SXM2 datasheet: 6 NVLink2 links x 25 GB/s per direction = 150 GB/s; "
                      f"~130 GB/s effective is the {_NCCL_BUSBW} commonly reported on DGX-1V (8x V100)",
               note="DGX-1 hybrid cube-mesh; PyTorch's DDP benchmark ran on it"),
    LinkPreset("nvlink3", 230.0, 5.0, line_rate_GBps=300.0,
               source=f"A100 SXM4 datasheet: 12 NVLink3 links x 25 GB/s = 300 GB/s per direction (600 GB/s "
                      f"total); ~230 GB/s effective is the {_NCCL_BUSBW} reported on DGX A100 (NVSwitch)",
               note="8x A100 through NVSwitch"),
    LinkPreset("nvlink4", 360.0, 5.0, line_rate_GBps=450.0,
               source=f"H100 SXM5 datasheet: 18 NVLink4 links x 25 GB/s = 450 GB/s per direction (900 GB/s "
                      f"total); ~360 GB/s effective is the ring {_NCCL_BUSBW} on DGX H100",
               note="in-switch reduction (NVLS) reaches more; a ring model does not capture it"),
    LinkPreset("pcie3", 12.0, 10.0, line_rate_GBps=15.75,
               source="PCIe 3.0 x16: 8 GT/s x 16 lanes x 128b/130b = 15.75 GB/s per direction; ~12 GB/s "
                      "effective after packet (TLP) overhead, as measured by bandwidthTest / nccl-tests",
               note="GPUs behind one PCIe switch; through the CPU socket link it is lower"),
    _pcie(4, 16, line_rate=31.5, effective=24.0),
    _pcie(5, 32, line_rate=63.0, effective=48.0),
    LinkPreset("ib100", 11.5, 8.0, line_rate_GBps=12.5,
               source=f"InfiniBand EDR 4x: 100 Gb/s data rate = 12.5 GB/s per direction; ~11.5 GB/s is the "
                      f"{_NCCL_BUSBW} across nodes with one EDR NIC per GPU (GPUDirect RDMA)",
               note=_PER_NIC),
    _infiniband("HDR", 200, effective=23.0, latency_us=7.0, layout="DGX A100 SuperPOD layout"),
    _infiniband("NDR", 400, effective=46.0, latency_us=6.0, layout="DGX H100 SuperPOD layout"),
    LinkPreset("eth10", 1.1, 40.0, line_rate_GBps=1.25,
               source="10GbE: 10 Gb/s = 1.25 GB/s line rate; TCP goodput ~9.4 Gb/s (1500 MTU) = 1.17 GB/s, "
                      "~1.1 GB/s through NCCL/gloo sockets; TCP round trips give tens of us per step",
               note=_TCP),
    LinkPreset("eth25", 2.8, 35.0, line_rate_GBps=3.125,
               source="25GbE: 25 Gb/s = 3.125 GB/s line rate; ~22-23 Gb/s TCP goodput = ~2.8 GB/s through "
                      "NCCL/gloo sockets; tens of us per step as for 10GbE",
               note=_TCP),
)}


def get_link(link: LinkPreset | str) -> LinkPreset:
    """A preset by name (or the preset itself); an unknown name lists the valid ones."""
    if isinstance(link, LinkPreset):
        return link
    if link not in LINKS:
        raise ValueError(f"--link {link!r} is not a known link; choose one of: {', '.join(LINKS)}")
    return LINKS[link]


def ring_allreduce_seconds(nbytes: float, n: int, link: LinkPreset | str) -> float:
    """Seconds for one ring all-reduce of ``nbytes`` on ``n`` devices: 2(n-1)/n * S/B + 2(n-1)*alpha."""
    link = get_link(link)
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / (link.bandwidth_GBps * 1e9) + 2 * (n - 1) * link.latency_us * 1e-6


def central_allreduce_seconds(nbytes: float, n: int, link: LinkPreset | str) -> float:
    """Seconds for a central-server all-reduce: the server's one link moves 2(n-1) copies of S."""
    link = get_link(link)
    if n <= 1:
        return 0.0
    # The server's one link carries every byte: N-1 full gradients in, then (only once all are in and
    # summed) N-1 results out, so the phases do not overlap: 2(N-1) S/B, growing with N, where the ring's
    # per-device traffic stays under 2S.
    return 2 * (n - 1) * nbytes / (link.bandwidth_GBps * 1e9) + 2 * link.latency_us * 1e-6


def bucket_sizes(nbytes: float, bucket_bytes: float) -> list[float]:
    """Bucket sizes in reduction order: full buckets first, the partial one (first layers) last."""
    if nbytes <= 0:
        return []
    full = max(0, math.ceil(nbytes / bucket_bytes) - 1)
    return [bucket_bytes] * full + [nbytes - full * bucket_bytes]


def exposed_ms(bucket_ms: Sequence[float], bucket_bytes: Sequence[float], backward_ms: float) -> float:
    """Communication time left after backward ends, with buckets ready as backward produces their bytes."""
    total = sum(bucket_bytes)
    done = ready_bytes = 0.0
    for comm, size in zip(bucket_ms, bucket_bytes, strict=True):
        ready_bytes += size
        ready = backward_ms * ready_bytes / total
        done = max(done, ready) + comm  # one all-reduce at a time, each after its bucket is full
    return max(0.0, done - backward_ms)


def _check(name: str, value: float, minimum: float = 0.0, allow_equal: bool = False) -> None:
    ok = math.isfinite(value) and (value >= minimum if allow_equal else value > minimum)
    if not ok:
        bound = f">= {minimum:g}" if allow_equal else f"> {minimum:g}"
        raise ValueError(f"{name} must be {bound} (got {value})")


def predict(step_ms: float, params: float, devices: int, link: LinkPreset | str, bytes_per_param: float = 4,
            ddp_overhead: float = DEFAULT_DDP_OVERHEAD, bucket_mb: float = DEFAULT_BUCKET_MB,
            overlap: float = DEFAULT_OVERLAP) -> dict[str, Any]:
    """Predicted step time, speedup and efficiency at ``devices`` (ring) and with a central server."""
    _check("--step-ms", step_ms)
    _check("--params", params)
    _check("--bytes-per-param", bytes_per_param)
    _check("--ddp-overhead", ddp_overhead, allow_equal=True)
    _check("--bucket-mb", bucket_mb)
    if not (0 <= overlap <= 1):
        raise ValueError(f"--overlap must be between 0 and 1, the backward share of a step (got {overlap})")
    if int(devices) != devices or devices < 1:
        raise ValueError(f"--devices must be an integer >= 1 (got {devices})")
    devices = int(devices)
    link = get_link(link)
    grad_bytes = params * bytes_per_param
    buckets = bucket_sizes(grad_bytes, bucket_mb * MiB)
    multi = devices > 1
    compute_ms = step_ms * (1 + ddp_overhead) if multi else step_ms
    backward_ms = compute_ms * overlap
    out: dict[str, Any] = dict(
        link=link.name, devices=devices, step_ms=step_ms, params=params, bytes_per_param=bytes_per_param,
        ddp_overhead=ddp_overhead, bucket_mb=bucket_mb, overlap=overlap,
        bandwidth_GBps=link.bandwidth_GBps, latency_us=link.latency_us,
        grad_bytes=grad_bytes, buckets=len(buckets), step_ms_1=step_ms, compute_ms_n=compute_ms,
    )
    for prefix, algo in (("", ring_allreduce_seconds), ("central_", central_allreduce_seconds)):
        per_bucket = [algo(size, devices, link) * 1e3 for size in buckets]
        exposed = exposed_ms(per_bucket, buckets, backward_ms) if multi else 0.0
        step_n = compute_ms + exposed
        speedup = devices * step_ms / step_n
        out.update({f"{prefix}comm_ms": sum(per_bucket), f"{prefix}exposed_comm_ms": exposed,
                    f"{prefix}step_ms_n": step_n, f"{prefix}speedup": speedup,
                    f"{prefix}efficiency": speedup / devices})
    if link.name.startswith(("ib", "eth")):
        # Across nodes NCCL runs trees or a hierarchical ring (NVLink inside, the NIC between) that move less
        # over the slow hop than this flat ring: PyTorch's 16-GPU point beats the model by 3 points.
        out["bound"] = "none (multi-node: a flat ring over the slowest hop can be pessimistic)"
    else:
        out["bound"] = "upper"
    out["leaves_out"] = list(LEAVES_OUT)
    return out


LEAVES_OUT = (
    "NCCL kernels contending with backward for SMs and memory bandwidth",
    "per-step synchronisation and stragglers (every step waits for the slowest rank)",
    "the input pipeline (N devices need N times the decoded samples per second from the host)",
    "hierarchical and in-network (SHARP/NVLS) all-reduce",
)


def predict_table(step_ms: float, params: float, link_names: Iterable[str] | None = None,
                  devices: Sequence[int] = (2, 4, 8, 16), **kwargs: Any) -> list[dict[str, Any]]:
    """:func:`predict` for every link (default: all presets) x device count, link-major."""
    names = list(LINKS) if link_names is None else list(link_names)
    return [predict(step_ms, params, n, name, **kwargs) for name in names for n in devices]


# PyTorch's DDP benchmark, benchmarks/distributed/ddp/README.md in pytorch/pytorch: ResNet-50, batch 32
# per GPU, fp32, V100s in DGX-1 machines (NVLink2), NCCL, bucket_cap_mb 25. Per-GPU images/s (p50).
PYTORCH_DDP_BENCHMARK: dict[str, Any] = {
    "source": "pytorch/pytorch benchmarks/distributed/ddp/README.md (PyTorch 1.4, CUDA 10.0, NCCL)",
    "model": "resnet50", "params": 25_557_032, "batch_per_gpu": 32, "link": "nvlink2",
    "no_ddp_per_gpu": 329.0, "ddp_1gpu_per_gpu": 319.0,
    "ddp_per_gpu": {2: 310.0, 4: 310.0, 8: 307.0},  # one machine
    "ddp_16gpu_per_gpu": 306.0,  # 2 machines x 8 GPUs, 4x EDR InfiniBand per machine
}


# NVIDIA DeepLearningExamples, PyTorch/Classification/ConvNets/resnet50v1.5/README.md, "Training
# performance: NVIDIA DGX A100 (8x A100 80GB)", pytorch-21.03 NGC container, batch 256 per GPU (the
# script's default), images/s over the whole job.
NVIDIA_A100_RN50: dict[str, Any] = {
    "source": "NVIDIA DeepLearningExamples resnet50v1.5 (PyTorch), DGX A100 80GB, pytorch-21.03",
    "model": "resnet50", "params": 25_557_032, "batch_per_gpu": 256, "link": "nvlink3",
    "throughput": {"TF32": {1: 938.0, 8: 7248.0}, "AMP": {1: 2470.0, 8: 16621.0}},
}
# 16 GPUs of PyTorch's benchmark: 2 DGX-1 machines, "4x 100Gb InfiniBand per machine", so the ring's
# slowest hop is EDR shared by 2 GPUs per NIC.
IB100_SHARED_BY_2 = LinkPreset("ib100 (2 GPUs per NIC)", LINKS["ib100"].bandwidth_GBps / 2,
                               LINKS["ib100"].latency_us, source="ib100 preset halved: 8 GPUs, 4 EDR NICs per machine")


def published_scaling_table() -> list[dict[str, Any]]:
    """Every published multi-GPU point docs/benchmark.md cites beside the model's figure from the 1-GPU step.

    ``gap_ms`` is how much longer the published N-GPU step is than the predicted one: the cost the model
    leaves out (see :data:`LEAVES_OUT`).
    """
    rows = []
    bench = PYTORCH_DDP_BENCHMARK
    per_gpu = {**bench["ddp_per_gpu"], 16: bench["ddp_16gpu_per_gpu"]}
    for n, value in per_gpu.items():
        rows.append(_table_row(bench["source"], "fp32", "V100", bench["params"], bench["batch_per_gpu"],
                               bench["no_ddp_per_gpu"], n, value * n, bench["link"] if n <= 8 else IB100_SHARED_BY_2))
    nv = NVIDIA_A100_RN50
    for precision, figures in nv["throughput"].items():
        rows.append(_table_row(nv["source"], precision, "A100 80GB", nv["params"], nv["batch_per_gpu"],
                               figures[1], 8, figures[8], nv["link"]))
    return rows


def _table_row(source: str, precision: str, gpu: str, params: int, batch: int, one_gpu: float, n: int,
               total: float, link: LinkPreset | str) -> dict[str, Any]:
    step_1 = batch / one_gpu * 1e3
    pred = predict(step_1, params, n, link)
    published_step = batch * n / total * 1e3
    return {"source": source, "precision": precision, "gpu": gpu, "devices": n, "link": get_link(link).name,
            "step_ms_1": step_1, "published_efficiency": total / (n * one_gpu),
            "predicted_efficiency": pred["efficiency"],
            "error_points": 100 * (pred["efficiency"] - total / (n * one_gpu)),
            "comm_ms": pred["comm_ms"], "published_step_ms_n": published_step,
            "predicted_step_ms_n": pred["step_ms_n"], "gap_ms": published_step - pred["step_ms_n"]}


def validate_against_pytorch_benchmark(tolerance_points: float = 5.0) -> dict[str, Any]:
    """Predicted vs published ResNet-50 efficiency on 8 V100s (NVLink2); ``ok`` when within tolerance."""
    bench = PYTORCH_DDP_BENCHMARK
    step_ms = bench["batch_per_gpu"] / bench["no_ddp_per_gpu"] * 1e3
    rows = {}
    for n, per_gpu in bench["ddp_per_gpu"].items():
        pred = predict(step_ms, bench["params"], n, bench["link"])
        published = per_gpu / bench["no_ddp_per_gpu"]
        rows[n] = {"predicted_efficiency": pred["efficiency"], "published_efficiency": published,
                   "error_points": 100 * (pred["efficiency"] - published),
                   "predicted_per_gpu": bench["batch_per_gpu"] / pred["step_ms_n"] * 1e3,
                   "published_per_gpu": per_gpu, "predicted_exposed_comm_ms": pred["exposed_comm_ms"]}
    at8 = rows[8]
    return {
        "source": bench["source"], "model": bench["model"], "params": bench["params"], "link": bench["link"],
        "step_ms_1": step_ms, "devices": 8,
        "predicted_efficiency": at8["predicted_efficiency"], "published_efficiency": at8["published_efficiency"],
        "predicted_speedup": 8 * at8["predicted_efficiency"], "published_speedup": 8 * at8["published_efficiency"],
        "error_points": at8["error_points"], "tolerance_points": tolerance_points,
        "ok": abs(at8["error_points"]) <= tolerance_points, "by_devices": rows,
    }


# ---- CLI: python -m ddp_recipes.bench predict ... -----------------------------------------------------

PROG = "python -m ddp_recipes.bench predict"
PREDICT_DOC = "Predict DDP speedup from a single-device step time."


def format_links_table() -> str:
    """The presets as a markdown table: effective and line-rate bandwidth, latency, source."""
    lines = ["| link | effective GB/s | line rate GB/s | latency us | source |", "| --- | ---: | ---: | ---: | --- |"]
    for p in LINKS.values():
        line_rate = f"{p.line_rate_GBps:g}" if p.line_rate_GBps else "-"
        lines.append(f"| {p.name} | {p.bandwidth_GBps:g} | {line_rate} | {p.latency_us:g} | {p.source} |")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``bench predict``."""
    parser.add_argument("--step-ms", type=float, help="measured single-device step time (ms), no DDP")
    parser.add_argument("--params", type=float, help="number of trainable parameters (gradients all-reduced)")
    parser.add_argument("--devices", type=int, help="number of devices N (weak scaling: batch per device fixed)")
    parser.add_argument("--link", metavar="NAME", help=f"link preset: {', '.join(LINKS)}")
    parser.add_argument("--bytes-per-param", type=float, default=4.0, help="gradient bytes per parameter "
                        "(4 fp32; 2 with an fp16/bf16 comm hook)")
    parser.add_argument("--ddp-overhead", type=float, default=DEFAULT_DDP_OVERHEAD,
                        help="DDP compute overhead fraction when N > 1")
    parser.add_argument("--bucket-mb", type=float, default=DEFAULT_BUCKET_MB, help="DDP bucket size (MiB)")
    parser.add_argument("--overlap", type=float, default=DEFAULT_OVERLAP,
                        help="share of the step (backward) that communication can hide under")
    parser.add_argument("--list-links", action="store_true", help="print the link presets and exit")


def run_command(args: argparse.Namespace) -> int:
    """``bench predict``: print the prediction as JSON; bad input exits 2 with a one-line error naming the flag."""
    if args.list_links:
        print(format_links_table())
        return 0
    for name in ("step_ms", "params", "devices", "link"):
        if getattr(args, name) is None:
            fail(f"--{name.replace('_', '-')} is required (or use --list-links)", PROG)
    params = int(args.params) if math.isfinite(args.params) and args.params.is_integer() else args.params
    try:
        result = predict(args.step_ms, params, args.devices, args.link, bytes_per_param=args.bytes_per_param,
                         ddp_overhead=args.ddp_overhead, bucket_mb=args.bucket_mb, overlap=args.overlap)
    except ValueError as err:
        fail(str(err), PROG)
    result["link_preset"] = asdict(get_link(args.link))
    print(json.dumps(result, indent=2))
    return 0
