"""The pack's seeding: one process's random streams (:func:`seed_all`), a rank's (:func:`seed_rank`: the
write-up's "seed + rank") and one sample's augmentation (:func:`sample_seed`)."""

from __future__ import annotations

import random

import numpy as np
import torch

# Mixing constants: distinct (epoch, index) pairs of one seed give distinct 64-bit seeds for any index
# below 2**31 (a 2-billion-sample epoch).
_INDEX_SPAN = 2**31 - 1
_EPOCH_SPAN = 1_000_003
_MASK64 = 2**64 - 1
_STEP_SPAN = 1_000_003  # separates the per-rank seeds of different resume steps


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The 64-bit seed of one sample's augmentation."""
    return ((seed * _EPOCH_SPAN + epoch) * _INDEX_SPAN + index) & _MASK64


def seed_all(value: int, devices: bool = False) -> None:
    """Seed python, numpy and torch's CPU generator with ``value`` (up to 64 bits): the pack's one per-process
    seeding. ``devices``: every accelerator's generator too (a rank's streams); a loader never draws there."""
    random.seed(value)
    np.random.seed([value & 0xFFFFFFFF, value >> 32])
    if devices:
        torch.manual_seed(value)  # also seeds every CUDA device
    else:
        # torch.manual_seed would also walk every accelerator (~160 us); the CPU generator alone takes ~2 us.
        torch.default_generator.manual_seed(value)


def seed_rank(seed: int, rank: int, step: int = 0) -> int:
    """Seed python, numpy and torch (all devices, :func:`seed_all`) with ``seed + rank`` (``+ step * 1000003``
    when resuming at another world size, so the streams are not the run's first ones again); returns the value."""
    value = (seed + rank + step * _STEP_SPAN) % 2**32
    seed_all(value, devices=True)
    return value


class RestoredRNG:
    """Save python/numpy/torch-CPU RNG state on enter, put it back on exit."""

    def __enter__(self) -> None:
        self.state = random.getstate(), np.random.get_state(), torch.get_rng_state()

    def __exit__(self, *exc: object) -> None:
        py, npy, tch = self.state
        random.setstate(py)
        np.random.set_state(npy)
        torch.set_rng_state(tch)
