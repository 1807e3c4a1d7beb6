"""Every rank trains on as many batches per epoch: checked once per fit, before the first step."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn


def check_equal_batches(trainer: L.Trainer, world_size: int) -> None:
    """Fail on every rank, before the first step, when ranks have different numbers of training batches.

    The rank with more batches would wait forever (or --timeout-s) in a gradient all-reduce the others
    never start: the classic DDP hang (Lightning#9851). One gather of the counts, once per fit.
    """
    if trainer is None or world_size < 2:
        return
    counts: list[Any] = [None] * world_size
    torch.distributed.all_gather_object(counts, trainer.num_training_batches)
    if len(set(counts)) > 1:
        listed = ", ".join(f"rank {r}: {c}" for r, c in enumerate(counts))
        needed = (trainer.max_steps - trainer.global_step) * trainer.accumulate_grad_batches
        if trainer.max_steps != -1 and needed <= min(counts):
            rank_zero_warn(f"DDP: the ranks have different numbers of training batches per epoch ({listed}); "
                           f"--max-steps ends this run before the shortest epoch does, but a longer run would "
                           "hang: shard with a DistributedSampler")
            return
        raise RuntimeError(
            f"DDP: the ranks have different numbers of training batches per epoch ({listed}); the rank with "
            "more would wait forever in a gradient all-reduce the others never start. Shard with a "
            "DistributedSampler (Lightning inserts one unless use_distributed_sampler=False; it pads the "
            "shards to one length) or give every rank the same number of batches.")
