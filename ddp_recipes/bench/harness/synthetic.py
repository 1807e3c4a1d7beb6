"""The bench's synthetic data: each rank holds only its own share, already on its device.

The sampler still sees the *global* dataset (pack: Lightning's DistributedSampler; raw: the write-up's),
so every path shards, shuffles and batches exactly as on real data. But a rank materialises only
``ceil(global / world)`` samples, its own (seeded with the rank), and the sampler's global indices are
folded onto them. No rank builds the global set: at 224 px and 4 GPUs it is ~8 GB, and on an 8-GPU node
every rank holding it would take more than 128 GB of host memory. The samples live on the rank's device
(CUDA) so no step copies a batch from pageable host memory: the bench measures the model and DDP, not the
H2D copy (``bench loader`` measures the input pipeline). Only the batch's indices cross to the device, from
pinned memory without blocking: a pageable copy synchronises the host with the GPU at every step, which is
what ``gpu-check``'s sync-debug check looks for in the pack.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.utils.data import Dataset


def shard_size(global_len: int, world_size: int) -> int:
    """Samples one rank holds of a global set of ``global_len`` (DistributedSampler's per-rank count)."""
    return math.ceil(global_len / world_size)


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class RankShard(Dataset):
    """A synthetic (images, labels) set of ``global_len`` samples of which this process holds its rank's.

    Materialised at the first fetch, when the process group is up and the rank's device is current (the
    pack builds its dataset before Lightning starts the ranks); :meth:`materialize` does it explicitly.
    Fetching is batched (``__getitems__``, for :func:`~ddp_recipes.data.samplers.keep_batch`).
    """

    #: Fetching only indexes fixed tensors: the resumable loader then neither seeds nor saves RNG state per
    #: batch, as the raw loop does not (read by :func:`ddp_recipes.data.resumable.draws_random_numbers`).
    draws_random_numbers = False

    def __init__(self, global_len: int, shape: Sequence[int], seed: int, device: str = "cpu",
                 num_classes: int = 10) -> None:
        self.global_len, self.shape, self.seed = global_len, tuple(shape), seed
        self.device, self.num_classes = device, num_classes
        self.tensors: tuple[torch.Tensor, torch.Tensor] | None = None
        self.rank = self.world_size = None

    def __len__(self) -> int:
        return self.global_len

    def materialize(self, rank: int | None = None, world_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Build this rank's samples (default: the rank and world of the process group, else 0 of 1)."""
        if rank is None or world_size is None:
            rank, world_size = _rank_world()
        n = shard_size(self.global_len, world_size)
        g = torch.Generator().manual_seed(self.seed * 100_003 + rank)  # ranks draw different samples
        x, y = torch.randn(n, *self.shape, generator=g), torch.randint(0, self.num_classes, (n,), generator=g)
        device = (torch.device("cuda", torch.cuda.current_device()) if self.device == "cuda"
                  else torch.device(self.device))
        self.tensors, self.rank, self.world_size = (x.to(device), y.to(device)), rank, world_size
        return self.tensors

    def nbytes(self) -> int:
        """Bytes this rank holds (0 before it is materialised)."""
        return sum(t.numel() * t.element_size() for t in self.tensors) if self.tensors else 0

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.tensors or self.materialize()
        # The sampler's global indices, folded onto this rank's samples: any index is a valid sample.
        index = torch.as_tensor(indices, dtype=torch.long) % len(x)
        if x.device.type == "cuda":
            index = index.pin_memory()  # a pageable host->device copy would block on the GPU every step
        index = index.to(x.device, non_blocking=True)
        return x[index], y[index]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.__getitems__([i])
        return x[0], y[0]
