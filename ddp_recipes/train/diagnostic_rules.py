"""The decisions and wording behind DDPDiagnostics, as pure functions: what a batch, a gathered row of
per-rank numbers or a sampler says about the run (unit-tested without any process group)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import lightning as L
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, Sampler

_HEAD = 4  # leading batch elements in the fingerprint: cheap, and they pin down the first sample


def first_tensor(batch: Any) -> Tensor | None:
    """The first tensor of a batch (a tensor, or nested mappings / lists / tuples of them)."""
    if isinstance(batch, Tensor):
        return batch
    items = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, list | tuple) else ()
    for item in items:
        found = first_tensor(item)
        if found is not None:
            return found
    return None


def batch_size_of(batch: Any) -> int | None:
    """Samples in a batch: the first tensor's leading dimension, also inside mappings and lists (a dict's
    keys and a list of strings are not samples); None without one."""
    if isinstance(batch, list | tuple) and batch and isinstance(batch[0], Tensor) and batch[0].dim():
        return int(batch[0].shape[0])  # the common (x, y) case, without the tree walk each step
    t = first_tensor(batch)
    return int(t.shape[0]) if t is not None and t.dim() > 0 else None


def batch_fingerprint(batch: Any) -> Tensor:
    """[numel, sum, position-weighted sum of per-sample sums, first elements] in float64, on the batch's device.

    The weighted sum makes a reordering of the same samples another batch; without a tensor, all NaN (on
    CPU). Computed without a host read (a CUDA batch's fingerprint is read where it is compared, at the
    epoch end or in the first step's gather).
    """
    t = first_tensor(batch)
    if t is None or t.numel() == 0:
        return torch.full((3 + _HEAD,), math.nan, dtype=torch.float64)
    flat = t.detach().reshape(t.shape[0] if t.dim() else 1, -1)
    per_sample = flat.sum(dim=1, dtype=torch.float64)
    weighted = (per_sample * torch.arange(1, per_sample.numel() + 1, dtype=torch.float64, device=t.device)).sum()
    first = flat.reshape(-1)[:_HEAD].to(torch.float64)
    head = torch.nn.functional.pad(first, (0, _HEAD - first.numel()))
    numel = torch.full((1,), float(t.numel()), dtype=torch.float64, device=t.device)
    return torch.cat([numel, per_sample.sum().reshape(1), weighted.reshape(1), head])


def identical_ranks(rows: Tensor) -> list[int]:
    """Ranks whose row equals another rank's row exactly (rows with NaN never match)."""
    groups: dict[tuple[float, ...], list[int]] = {}
    for rank, row in enumerate(rows.tolist()):
        if not any(math.isnan(v) for v in row):
            groups.setdefault(tuple(row), []).append(rank)
    return sorted(rank for group in groups.values() if len(group) > 1 for rank in group)


def sampler_sharding(sampler: Sampler | None, expected: dict[str, Any] | None) -> float:
    """1.0: a DistributedSampler with the strategy's num_replicas and rank; -1.0: one with others; 0.0: other."""
    if not isinstance(sampler, DistributedSampler) or not expected:
        return 0.0
    return 1.0 if (sampler.num_replicas, sampler.rank) == (expected["num_replicas"], expected["rank"]) else -1.0


def unsharded_ranks(rows: Tensor) -> tuple[list[int], list[int]]:
    """(ranks with a mis-built sampler, ranks with another's first batch) from rows [fingerprint, sharding].
    If all ranks shard correctly, alike data (a constant synthetic set, model-parallel replicas) is fine."""
    wrong = [r for r in range(rows.shape[0]) if rows[r, -1] < 0]
    return wrong, ([] if bool((rows[:, -1] > 0).all()) else identical_ranks(rows[:, :-1]))


def shuffle_coincidence_chance(samples: int, batch: int) -> float:
    """Chance that two independent shuffles of ``samples`` items begin with the same ``batch`` items."""
    return math.prod(1.0 / (samples - k) for k in range(min(batch, samples)))


def parameter_checksum(module: nn.Module) -> tuple[float, float]:
    """(sum, squared norm) of all parameters in float64, without copying the weights. DDP keeps replicas
    bitwise equal, so their checksums are equal; the norm catches edits that keep the sum."""
    params = [p.detach() for p in module.parameters()]
    total = sum((p.sum(dtype=torch.float64) for p in params), torch.zeros((), dtype=torch.float64))
    square = sum((torch.linalg.vector_norm(p, dtype=torch.float64) ** 2 for p in params),
                 torch.zeros((), dtype=torch.float64))
    return float(total), float(square)


def params_drifted(checksums: Tensor, rtol: float = 1e-6) -> bool:
    """True when the per-rank parameter checksums (one row per rank) differ beyond ``rtol``."""
    spread = checksums.max(0).values - checksums.min(0).values
    return bool((spread > rtol * checksums.abs().max(0).values.clamp_min(1.0)).any())


def far_apart(values: Sequence[float], ratio: float, min_diff: float) -> bool:
    """Largest > ``ratio`` x and > ``min_diff`` above the smallest (NaN left out; no ratio for values <= 0)."""
    finite = [v for v in values if math.isfinite(v)]
    return (len(finite) > 1 and min(finite) > 0 and max(finite) > ratio * min(finite)
            and max(finite) - min(finite) > min_diff)


def loss_diverged(means: Sequence[float]) -> bool:
    """Per-rank mean training losses more than 3x and 0.5 apart."""
    return far_apart(means, 3.0, 0.5)


def memory_imbalance(peaks: Sequence[float]) -> bool:
    """Per-rank peak memory (bytes) more than 1.5x and 1 GiB apart."""
    return far_apart(peaks, 1.5, 2**30)


def train_sampler(trainer: L.Trainer) -> Sampler | None:
    """The sampler that orders the training data (a batch sampler's inner one first), if findable."""
    loader = trainer.train_dataloader
    if isinstance(loader, Mapping | Sequence):  # several loaders: the first one
        loader = next(iter(loader.values() if isinstance(loader, Mapping) else loader), None)
    if not isinstance(loader, DataLoader):
        return None
    inner = getattr(loader.batch_sampler, "sampler", None)
    return inner if isinstance(inner, DistributedSampler | RandomSampler) else loader.sampler


def sampler_shuffles(sampler: Sampler | None) -> bool:
    """True for a DistributedSampler with shuffle=True or a RandomSampler."""
    return isinstance(sampler, RandomSampler) or bool(isinstance(sampler, DistributedSampler) and sampler.shuffle)


def describe_sampler(sampler: Sampler | None) -> str:
    """'DistributedSampler(num_replicas=1, rank=0, shuffle=True)', or the sampler's class name."""
    if isinstance(sampler, DistributedSampler):
        return (f"{type(sampler).__name__}(num_replicas={sampler.num_replicas}, rank={sampler.rank}, "
                f"shuffle={sampler.shuffle})")
    return type(sampler).__name__ if sampler is not None else "unknown"


def name_ranks(ranks: Sequence[int], world_size: int) -> str:
    """'all 8 ranks' or 'rank(s) 0, 3' (the first 8 of a long list)."""
    return f"all {world_size} ranks" if len(ranks) == world_size else "rank(s) " + first_few(list(map(str, ranks)), 8)


def extremes(values: Sequence[float], fmt: str) -> str:
    """The lowest and the highest rank's value, NaN left out: 'rank 0: 1.5 ... rank 1: 15'."""
    ranked = sorted((v, r) for r, v in enumerate(values) if not math.isnan(v))
    (low, r_low), (high, r_high) = ranked[0], ranked[-1]
    return f"rank {r_low}: {low:{fmt}} ... rank {r_high}: {high:{fmt}}"


def first_few(names: Sequence[str], n: int) -> str:
    """'a, b and 3 more'."""
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


def gather_rows(trainer: L.Trainer, row: Tensor) -> Tensor:
    """Every rank's ``row`` stacked on CPU, shape (world size, len(row)). Must run on every rank."""
    row = row.to(trainer.strategy.root_device).contiguous()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        # The plain collective: Lightning's all_gather goes through a deprecated differentiable one.
        rows = [torch.empty_like(row) for _ in range(torch.distributed.get_world_size())]
        torch.distributed.all_gather(rows, row)
        return torch.stack(rows).cpu()
    return trainer.strategy.all_gather(row).reshape(-1, row.numel()).cpu()
