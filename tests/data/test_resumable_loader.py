"""The resumable loader's in-process path over in-memory tensors: the same batches as torch's own
DataLoader over the same sampler, each a view of one per-epoch copy, and exact mid-epoch resume."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from ddp_recipes.data import samplers
from ddp_recipes.data.resumable import ResumableSampler, SeededDataset, resumable_loader
from ddp_recipes.data.samplers import TensorBatchDataset, keep_batch
from tests.launch import run

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


def test_the_epoch_copy_is_freed_when_its_epoch_ends():
    """The loader keeps its last iterator (its position is read from it) through validation, test and after
    fit; the epoch's copy, up to a rank's whole epoch, must not stay with it once its batches are gone."""
    import gc
    import weakref

    loader = resumable_loader(dataset(), BATCH, SEED, num_replicas=1, rank=0, collate_fn=keep_batch)
    loader.sampler.set_epoch(0)
    batches = list(loader)
    copy = weakref.ref(batches[0][0]._base)
    assert copy() is not None and loader.state_dict()["samples_seen"] == N
    del batches
    gc.collect()
    assert copy() is None, "the finished epoch's copy is still alive"
    assert loader.state_dict()["samples_seen"] == N  # the position is still there


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


def test_the_workers_end_when_the_loop_drops_the_persistent_iterator():
    """Lightning's development head (2026-07, PR #21708) ends a loop by deleting the loader's persistent iterator
    and leaving its workers to the iterator's ``__del__`` (2.6 shut them down itself): the loader must hold no
    reference that keeps them alive after ``fit``, and its position must stay readable for a checkpoint."""
    loader = resumable_loader(TensorBatchDataset(torch.arange(64.0)), BATCH, SEED, 1, 0, num_workers=1)
    loader.sampler.set_epoch(0)
    it = iter(loader)
    next(it), next(it)
    workers = list(it._workers)
    seen = loader.samples_seen()
    assert seen == 2 * BATCH and all(w.is_alive() for w in workers)
    del it
    del loader._iterator  # what Lightning's CombinedLoader.reset does at the end of fit
    loader._iterator = None
    for w in workers:
        w.join(timeout=30)
    assert not any(w.is_alive() for w in workers)
    assert loader.samples_seen() == seen and loader.state_dict()["samples_seen"] == seen


def test_the_workers_of_a_non_persistent_iterator_end_when_the_loop_drops_it():
    """A user's DataLoader(num_workers=2) is adopted with its persistent_workers=False: its iterator is no loader
    attribute, and its workers end when the last reference to it goes (the fit's loop at teardown, a run stopped
    mid-epoch by max_steps). The loader must not be that reference, and its position must stay readable."""
    from ddp_recipes.data.resumable import ResumableDataLoader, ResumableSampler, SeededDataset

    seeded = SeededDataset(TensorBatchDataset(torch.arange(64.0)), SEED)
    loader = ResumableDataLoader(seeded, batch_size=BATCH, num_workers=1, persistent_workers=False,
                                 sampler=ResumableSampler(seeded, num_replicas=1, rank=0, seed=SEED))
    loader.sampler.set_epoch(0)
    it = iter(loader)
    next(it), next(it)
    workers = list(it._workers)
    assert loader.samples_seen() == 2 * BATCH and all(w.is_alive() for w in workers)
    del it  # what the loop does at teardown
    for w in workers:
        w.join(timeout=30)
    assert not any(w.is_alive() for w in workers)
    assert loader.samples_seen() == 2 * BATCH and loader.state_dict()["samples_seen"] == 2 * BATCH


EXIT_SCRIPT = """
import torch
from ddp_recipes.data.resumable import resumable_loader
from ddp_recipes.data.samplers import TensorBatchDataset

loader = resumable_loader(TensorBatchDataset(torch.arange(64.0)), 8, 0, 1, 0, num_workers=1)
loader.sampler.set_epoch(0)
it = iter(loader)
next(it)


class Holder:
    pass


holder = Holder()
holder.self, holder.it = holder, it  # a reference cycle: freed by the GC only, after the exit handlers
del it
print("done", flush=True)
"""


def test_a_run_ends_while_its_sigterm_ignoring_workers_are_alive(tmp_path):
    """Persistent workers still alive at exit ignore multiprocessing's SIGTERM; the process must still exit
    (it used to hang in multiprocessing's join of its daemon children)."""
    script = tmp_path / "ends.py"
    script.write_text(EXIT_SCRIPT)
    proc = run([script], timeout=120, port=False, threads=None, quiet=None)
    assert proc.returncode == 0 and "done" in proc.stdout, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr


USER_PROCESS_SCRIPT = """
import multiprocessing
import signal
import sys
import time

import ddp_recipes.data.resumable  # noqa: F401  (the pack imported, no loader made)


def upload(ready, done_file):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the user's own choice: finish the upload whatever comes
    ready.set()
    time.sleep(2)
    open(done_file, "w").write("uploaded")


if __name__ == "__main__":
    ready = multiprocessing.Event()
    proc = multiprocessing.Process(target=upload, args=(ready, sys.argv[1]), daemon=True)
    proc.start()
    ready.wait()
    print("done", flush=True)
"""


def test_a_users_own_daemon_that_ignores_sigterm_is_left_to_finish(tmp_path):
    """The exit handler is for loader workers only: a script's own daemon process that ignores SIGTERM is
    joined by multiprocessing as before (importing the pack must not SIGKILL it mid-work)."""
    script, done = tmp_path / "user.py", tmp_path / "uploaded.txt"
    script.write_text(USER_PROCESS_SCRIPT)
    proc = run([script, done], timeout=120, port=False, threads=None, quiet=None)
    assert proc.returncode == 0 and "done" in proc.stdout, proc.stderr
    assert done.exists(), "the user's process was killed at exit"


def test_a_users_non_persistent_loader_leaves_no_worker_after_fit(tmp_path):
    """End to end: a plain DataLoader(num_workers=1) adopted as resumable (persistent_workers=False, as the user
    built it), the fit stopped mid-epoch by max_steps: no loader worker outlives ``fit``."""
    import gc
    import multiprocessing

    from torch.utils.data import DataLoader

    from ddp_recipes.data.resumable import ResumableDataLoader
    from ddp_recipes.train.trainer import build_trainer
    from tests.tiny_modules import tiny_module_and_data

    model, plain = tiny_module_and_data(samples=64, batch_size=4)
    loader = DataLoader(plain.dataset, batch_size=4, shuffle=True, num_workers=1)
    trainer = build_trainer(devices=1, accelerator="cpu", max_steps=3, logger=False, enable_progress_bar=False,
                            enable_model_summary=False, default_root_dir=str(tmp_path))
    before = set(multiprocessing.active_children())
    trainer.fit(model, loader)
    gc.collect()
    assert isinstance(trainer.train_dataloader, ResumableDataLoader) and not trainer.train_dataloader.persistent_workers
    assert set(multiprocessing.active_children()) <= before
