"""The doctor's all-reduce latency/bandwidth sweep: sizes, timing and bus bandwidth as nccl-tests reports them."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from ddp_recipes.doctor.config import MIN_BYTES, DoctorConfig, parse_bytes

CPU_BYTES_BUDGET = 128 << 20  # bytes all-reduced per size on CPU: the default sweep stays at a few seconds


def sweep_sizes(max_bytes: int) -> list[int]:
    """4K, 16K, 64K ... up to max_bytes: powers of 4, like nccl-tests -b 4K -e 64M -f 4."""
    return [MIN_BYTES * 4**i for i in range(32) if MIN_BYTES * 4**i <= max_bytes]


def bus_bandwidth(algbw: float, world: int) -> float:
    """nccl-tests' all-reduce bus bandwidth: algbw * 2(n-1)/n, what each link of a ring carries."""
    return algbw * 2 * (world - 1) / world


def bandwidth_sweep(cfg: DoctorConfig, device: torch.device) -> list[dict[str, Any]]:
    """fp32 all-reduce time per size, algbw = bytes/time and busbw = algbw*2(n-1)/n, as nccl-tests reports."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rows = []
    for size in sweep_sizes(parse_bytes(cfg.max_bytes)):
        iters = 20 if device.type == "cuda" else max(3, min(20, CPU_BYTES_BUDGET // size))
        x = torch.zeros(size // 4, dtype=torch.float32, device=device)  # zeros: repeated sums never overflow
        for _ in range(max(1, iters // 4)):  # warm-up: connections, buffers, NCCL channels
            dist.all_reduce(x)
        sync()
        dist.barrier(**({"device_ids": [device.index]} if cfg.backend == "nccl" else {}))
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x)
        sync()
        seconds = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64, device=device)
        dist.all_reduce(seconds)  # summed here, averaged below: nccl-tests' default "-a 1"
        seconds = seconds.item() / cfg.world_size
        algbw = size / seconds / 1e9
        rows.append({"bytes": size, "count": size // 4, "iters": iters, "time_us": seconds * 1e6,
                     "algbw_gbs": algbw, "busbw_gbs": bus_bandwidth(algbw, cfg.world_size)})
    return rows
