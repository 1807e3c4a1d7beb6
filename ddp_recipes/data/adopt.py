"""Exact resume and exact evaluation for a user's own DataLoader, where Lightning re-creates it.

Under DDP Lightning rebuilds each loader whose sampler is not a ``DistributedSampler``, to put one in
(``_DataConnector._prepare_dataloader``). That is the one place that sees the user's original loader
and knows what it is for, so the pack takes over there:

* **training**: a plain ``DataLoader`` over a map-style dataset with a ``RandomSampler``,
  ``SequentialSampler`` or plain ``DistributedSampler`` becomes a
  :class:`~ddp_recipes.data.resumable.ResumableDataLoader`: the same shuffle as Lightning's sampler (seed
  ``PL_GLOBAL_SEED``), a position Lightning saves and restores mid-epoch, and augmentation seeded per
  sample, so loader workers draw the same crops after a restart (any ``num_workers``). Loaders it cannot
  rebuild (DataLoader subclasses, custom samplers or batch samplers) keep Lightning's handling and get one
  warning naming the loader and what a resume will not reproduce. litdata's loader (split by rank, its position
  in the checkpoint) is kept once checked for this rank; other iterable datasets are split by position where that
  is safe, or named with the fix (:mod:`ddp_recipes.data.streams`).
* **evaluation**: a non-shuffled or shuffled sampler becomes an unpadded
  :class:`~ddp_recipes.data.samplers.ExactDistributedSampler` shard; a user's own padding sampler is
  kept, with a warning that says how many samples are scored twice. (Prediction is Lightning's already
  unpadded ``UnrepeatedDistributedSamplerWrapper``.)

The dataset the training loader holds is then a :class:`~ddp_recipes.data.resumable.SeededDataset`
wrapping the user's (``.dataset`` of it is theirs). A rebuilt loader pins memory on CUDA (:func:`pin_memory_for`).
"""

from __future__ import annotations

import os
from typing import Any

import lightning as L
import torch
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.data import has_iterable_dataset
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, SequentialSampler
from torch.utils.data.distributed import DistributedSampler

from ddp_recipes.data.litdata_lib import adopt_litdata_loader, is_litdata_loader
from ddp_recipes.data.loader_workers import kill_loader_workers_at_exit, loader_worker_init
from ddp_recipes.data.resumable import ResumableDataLoader, ResumableSampler, SeededDataset
from ddp_recipes.data.samplers import ExactDistributedSampler
from ddp_recipes.data.streams import RankShardedStream, StreamLoader, classify
from ddp_recipes.lightning_seam import reach
from ddp_recipes.lightning_seam.connectors import install_loader_hook
from ddp_recipes.lightning_seam.reach import is_distributed, update_dataloader, uses_distributed_sampler

_EVAL = (RunningStage.VALIDATING, RunningStage.TESTING, RunningStage.SANITY_CHECKING)


class WorkerInit:
    """worker_init_fn: leave preemption signals to the training process and end with it, then run the user's own."""

    def __init__(self, user: Any = None) -> None:
        self.user = user
        kill_loader_workers_at_exit()  # made in the training process, for loaders with workers

    def __call__(self, worker_id: int) -> None:
        loader_worker_init(worker_id)
        if self.user is not None:
            self.user(worker_id)


class _LoaderAdopter:
    """Where Lightning re-creates a loader, the pack's samplers (module docstring); ``default`` is Lightning's own."""

    def __init__(self, trainer: L.Trainer) -> None:
        self.trainer = trainer

    def __call__(self, dataloader: object, shuffle: bool, mode: RunningStage, default: Any) -> object:
        if mode == RunningStage.TRAINING:
            adopted = self._adopt_train(dataloader)
        elif mode in _EVAL:
            adopted = self._adopt_eval(dataloader, mode)
        else:
            adopted = None
        prepared = adopted if adopted is not None else default(dataloader, shuffle, mode)
        if adopted is not None and isinstance(dataloader, DataLoader):
            adopted.pin_memory = pin_memory_for(dataloader, self.trainer.strategy.root_device.type)
        if mode in _EVAL and isinstance(prepared, DataLoader) and prepared.generator is None:
            # Each evaluation iterator draws its base seed from the global torch RNG that training's dropout
            # uses, and Lightning's mid-epoch restart creates one for a validation it skips (sometimes one
            # the uninterrupted run never ran): the resumed run's random stream would shift by one draw.
            # A private generator keeps evaluation off the training streams.
            prepared.generator = torch.Generator().manual_seed(int(os.getenv("PL_GLOBAL_SEED", 0)))
        return prepared

    def _world(self) -> tuple[int, int]:
        kwargs = self.trainer.distributed_sampler_kwargs if is_distributed(self.trainer) else None
        return (kwargs["num_replicas"], kwargs["rank"]) if kwargs else (1, 0)

    def _all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order (``[obj]`` on one process). Collective."""
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return [obj]
        out: list[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(out, obj)
        return out

    def _warn(self, name: str, text: str) -> None:
        said = self.__dict__.setdefault("_pack_warned", set())
        if (name, text) not in said:  # once per loader and reason, however often loaders are reloaded
            said.add((name, text))
            rank_zero_warn(f"{name}: {text}")

    # ---- training -----------------------------------------------------------------------------------

    def _adopt_train(self, loader: object) -> DataLoader | None:
        name = "train_dataloader"
        not_exact = ("a resumed run will not continue exactly (the order after a mid-epoch restart and the "
                     "augmentation drawn in loader workers differ from an uninterrupted run)")
        if isinstance(loader, ResumableDataLoader):
            return None
        if not isinstance(loader, DataLoader):
            self._warn(name, f"a {type(loader).__name__}, not a DataLoader: {not_exact}")
            return None
        if is_litdata_loader(loader):  # it splits by rank and repositions itself (its state is in the checkpoint)
            adopt_litdata_loader(loader, *self._world(), seed=int(os.getenv("PL_GLOBAL_SEED", 0)),
                                 gather=self._all_gather)
            return None
        if has_iterable_dataset(loader):
            return self._adopt_stream(loader, name, not_exact)
        if type(loader) is not DataLoader:
            self._warn(name, f"a DataLoader subclass ({type(loader).__name__}) is left as it is: {not_exact}; "
                             "a plain DataLoader gets the resumable order and per-sample augmentation seeding")
            return None
        if type(loader.batch_sampler) is not BatchSampler:
            self._warn(name, f"its batch sampler ({type(loader.batch_sampler).__name__}) cannot be replaced: "
                             f"{not_exact}")
            return None
        sampler = loader.sampler
        world, rank = self._world()
        distributed = world > 1
        if type(sampler) is DistributedSampler:
            shuffle, seed, drop_last = sampler.shuffle, sampler.seed, sampler.drop_last
            world, rank = sampler.num_replicas, sampler.rank
        elif type(sampler) is SequentialSampler or (type(sampler) is RandomSampler and not sampler.replacement
                                                   and sampler._num_samples is None):
            if distributed and not uses_distributed_sampler(self.trainer):
                self._warn(name, f"use_distributed_sampler=False with a {type(sampler).__name__}: every rank "
                                 f"reads the whole dataset, and {not_exact}")
                return None
            # Under DDP Lightning always shuffles the training shard; one process keeps the loader's choice.
            shuffle = distributed or isinstance(sampler, RandomSampler)
            seed, drop_last = int(os.getenv("PL_GLOBAL_SEED", 0)), False
        else:
            self._warn(name, f"its sampler ({type(sampler).__name__}) cannot be replaced: {not_exact}")
            return None
        if self.trainer.overfit_batches:
            return None
        batch_size = loader.batch_size if loader.batch_size is not None else loader.batch_sampler.batch_size
        batch_drop = loader.drop_last if loader.batch_size is not None else loader.batch_sampler.drop_last
        seeded = SeededDataset(loader.dataset, seed)
        return _rebuilt(loader, seeded, seed, ResumableDataLoader, batch_size=batch_size, drop_last=batch_drop,
                        shuffle=None, sampler=ResumableSampler(seeded, num_replicas=world, rank=rank, seed=seed,
                                                               drop_last=drop_last, shuffle=shuffle))

    def _adopt_stream(self, loader: DataLoader, name: str, not_exact: str) -> DataLoader | None:
        """An iterable training loader: split by position where that is safe (:mod:`ddp_recipes.data.streams`),
        said once, naming the loader, at the take-over."""
        world, rank = self._world()
        stream = type(loader.dataset).__name__
        resume = f"it cannot be repositioned, so {not_exact}"
        if world < 2 or isinstance(loader.dataset, RankShardedStream):
            self._warn(name, f"an IterableDataset ({stream}): {resume}; use a map-style Dataset for an exact resume")
            return None
        found = classify(self.trainer.strategy, loader.dataset)
        split_it = (f"split it in {stream}.__iter__ by torch.distributed.get_rank() and get_world_size() (and by "
                    "torch.utils.data.get_worker_info() in loader workers), or use a map-style Dataset, which the "
                    "pack shards (and resumes exactly)")
        unsplit = (f"an IterableDataset ({stream}) is not split by Lightning, and each of the {world} ranks reads the "
                   f"whole stream: every sample would be trained {world} times per epoch")
        if found == "split":  # its __iter__ splits by rank
            self._warn(name, f"an IterableDataset ({stream}): {resume}; use a map-style Dataset for an exact resume")
            return None
        rebuildable = type(loader) is DataLoader and uses_distributed_sampler(self.trainer)
        if found == "shard" and rebuildable:
            seed = int(os.getenv("PL_GLOBAL_SEED", 0))
            self._warn(name, f"{unsplit}; its order depends on neither the rank nor the random state, so the pack "
                             f"splits it: rank r keeps samples r, r+{world}, r+{2 * world}, ... (a last group of fewer "
                             f"than {world} is dropped, so every rank has as many batches). Each rank still reads the "
                             f"whole stream: to read only its part, {split_it}. And {resume}")
            return _rebuilt(loader, RankShardedStream(loader.dataset, rank, world, seed), seed, StreamLoader)
        why = {"shard": "use_distributed_sampler=False leaves the split to you" if type(loader) is DataLoader
                        else f"the pack does not rebuild a DataLoader subclass ({type(loader).__name__})",
               "random": "its order depends on the random state (it shuffles), so the pack cannot split it by position",
               "unknown": "its first samples could not be read at the take-over, so the pack cannot tell"}[found]
        self._warn(name, f"{unsplit} unless its __iter__ splits by rank; {why}: {split_it}")
        return None

    # ---- evaluation ---------------------------------------------------------------------------------

    def _adopt_eval(self, loader: object, mode: RunningStage) -> DataLoader | None:
        world, rank = self._world()
        if world < 2 or not isinstance(loader, DataLoader) or has_iterable_dataset(loader):
            return None
        name = f"{mode.dataloader_prefix}_dataloader"
        sampler = loader.sampler
        if isinstance(sampler, ExactDistributedSampler):
            return None
        if isinstance(sampler, DistributedSampler):
            duplicated = 0 if sampler.drop_last else sampler.total_size - len(sampler.dataset)  # type: ignore[arg-type]
            if duplicated:
                self._warn(name, f"its DistributedSampler pads {len(sampler.dataset)} "  # type: ignore[arg-type]
                                 f"samples to {sampler.total_size}: {duplicated} sample(s) are scored twice and "
                                 "bias the metrics; use ddp_recipes.data.samplers.ExactDistributedSampler (or let "
                                 "Lightning shard a plain loader) for exact evaluation")
            return None
        if not uses_distributed_sampler(self.trainer):
            return None
        if type(sampler) in (SequentialSampler, RandomSampler) and type(loader.batch_sampler) is BatchSampler:
            # Order does not matter for a metric; every sample scored once does.
            sharded = update_dataloader(loader, ExactDistributedSampler(loader.dataset, num_replicas=world,
                                                                         rank=rank), mode=mode)
            if sharded.num_workers > 0 and not isinstance(sharded.worker_init_fn, WorkerInit):
                # Its workers end with the rank, as the training loader's do (set after the rebuild: Lightning
                # re-applies the user's own constructor arguments there).
                sharded.worker_init_fn = WorkerInit(sharded.worker_init_fn)
            return sharded
        length = len(sampler) if hasattr(sampler, "__len__") else 0  # type: ignore[arg-type]
        duplicated = -length % world
        if duplicated:
            self._warn(name, f"its {type(sampler).__name__} is sharded by Lightning's DistributedSamplerWrapper, "
                             f"which pads {length} samples to {length + duplicated}: {duplicated} sample(s) are "
                             "scored twice and bias the metrics")
        return None


def _rebuilt(loader: DataLoader, dataset: Any, seed: int, cls: type[DataLoader] = DataLoader, **kwargs: Any
             ) -> DataLoader:
    """``loader``'s settings over ``dataset`` (``kwargs`` replace some), with the pack's worker set-up and a
    private generator: the workers' base seed must not come from (and advance) the global RNG."""
    workers = loader.num_workers
    settings = dict(batch_size=loader.batch_size, drop_last=loader.drop_last, num_workers=workers,
                    collate_fn=loader.collate_fn, pin_memory=loader.pin_memory, timeout=loader.timeout,
                    worker_init_fn=WorkerInit(loader.worker_init_fn),
                    multiprocessing_context=loader.multiprocessing_context,
                    generator=torch.Generator().manual_seed(seed),
                    prefetch_factor=loader.prefetch_factor if workers > 0 else None,
                    persistent_workers=loader.persistent_workers, pin_memory_device=loader.pin_memory_device,
                    in_order=loader.in_order)
    return cls(dataset, **{**settings, **kwargs})


def pin_memory_for(loader: DataLoader, device_type: str) -> bool:
    """``pin_memory`` of the pack's rebuild of ``loader`` when training on ``device_type``: the user's when they
    passed it (Lightning records the arguments of a loader made in a ``*_dataloader`` hook), else True on CUDA,
    where a batch copied from pageable memory blocks the host, unless the dataset keeps its samples on a device
    (:func:`_on_a_device`): pinning a CUDA tensor raises ("only dense CPU tensors can be pinned")."""
    chosen = "pin_memory" in (reach.loader_args_given(loader) or ())
    if chosen or loader.pin_memory:
        return loader.pin_memory
    return device_type == "cuda" and not _on_a_device(loader.dataset)


def _on_a_device(dataset: Any, depth: int = 4) -> bool:
    """Whether ``dataset`` (or one it wraps: ``.dataset``, ``.datasets``) holds tensors off the host or names a
    device other than the CPU in a ``device`` attribute (the bench's ``RankShard``, a ``TensorDataset`` of CUDA
    tensors). Looks at attributes only: fetching a sample could draw random numbers or be slow."""
    values = list(vars(dataset).values()) if hasattr(dataset, "__dict__") else []
    for value in values:
        items = value[:8] if isinstance(value, list | tuple) else [value]  # a list of a million paths: its start
        if any(isinstance(t, torch.Tensor) and t.device.type != "cpu" for t in items):
            return True
    device = getattr(dataset, "device", None)
    if isinstance(device, str | torch.device) and torch.device(device).type != "cpu":
        return True
    if depth == 0:
        return False
    inner = [getattr(dataset, "dataset", None), *(getattr(dataset, "datasets", None) or [])]
    return any(_on_a_device(d, depth - 1) for d in inner if d is not None and d is not dataset)


def adopt_user_loaders(trainer: L.Trainer) -> None:
    """Route the loaders ``trainer`` re-creates through the pack's adoption (module docstring)."""
    install_loader_hook(trainer, _LoaderAdopter(trainer))
