"""Exact evaluation under DDP: every sample is scored once, on exactly one rank.

Lightning's auto-inserted ``DistributedSampler`` pads the evaluation set with duplicates, which bias the metric
against a 1-device run. Here each rank takes a strided unpadded shard; torchmetrics sums its states across ranks,
so unequal shards are fine. The sampler *is a* ``DistributedSampler`` because Lightning 2.6 leaves only those
alone: any other sampler is wrapped in a ``DistributedSamplerWrapper``, which would shard (and pad) it again.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from ddp_recipes.data.loader_workers import kill_loader_workers_at_exit, loader_worker_init
from ddp_recipes.data.resumable import resumable_loader


def _world() -> tuple[int, int]:
    """(world size, rank) of the default process group, or (1, 0) when there is none."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


class ExactDistributedSampler(DistributedSampler):
    """Rank ``r`` of ``W`` yields indices ``r, r+W, r+2W, ...`` of ``range(len(dataset))``, unpadded, in a
    fixed order (``set_epoch`` has no effect)."""

    def __init__(self, dataset: Sized, num_replicas: int | None = None, rank: int | None = None) -> None:
        world, own_rank = _world()
        num_replicas = world if num_replicas is None else num_replicas
        rank = own_rank if rank is None else rank
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1 (got {num_replicas})")
        # The parent checks 0 <= rank < num_replicas; its padded sizes are overwritten below.
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=False, drop_last=False)
        self.total_size = len(dataset)
        self.num_samples = len(range(rank, self.total_size, num_replicas))

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, self.total_size, self.num_replicas))

    def __len__(self) -> int:
        return self.num_samples


def exact_eval_loader(dataset: Dataset, batch_size: int, num_workers: int = 0,
                      pin_memory: bool = False) -> DataLoader:
    """An evaluation DataLoader: sharded without padding under DDP (world > 1), sequential otherwise. Call it
    when the process group is up, so the shard matches this rank."""
    world, _ = _world()
    sampler = ExactDistributedSampler(dataset) if world > 1 else None
    if num_workers > 0:
        kill_loader_workers_at_exit()
    # A private generator: building the iterator must not draw from the global RNG that training's
    # dropout uses, or a resumed run (whose eval workers start anew) would drift from an uninterrupted one.
    return DataLoader(dataset, batch_size=batch_size, shuffle=False, sampler=sampler, num_workers=num_workers,
                      pin_memory=pin_memory, persistent_workers=num_workers > 0, drop_last=False,
                      collate_fn=_collate(dataset), generator=torch.Generator(),
                      worker_init_fn=loader_worker_init)


def resumable_train_loader(dataset: Dataset, batch_size: int, seed: int, num_workers: int = 0,
                           pin_memory: bool = False, **kwargs) -> DataLoader:
    """A shuffled training DataLoader that can stop at any batch and continue exactly.

    Its order depends only on (seed, epoch) and its shards on (rank, world size): the DistributedSampler
    Lightning would insert under DDP, used at every world size (a RandomSampler draws from the global RNG).
    Augmentation is seeded per sample and the position is ``Stateful`` (:mod:`ddp_recipes.data.resumable`).
    Build it when the process group is up.
    """
    world, rank = _world()
    return resumable_loader(dataset, batch_size, seed, num_replicas=world, rank=rank, num_workers=num_workers,
                            pin_memory=pin_memory, collate_fn=_collate(dataset), **kwargs)


# One more copy of a rank's epoch in memory, at most (MNIST's 60k float images are 188 MB): above it, the
# saved copy per step is not worth the memory.
EPOCH_GATHER_MAX_BYTES = 1 << 30


class TensorBatchDataset(TensorDataset):
    """A TensorDataset that hands the DataLoader whole batches (``__getitems__``, then :func:`keep_batch`): the
    default per-sample indexing and re-stacking costs as much as the model's step on MNIST."""

    #: ``__getitems__`` takes a LongTensor of indices too (the resumable loader's in-process fast path).
    fetches_index_tensors = True

    @property
    def draws_random_numbers(self) -> bool:
        """Whether a fetch may draw random numbers (read by the resumable loader, which then seeds it): not
        for this class; a subclass may override ``__getitem__``/``__getitems__`` with a random transform."""
        cls = type(self)
        return not (cls.__getitem__ is TensorDataset.__getitem__
                    and cls.__getitems__ is TensorBatchDataset.__getitems__)

    def gather_epoch(self, order: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        """This rank's whole epoch, rows in ``order``, one copy per tensor, so each batch is a view of it. None
        for a subclass's own fetch or a copy over :data:`EPOCH_GATHER_MAX_BYTES`."""
        if type(self).__getitems__ is not TensorBatchDataset.__getitems__ or self.draws_random_numbers:
            return None
        row_bytes = sum(t[0].numel() * t.element_size() for t in self.tensors if len(t))
        if row_bytes * len(order) > EPOCH_GATHER_MAX_BYTES:
            return None
        return self.__getitems__(order)

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, ...]:
        index = torch.as_tensor(indices, dtype=torch.long)
        # index_select, not t[index]: the same rows, but advanced indexing takes 3-5x longer on an image
        # batch (a strided gather kernel instead of one row copy per index).
        return tuple(torch.index_select(t, 0, index) for t in self.tensors)


def keep_batch(batch):
    """collate_fn for :class:`TensorBatchDataset` (module-level so worker processes can pickle it)."""
    return batch


def _collate(dataset: Dataset):
    """The loader's ``collate_fn``: :func:`keep_batch` for whole batches, a dataset's own ``collate`` method
    (e.g. :class:`~ddp_recipes.data.encoded.EncodedImageFolder`'s), else the default."""
    if isinstance(dataset, TensorBatchDataset):
        return keep_batch
    own = getattr(dataset, "collate", None)
    return own if callable(own) else None


def loader_batch_size(loader: object) -> int | None:
    """Samples per batch of a DataLoader: its batch sampler's ``batch_size`` when it has one (Lightning
    re-creates a user's ``batch_sampler=`` loader for DDP with ``DataLoader.batch_size`` = 1), else the
    loader's own; None when neither says (a custom batch sampler)."""
    sampler_batch = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
    if isinstance(sampler_batch, int):
        return sampler_batch
    batch = getattr(loader, "batch_size", None)
    return batch if isinstance(batch, int) else None
