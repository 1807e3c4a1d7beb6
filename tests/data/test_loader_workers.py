"""Loader workers end with the process that started them, under every start method (a spawned rank included)."""

from __future__ import annotations

import multiprocessing
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

KEPT: list = []  # an iterator alive at exit, as persistent workers held by a reference cycle are


def _iterate_and_return() -> None:
    from ddp_recipes.data.adopt import WorkerInit

    loader = DataLoader(TensorDataset(torch.arange(64.0)), batch_size=4, num_workers=2,
                        worker_init_fn=WorkerInit(), persistent_workers=True)
    iterator = iter(loader)
    next(iterator)
    KEPT.append(iterator)


def test_a_spawned_process_with_live_workers_exits():
    """multiprocessing's own clean-up in a child it started terminates (SIGTERM, which the pack's workers ignore)
    and joins its daemon children before any exit handler runs: without the pack's finalizer the child never
    ends."""
    child = multiprocessing.get_context("spawn").Process(target=_iterate_and_return)
    child.start()
    child.join(timeout=120)
    alive = child.is_alive()
    if alive:
        child.kill()
        time.sleep(1)
    assert not alive and child.exitcode == 0, f"the spawned process did not end (exit code {child.exitcode})"


def _user_init(worker_id: int) -> None:
    torch.manual_seed(worker_id)


def test_an_evaluation_loader_the_pack_shards_gets_workers_that_end_with_the_rank(tmp_path, monkeypatch):
    """build_trainer re-creates a user's evaluation loader over an exact shard; its workers must leave preemption
    signals to the rank and die with it, as the training loader's do, and still run the user's own init."""
    from lightning.pytorch.trainer.states import RunningStage

    import ddp_recipes
    from ddp_recipes.data.adopt import WorkerInit
    from ddp_recipes.data.samplers import ExactDistributedSampler

    trainer = ddp_recipes.build_trainer(devices=1, accelerator="cpu", default_root_dir=str(tmp_path), logger=False)
    connector = trainer._data_connector.loader_hook  # the pack's adoption, where Lightning re-creates loaders
    monkeypatch.setattr(connector, "_world", lambda: (2, 0))  # rank 0 of 2, as in a launched rank
    loader = DataLoader(TensorDataset(torch.arange(10.0)), batch_size=2, num_workers=2, worker_init_fn=_user_init)
    sharded = connector._adopt_eval(loader, RunningStage.VALIDATING)
    assert isinstance(sharded.sampler, ExactDistributedSampler)
    assert isinstance(sharded.worker_init_fn, WorkerInit) and sharded.worker_init_fn.user is _user_init
