"""MNISTDataModule and ExactDistributedSampler on the shared mini-MNIST (8,000 train / 2,000 test)."""

from __future__ import annotations

import shutil
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from lightning import Trainer
from lightning.pytorch.trainer.states import RunningStage
from torch.utils.data import DataLoader, SequentialSampler, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from ddp_recipes.data import samplers
from ddp_recipes.data.mnist import MNISTDataModule
from ddp_recipes.data.samplers import ExactDistributedSampler, exact_eval_loader
from tests.helpers import cli_text, raises_cli


def _module(data_dir: Path, **kwargs) -> MNISTDataModule:
    dm = MNISTDataModule(data_dir=data_dir, download=False, **kwargs)
    dm.prepare_data()
    dm.setup("fit")
    return dm


def test_loads_normalized_tensors(mnist_dir):
    dm = _module(mnist_dir, val_size=1000, batch_size=32)
    assert (len(dm.train_set), len(dm.val_set), dm.train_size) == (7000, 1000, 7000)
    images, labels = dm.train_set.tensors
    assert images.shape == (7000, *dm.dims) and images.dtype == torch.float32
    assert labels.dtype == torch.int64 and set(labels.unique().tolist()) == set(range(dm.num_classes))
    # (x - 0.1307) / 0.3081 makes MNIST roughly zero-mean, unit-variance.
    assert abs(images.mean().item()) < 0.05 and abs(images.std().item() - 1) < 0.05
    dm.setup("test")
    assert len(dm.test_set) == 2000
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (32, 1, 28, 28) and y.shape == (32,)
    # Seeded by (seed, epoch) alone, at every world size: a resumed run sees the same order.
    sampler = dm.train_dataloader().sampler
    assert isinstance(sampler, DistributedSampler) and sampler.num_replicas == 1 and sampler.shuffle
    assert isinstance(dm.val_dataloader().sampler, SequentialSampler)  # no process group: plain loader
    assert len(dm.test_dataloader().dataset) == 2000


def test_val_split_disjoint_and_deterministic(mnist_dir):
    a, b = _module(mnist_dir, val_size=500), _module(mnist_dir, val_size=500)
    train, val = set(a.train_indices.tolist()), set(a.val_indices.tolist())
    assert not train & val and train | val == set(range(8000))
    assert torch.equal(a.val_indices, b.val_indices)  # what every rank computes
    assert torch.equal(a.val_set.tensors[0], b.val_set.tensors[0])
    other = _module(mnist_dir, val_size=500, seed=7)
    assert not torch.equal(a.val_indices, other.val_indices)


def test_val_size_zero_disables_validation(mnist_dir):
    assert _module(mnist_dir).val_dataloader() == []


@pytest.mark.parametrize("n", [1, 7, 1001])
@pytest.mark.parametrize("world", [2, 3])
def test_exact_sampler_shards_cover_once(n, world):
    shards = [list(ExactDistributedSampler(range(n), num_replicas=world, rank=r)) for r in range(world)]
    flat = [i for shard in shards for i in shard]
    assert sorted(flat) == list(range(n))  # every index once: no padding, no duplicates
    assert max(map(len, shards)) - min(map(len, shards)) <= 1
    assert [len(ExactDistributedSampler(range(n), world, r)) for r in range(world)] == list(map(len, shards))


def test_exact_sampler_rejects_bad_rank():
    with pytest.raises(ValueError):
        ExactDistributedSampler(range(5), num_replicas=2, rank=2)


def test_exact_eval_loader_shards_under_process_group(monkeypatch):
    dataset = TensorDataset(torch.arange(11))
    monkeypatch.setattr(samplers, "_world", lambda: (3, 1))  # as if rank 1 of 3
    loader = exact_eval_loader(dataset, batch_size=2)
    assert isinstance(loader.sampler, ExactDistributedSampler)
    assert torch.cat([b[0] for b in loader]).tolist() == [1, 4, 7, 10]


def test_lightning_keeps_exact_sampler_but_shards_train():
    # Pins Lightning 2.6's rule (data_connector._requires_distributed_sampler): only a DistributedSampler
    # is left alone; other custom samplers would be wrapped and re-sharded. No process is launched here.
    trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp", logger=False, enable_progress_bar=False)
    dataset = TensorDataset(torch.arange(11))
    exact = DataLoader(dataset, batch_size=2, sampler=ExactDistributedSampler(dataset, 2, 0))
    kept = trainer._data_connector._prepare_dataloader(exact, shuffle=False, mode=RunningStage.VALIDATING)
    assert kept is exact
    train = DataLoader(dataset, batch_size=2, shuffle=True)
    sharded = trainer._data_connector._prepare_dataloader(train, shuffle=True, mode=RunningStage.TRAINING)
    assert type(sharded.sampler) is DistributedSampler and sharded.sampler.num_replicas == 2


def _assert_one_line_error(excinfo):
    message = cli_text(excinfo.value)
    assert "\n" not in message and "--data-dir" in message


@pytest.mark.parametrize("stage", ["prepare_data", "setup"])
def test_missing_data_dir_without_download(tmp_path, stage):
    dm = MNISTDataModule(data_dir=tmp_path / "empty", download=False)
    with pytest.raises(FileNotFoundError) as excinfo:
        dm.prepare_data() if stage == "prepare_data" else dm.setup("fit")
    _assert_one_line_error(excinfo)


def test_a_missing_data_dir_is_one_line_before_any_rank_starts_and_creates_nothing(tmp_path, monkeypatch, capsys):
    """--devices 2 with a mistyped --data-dir on a machine that cannot download: the download is tried on the
    launching process before any rank starts, fails in one line, and leaves neither the data folder it would
    have made nor the output folder (issue #40.7)."""
    from recipes import mnist

    def offline(*args, **kwargs):
        raise urllib.error.URLError("no network (simulated)")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    with pytest.raises(SystemExit) as stopped:
        mnist.main(["--devices", "2", "--accelerator", "cpu", "--data-dir", str(tmp_path / "nope"),
                    "--output-dir", str(tmp_path / "out")])
    captured = capsys.readouterr()
    assert stopped.value.code == 2 and "Initializing distributed" not in captured.out + captured.err
    assert "could not be downloaded" in captured.err.strip().splitlines()[-1]
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_missing_data_dir_offline_download(tmp_path, monkeypatch):
    calls = []

    def offline(*args, **kwargs):
        calls.append(args)
        raise urllib.error.URLError("no network (simulated)")

    monkeypatch.setattr(urllib.request, "urlopen", offline)  # torchvision downloads through urlopen
    dm = MNISTDataModule(data_dir=tmp_path, download=True)
    with pytest.raises(FileNotFoundError) as excinfo:
        dm.prepare_data()
    _assert_one_line_error(excinfo)
    assert calls and "could not be downloaded" in str(excinfo.value)


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_corrupt_data_dir(mnist_dir, tmp_path, damage):
    shutil.copytree(mnist_dir / "MNIST", tmp_path / "MNIST")
    victim = tmp_path / "MNIST" / "raw" / "train-images-idx3-ubyte"
    victim.chmod(0o644)
    blob = victim.read_bytes()
    victim.write_bytes({"truncate": blob[:-784], "garbage": b"\x00" * len(blob), "empty": b""}[damage])
    dm = MNISTDataModule(data_dir=tmp_path, download=True)  # files exist: no download attempt
    for step in (dm.prepare_data, lambda: dm.setup("fit")):
        with pytest.raises(ValueError) as excinfo:
            step()
        _assert_one_line_error(excinfo)


def test_val_size_too_large(mnist_dir):
    with raises_cli(ValueError, match="--val-size"):
        _module(mnist_dir, val_size=8000)


def test_loaders_pin_memory_exactly_when_the_trainer_trains_on_cuda(tmp_path, monkeypatch):
    """As the image DataModules: decided from the trainer's device when the loaders are built, never by asking
    CUDA (which would initialise it in every rank of a CPU run on a GPU host); an explicit value wins."""
    import types

    def cuda_touched(*args, **kwargs):
        raise AssertionError("pin_memory asked CUDA")

    monkeypatch.setattr(torch.cuda, "is_available", cuda_touched)
    dm = MNISTDataModule(tmp_path, batch_size=16, download=False)
    assert dm.pin_memory is False  # no trainer yet
    dm.trainer = types.SimpleNamespace(strategy=types.SimpleNamespace(root_device=torch.device("cpu")))
    assert dm.pin_memory is False
    dm.trainer = types.SimpleNamespace(strategy=types.SimpleNamespace(root_device=torch.device("cuda", 0)))
    assert dm.pin_memory is True  # what SplitDataModule's loaders are built with
    explicit = MNISTDataModule(tmp_path, download=False, pin_memory=False)
    explicit.trainer = dm.trainer
    assert explicit.pin_memory is False


def test_a_subclass_may_still_set_pin_memory_itself(tmp_path):
    from ddp_recipes.data.base import SplitDataModule

    class Mine(SplitDataModule):
        def __init__(self) -> None:
            super().__init__()
            self.pin_memory = True  # what a user's DataModule (examples/my_data.py) does

    assert Mine().pin_memory is True
