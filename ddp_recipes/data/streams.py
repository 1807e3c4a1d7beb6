"""Iterable training data under DDP: Lightning does not split an ``IterableDataset``, so unless its own
``__iter__`` splits by rank, every rank trains on the whole stream.

At the take-over every rank reads the stream's first samples under two fixed random states and the ranks compare
them. The same everywhere: :class:`RankShardedStream` splits it by position (a last partial group is dropped, as
unequal batch counts hang DDP). The same on every rank only: it shuffles from the global streams, so a warning
names the fix. Different per rank: it splits itself. docs/strategy-and-trainer.md has the warnings.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from ddp_recipes.data.seeding import RestoredRNG, sample_seed, seed_all

PEEK = 2  # samples read at take-over, twice
_STATES = (12345, 67890)  # the two fixed random states the first samples are read under


class RankShardedStream(IterableDataset):
    """``dataset`` split by position: rank ``rank`` of ``world`` keeps the ``rank``-th sample of every full
    group of ``world`` consecutive samples (module docstring). ``.dataset`` is the user's."""

    def __init__(self, dataset: IterableDataset, rank: int, world: int, seed: int) -> None:
        self.dataset, self.rank, self.world, self.seed = dataset, rank, world, seed
        self.epoch = 0  # bumped by the loader in the training process; a persistent worker counts its own
        self._iterations = 0

    def __len__(self) -> int:
        return len(self.dataset) // self.world  # type: ignore[arg-type]  (only when the stream has a length)

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        if info is not None:  # the worker's streams are its own: seed them alike on every rank
            seed_all(sample_seed(self.seed, self.epoch + self._iterations, info.id))
        self._iterations += 1
        held = None
        for position, item in enumerate(self.dataset):
            slot = position % self.world
            if slot == self.rank:
                held = item
            if slot == self.world - 1:
                yield held


class StreamLoader(DataLoader):
    """The user's loader over a :class:`RankShardedStream`: each iteration (an epoch) is numbered for the
    workers' seeds."""

    def __iter__(self):
        self.dataset.epoch += 1
        return super().__iter__()


def _leaves(item: Any) -> Iterator[bytes]:
    from torch.utils._pytree import tree_flatten

    for leaf in tree_flatten(item)[0]:
        if isinstance(leaf, torch.Tensor):
            tensor = leaf.detach().cpu().contiguous()
            yield f"{tensor.dtype}{tuple(tensor.shape)}".encode() + tensor.view(-1).view(torch.uint8).numpy().tobytes()
        else:
            yield repr(leaf).encode()


def first_samples(dataset: IterableDataset, state: int) -> str | None:
    """A digest of the stream's first :data:`PEEK` samples read from a fresh iterator under the random state
    ``state`` (this process's streams are left as they were); None when it yields none or fails."""
    digest = hashlib.sha256()
    with RestoredRNG():
        seed_all(state)
        try:
            iterator = iter(dataset)
            count = 0
            for _ in range(PEEK):
                for part in _leaves(next(iterator)):
                    digest.update(part)
                count += 1
        except StopIteration:
            pass
        except Exception:  # a stream that cannot be read twice, or not outside a worker: undecided
            return None
    return digest.hexdigest() if count else None


def classify(strategy: Any, dataset: IterableDataset) -> str:
    """"shard", "random", "split" or "unknown" for ``dataset`` (module docstring). Collective: every rank
    calls it at the same point (the training loader's take-over)."""
    mine = first_samples(dataset, _STATES[0])
    again = first_samples(dataset, _STATES[1]) if mine is not None else None
    theirs = strategy.broadcast(mine)
    if not strategy.reduce_boolean_decision(mine is not None, all=True):
        return "unknown"
    if not strategy.reduce_boolean_decision(mine == theirs, all=True):
        return "split"
    return "shard" if strategy.reduce_boolean_decision(mine == again, all=True) else "random"
