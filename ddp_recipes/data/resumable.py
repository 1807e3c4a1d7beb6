"""A training loader that stops at any batch and continues exactly, with loader workers and augmentation.

What the rest of a run sees is made a function of the run's seed and position, not of a process's history
(docs/resume-and-preemption.md): :class:`ResumableSampler` is Lightning's ``DistributedSampler`` order that
starts part-way through an epoch (its position, the samples all ranks consumed, is a prefix of the epoch's
permutation, so it carries over to another world size); :class:`SeededDataset` seeds python/numpy/torch from
``(seed, epoch, index)`` before each sample (the epoch rides inside the index, :class:`SampleKey`); the main
process's streams are left alone (workers' base seed from a private generator; with ``num_workers=0`` the
seeding runs inside a saved-and-restored RNG state). :class:`ResumableDataLoader` is Lightning-``Stateful``: the
epoch and the samples consumed, counted from the batches handed to the loop, not those prefetched.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset, get_worker_info
from torch.utils.data.dataloader import _SingleProcessDataLoaderIter
from torch.utils.data.distributed import DistributedSampler

from ddp_recipes.data.loader_workers import kill_loader_workers_at_exit, loader_worker_init
from ddp_recipes.data.seeding import RestoredRNG, sample_seed, seed_all
from ddp_recipes.errors import CheckpointError


class SampleKey(int):
    """A dataset index that also carries its epoch; an ``int`` everywhere else (indexing, comparisons)."""

    epoch: int

    def __new__(cls, index: int, epoch: int) -> SampleKey:
        key = super().__new__(cls, index)
        key.epoch = epoch
        return key

    def __reduce__(self) -> tuple[Any, tuple[int, int]]:  # worker processes receive indices by pickle
        return SampleKey, (int(self), self.epoch)


def draws_random_numbers(dataset: Dataset) -> bool:
    """Whether fetching from ``dataset`` may draw random numbers (augmentation), so needs per-sample seeds.

    False for a plain ``TensorDataset`` (indexing in-memory tensors draws nothing) and for a dataset whose
    ``draws_random_numbers`` attribute says so (:class:`~ddp_recipes.data.samplers.TensorBatchDataset`);
    True otherwise, subclasses of ``TensorDataset`` included (they may add a random transform). Seeding
    costs about a third of an MNIST-MLP step (python, numpy and torch RNG states saved and restored per
    batch), so it is skipped where it cannot change a batch.
    """
    declared = getattr(dataset, "draws_random_numbers", None)
    if isinstance(declared, bool):
        return declared
    return type(dataset) is not TensorDataset


class SeededDataset(Dataset):
    """``dataset`` whose samples are drawn under a seed of ``(seed, epoch, index)``.

    Indices without an epoch (plain ints, e.g. from a user's sampler) are passed through unseeded. In a
    worker process the seeding simply replaces the worker's stream; in the main process
    (``num_workers=0``) the training loop's stream is saved and restored around it.
    """

    def __init__(self, dataset: Dataset, seed: int) -> None:
        self.dataset = dataset
        self.seed = seed
        # Read by ResumableSampler: without randomness to seed, its indices need not carry the epoch.
        self.draws_random_numbers = draws_random_numbers(dataset)

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def _seeded(self, key: Any, fetch):
        epoch = getattr(key, "epoch", None)
        if epoch is None:
            return fetch()
        if get_worker_info() is not None:
            seed_all(sample_seed(self.seed, epoch, int(key)))
            return fetch()
        with RestoredRNG():
            seed_all(sample_seed(self.seed, epoch, int(key)))
            return fetch()

    def __getitem__(self, key: Any) -> Any:
        if not self.draws_random_numbers:
            return self.dataset[key]
        return self._seeded(key, lambda: self.dataset[int(key)])

    def __getitems__(self, keys: list[Any]) -> Any:
        many = getattr(self.dataset, "__getitems__", None)
        if not self.draws_random_numbers:  # plain int keys (see ResumableSampler): straight through
            return many(keys) if many is not None else [self.dataset[k] for k in keys]
        # Datasets that fetch whole batches at once (in-memory tensors) get one seed per batch, from its
        # first sample: the same batches at the same world size and batch size draw the same numbers.
        plain = [int(k) for k in keys]
        if many is None:
            return [self[k] for k in keys]
        return self._seeded(keys[0], lambda: many(plain)) if keys else many(plain)


class ResumableSampler(DistributedSampler):
    """``DistributedSampler`` (shuffled by seed + epoch) that can begin an epoch after its first samples.

    :meth:`resume_at` names an epoch and how many samples of it all ranks together have consumed: that
    prefix of the epoch's permutation is skipped, the rest is padded and sharded as the parent does.
    At the same world size this is exactly the rest of every rank's shard; at another one, the rest of
    the epoch re-sharded. ``__len__`` stays the full shard, as Lightning counts batches from there.
    Yields :class:`SampleKey` indices (plain ints that also carry the epoch), or plain ints when the
    dataset draws no random numbers (``draws_random_numbers`` False: nothing to seed, and a key object
    per sample would cost ~2.5 us each at every epoch start).
    """

    def __init__(self, dataset: Sized, num_replicas: int, rank: int, seed: int = 0, drop_last: bool = False,
                 shuffle: bool = True) -> None:
        # shuffle=False: a one-process run of a user's SequentialSampler loader keeps its order.
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed,
                         drop_last=drop_last)
        self._resume: tuple[int, int] | None = None
        self.started_at = 0  # samples (all ranks) that the latest iteration skipped

    def resume_at(self, epoch: int, samples_seen: int) -> None:
        """Start ``epoch`` (when it comes) after its first ``samples_seen`` samples over all ranks."""
        self._resume = (int(epoch), max(0, int(samples_seen)))

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        if self._resume is not None and self._resume[0] != epoch:
            self._resume = None  # the resumed epoch is over: a later re-iteration starts at its beginning

    def epoch_order(self) -> list[int]:
        """The whole epoch's permutation (unpadded), identical on every rank and at every world size."""
        if not self.shuffle:
            return list(range(len(self.dataset)))  # type: ignore[arg-type]
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        return torch.randperm(len(self.dataset), generator=g).tolist()  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[int]:
        order = self.epoch_order()
        skip = self._resume[1] if self._resume is not None and self._resume[0] == self.epoch else 0
        skip = min(skip, len(order))
        self.started_at = skip
        if self.drop_last:
            rest = order[skip:self.total_size]
        else:
            rest = order[skip:]
            pad = -len(rest) % self.num_replicas
            if pad and order:
                # The parent pads with the permutation's head: same rule, so a same-world resume matches.
                rest += (order * math.ceil(pad / len(order)))[:pad]
        shard = rest[self.rank::self.num_replicas]
        if not getattr(self.dataset, "draws_random_numbers", True):
            return iter(shard)
        return iter([SampleKey(i, self.epoch) for i in shard])


class ResumableDataLoader(DataLoader):
    """A DataLoader over a :class:`ResumableSampler` whose position Lightning saves and restores.

    ``state_dict()`` is ``{"epoch", "samples_seen", ...}``: samples consumed over all ranks, counted from
    the batches this loader's live iterator has yielded (prefetched batches do not count).
    ``load_state_dict`` is idempotent and only positions the sampler; the iterator built next starts
    there (:meth:`needs_fresh_iterator` says whether the live one predates it).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(self.sampler, ResumableSampler):
            raise TypeError("ResumableDataLoader needs a ResumableSampler")
        self._live: Any = None
        self._live_started_at = 0
        self._loaded_version = 0  # bumped by load_state_dict
        self._live_version = -1   # the version the live iterator was built at

    def _get_iterator(self):
        if self.num_workers == 0 and _fetches_index_tensors(self.dataset) and self.batch_size:
            return _IndexTensorIter(self)
        return super()._get_iterator()

    def __iter__(self):
        it = super().__iter__()
        self._live = _Yielded(it)
        self._live_version = self._loaded_version
        return it

    def samples_seen(self) -> int:
        """Samples of the current epoch consumed over all ranks (skipped + yielded)."""
        sampler: ResumableSampler = self.sampler  # type: ignore[assignment]
        yielded = getattr(self._live, "_num_yielded", 0) if self._live is not None else 0
        per_batch = (self.batch_size or 1) * sampler.num_replicas
        return min(len(sampler.dataset), sampler.started_at + yielded * per_batch)  # type: ignore[arg-type]

    def state_dict(self) -> dict[str, Any]:
        sampler: ResumableSampler = self.sampler  # type: ignore[assignment]
        return {"epoch": sampler.epoch, "samples_seen": self.samples_seen(), "num_replicas": sampler.num_replicas,
                "seed": sampler.seed, "dataset_len": len(sampler.dataset)}  # type: ignore[arg-type]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        sampler: ResumableSampler = self.sampler  # type: ignore[assignment]
        if (state.get("seed") != sampler.seed
                or state.get("dataset_len") != len(sampler.dataset)):  # type: ignore[arg-type]
            raise CheckpointError(f"{{resume}}: the checkpoint's training data (seed {state.get('seed')}, "
                             f"{state.get('dataset_len')} samples) is not this run's (seed {sampler.seed}, "
                             f"{len(sampler.dataset)} samples); pass the same "  # type: ignore[arg-type]
                             "{seed} and data")
        sampler.resume_at(state["epoch"], state["samples_seen"])
        self._loaded_version += 1

    def needs_fresh_iterator(self) -> bool:
        """True when the live iterator was built before the latest :meth:`load_state_dict`."""
        return self._live_version != self._loaded_version


class _Yielded:
    """How many batches an iterator has handed out, readable after it is gone. It holds the iterator's attributes,
    not the iterator: when the loop drops it (Lightning's loader reset at a loop's teardown, persistent or not), the
    iterator's ``__del__`` still ends its workers; a reference to the iterator here would keep them alive."""

    def __init__(self, iterator: Any) -> None:
        self._attrs = vars(iterator)

    @property
    def _num_yielded(self) -> int:
        return self._attrs.get("_num_yielded", 0)


def _fetches_index_tensors(dataset: Any) -> bool:
    """A :class:`SeededDataset` with nothing to seed over a dataset whose ``__getitems__`` takes a LongTensor
    of indices (``fetches_index_tensors``, e.g. :class:`~ddp_recipes.data.samplers.TensorBatchDataset`)."""
    return (isinstance(dataset, SeededDataset) and not dataset.draws_random_numbers
            and getattr(dataset.dataset, "fetches_index_tensors", False) is True)


class _IndexTensorIter(_SingleProcessDataLoaderIter):
    """The in-process iterator over in-memory tensors: the epoch's shard becomes one index tensor at the first
    batch (the sampler's order, drawn when the default iterator would draw it). The same batches as the
    default path, without its per-sample Python (the batch sampler's loop over 64 ints and their
    list-to-tensor conversion per batch: a quarter of an MNIST-MLP step's input wait).

    Where the dataset can (``gather_epoch``: a plain tensor gather, under a memory cap), the epoch's rows
    are also copied once, in order, at that first batch, and each batch is a view of that copy: the same
    bytes as a gather per batch, in one pass, so a step's fetch is a slice (about 20 us less per 64-image
    batch on this loop). The dataset's own tensors are never handed out, so a step that edits its batch in
    place changes nothing another batch or epoch sees. Otherwise each batch is ``__getitems__`` of its slice.
    """

    def __init__(self, loader: ResumableDataLoader) -> None:
        super().__init__(loader)
        self._order: torch.Tensor | None = None
        self._epoch: tuple[torch.Tensor, ...] | None = None
        self._at = 0
        self._batch = int(loader.batch_size)  # type: ignore[arg-type]

    def _reset(self, loader: DataLoader, first_iter: bool = False) -> None:
        super()._reset(loader, first_iter)
        self._order, self._epoch, self._at = None, None, 0

    def __next__(self) -> Any:
        if torch.autograd.profiler._is_profiler_enabled:
            return super().__next__()
        # torch's __next__ without its record_function: a label only a running torch profiler reads, and at
        # ~6 us a batch half of this iterator's cost. (Map-style data: its IterableDataset check never applies.)
        if self._sampler_iter is None:
            self._reset()
        data = self._next_data()
        self._num_yielded += 1
        return data

    def _next_data(self) -> Any:
        order = self._order
        if order is None:
            # iter() of the sampler, as the batch sampler's first step would: sets its resume position.
            order = self._order = torch.as_tensor(list(self._index_sampler.sampler), dtype=torch.long)
            gather = getattr(self._dataset.dataset, "gather_epoch", None)
            self._epoch = gather(order) if gather is not None else None
        start, end = self._at, self._at + self._batch
        if start >= len(order) or (self._drop_last and end > len(order)):
            # The epoch's copy goes with its last batch: the loader keeps its last iterator (for its position)
            # through validation, test and after fit, and the copy is up to EPOCH_GATHER_MAX_BYTES.
            self._epoch = None
            raise StopIteration
        self._at = end
        if self._epoch is not None:
            data = self._collate_fn(tuple(t[start:end] for t in self._epoch))
        else:
            data = self._collate_fn(self._dataset.__getitems__(order[start:end]))
        if self._pin_memory:
            data = torch.utils.data._utils.pin_memory.pin_memory(data, self._pin_memory_device)
        return data


def resumable_loader(dataset: Dataset, batch_size: int, seed: int, num_replicas: int, rank: int,
                     num_workers: int = 0, pin_memory: bool = False, collate_fn: Any = None,
                     **kwargs: Any) -> ResumableDataLoader:
    """A :class:`ResumableDataLoader` over ``SeededDataset(dataset, seed)`` for this rank."""
    seeded = SeededDataset(dataset, seed)
    sampler = ResumableSampler(seeded, num_replicas=num_replicas, rank=rank, seed=seed)
    kwargs.setdefault("worker_init_fn", loader_worker_init)
    if num_workers > 0:
        kill_loader_workers_at_exit()
    return ResumableDataLoader(seeded, batch_size=batch_size, sampler=sampler, num_workers=num_workers,
                               pin_memory=pin_memory, persistent_workers=num_workers > 0, collate_fn=collate_fn,
                               generator=torch.Generator().manual_seed(seed), **kwargs)
