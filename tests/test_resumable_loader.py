"""The resumable loader's in-process path over in-memory tensors: the same batches as torch's own
DataLoader over the same sampler, each a view of one per-epoch copy, and exact mid-epoch resume."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from ddp_recipes.data import samplers
from ddp_recipes.data.resumable import ResumableSampler, SeededDataset, resumable_loader
from ddp_recipes.data.samplers import TensorBatchDataset, keep_batch

N, BATCH, SEED = 50, 8, 3


def dataset() -> TensorBatchDataset:
    g = torch.Generator().manual_seed(0)
    return TensorBatchDataset(torch.randn(N, 1, 4, 4, generator=g), torch.arange(N))


def reference_batches(data: TensorBatchDataset, epoch: int, rank: int, world: int) -> list[tuple]:
    """torch's own DataLoader over the same sampler: a batch sampler over ints, one gather per batch."""
    sampler = ResumableSampler(SeededDataset(data, SEED), num_replicas=world, rank=rank, seed=SEED)
    sampler.set_epoch(epoch)
    return list(DataLoader(data, batch_size=BATCH, sampler=sampler, collate_fn=keep_batch))


def epoch_batches(loader, epoch: int) -> list[tuple]:
    loader.sampler.set_epoch(epoch)
    return list(loader)


def assert_same(batches: list[tuple], expected: list[tuple]) -> None:
    assert len(batches) == len(expected)
    for got, want in zip(batches, expected, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("rank,world", [(0, 1), (0, 2), (1, 2)])
def test_batches_are_torchs_and_views_of_one_epoch_copy(rank, world):
    data = dataset()
    loader = resumable_loader(data, BATCH, SEED, num_replicas=world, rank=rank, collate_fn=keep_batch)
    for epoch in (0, 1):
        batches = epoch_batches(loader, epoch)
        assert_same(batches, reference_batches(data, epoch, rank, world))
        # No copy per step: every batch of the epoch lies in one storage, and it is not the dataset's.
        storages = {b[0].untyped_storage().data_ptr() for b in batches}
        assert len(storages) == 1 and storages != {data.tensors[0].untyped_storage().data_ptr()}


def test_a_step_editing_its_batch_changes_nothing_else():
    data = dataset()
    before = data.tensors[0].clone()
    loader = resumable_loader(data, BATCH, SEED, num_replicas=1, rank=0, collate_fn=keep_batch)
    loader.sampler.set_epoch(0)
    seen = []
    for x, y in loader:
        seen.append((x.clone(), y.clone()))
        x.mul_(0)  # a training step normalising in place
    assert torch.equal(data.tensors[0], before)
    assert_same(seen, reference_batches(data, 0, 0, 1))
    assert_same(epoch_batches(loader, 1), reference_batches(data, 1, 0, 1))


def test_over_the_memory_cap_each_batch_is_gathered_alone(monkeypatch):
    monkeypatch.setattr(samplers, "EPOCH_GATHER_MAX_BYTES", 100)
    data = dataset()
    batches = epoch_batches(resumable_loader(data, BATCH, SEED, num_replicas=2, rank=1, collate_fn=keep_batch), 0)
    assert_same(batches, reference_batches(data, 0, 1, 2))
    assert len({b[0].untyped_storage().data_ptr() for b in batches}) == len(batches)


def test_a_subclass_with_its_own_fetch_keeps_it():
    class Doubled(TensorBatchDataset):
        draws_random_numbers = False

        def __getitems__(self, indices):
            x, y = super().__getitems__(indices)
            return x * 2, y

    data = Doubled(*dataset().tensors)
    batches = epoch_batches(resumable_loader(data, BATCH, SEED, num_replicas=1, rank=0, collate_fn=keep_batch), 0)
    assert_same(batches, [(x * 2, y) for x, y in reference_batches(dataset(), 0, 0, 1)])


@pytest.mark.parametrize("world", [1, 2])
def test_mid_epoch_resume_yields_the_rest_of_the_epoch(world):
    data = dataset()
    straight = [epoch_batches(resumable_loader(data, BATCH, SEED, world, r, collate_fn=keep_batch), 1)
                for r in range(world)]
    first = resumable_loader(data, BATCH, SEED, world, 0, collate_fn=keep_batch)
    first.sampler.set_epoch(1)
    it = iter(first)
    next(it), next(it)
    state = first.state_dict()
    assert state["samples_seen"] == 2 * BATCH * world
    for rank in range(world):
        resumed = resumable_loader(data, BATCH, SEED, world, rank, collate_fn=keep_batch)
        resumed.load_state_dict(state)
        assert_same(epoch_batches(resumed, 1), straight[rank][2:])
