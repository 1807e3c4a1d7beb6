"""Image DataModules: synthetic determinism, loader defaults, CIFAR-10 and ImageFolder errors and transforms,
and a short ResNet fit through the real PNG decode + transform path on digits from the shared MNIST."""

from __future__ import annotations

import pickle
import urllib.error
from pathlib import Path

import numpy as np
import pytest
import torch
from lightning import Callback, Trainer, seed_everything
from torchvision import datasets

from ddp_recipes.config import world
from ddp_recipes.config.world import default_num_workers
from ddp_recipes.data.images import CIFAR10DataModule, ImageFolderDataModule, SyntheticImageDataModule
from ddp_recipes.modules.resnet import ResNetClassifier
from tests.helpers import cli_text, raises_cli

# ---------------------------------------------------------------- loader defaults


@pytest.mark.parametrize("cpus, devices, expected", [(16, 1, 8), (16, 4, 3), (16, 16, 0), (2, 1, 1), (1, 1, 0),
                                                     (64, 2, 8)])
def test_default_num_workers(monkeypatch, cpus, devices, expected):
    monkeypatch.setattr(world.os, "sched_getaffinity", lambda pid: set(range(cpus)), raising=False)
    assert default_num_workers(devices) == expected


def test_loader_defaults_fit_the_machine(tmp_path):
    dm = CIFAR10DataModule(tmp_path)
    assert dm.num_workers == default_num_workers(1)  # no trainer yet: one device per node
    assert dm.pin_memory is False  # no trainer yet: nothing says the run is on CUDA
    assert CIFAR10DataModule(tmp_path, num_workers=3, pin_memory=False).num_workers == 3


def test_pin_memory_follows_the_trainers_device(tmp_path, monkeypatch):
    """Decided from the trainer's root device when the loaders are built, never by asking CUDA (which would
    initialise it in every rank of a CPU run on a GPU host)."""
    import types

    import lightning as L

    def cuda_touched(*args, **kwargs):
        raise AssertionError("pin_memory asked CUDA")

    dm = CIFAR10DataModule(tmp_path)
    dm.trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    monkeypatch.setattr(torch.cuda, "is_available", cuda_touched)
    assert dm.pin_memory is False
    dm.trainer = types.SimpleNamespace(strategy=types.SimpleNamespace(root_device=torch.device("cuda", 1)))
    assert dm.pin_memory is True
    assert CIFAR10DataModule(tmp_path, pin_memory=False).pin_memory is False


# ---------------------------------------------------------------- synthetic


def test_synthetic_is_identical_per_seed_whatever_the_global_rng():
    dms = []
    for global_seed in (1, 2):
        torch.manual_seed(global_seed)  # ranks may be at different RNG states: must not matter
        dm = SyntheticImageDataModule(num_samples=10, image_size=16, num_classes=7, seed=5, val_samples=4)
        dm.setup("fit")
        dms.append(dm)
    a, b = (dm.train_set.tensors for dm in dms)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert a[0].shape == (10, 3, 16, 16) and a[0].dtype == torch.float32
    assert a[1].min() >= 0 and a[1].max() < 7
    assert len(dms[0].val_set) == 4 and dms[0].test_set is dms[0].val_set
    other = SyntheticImageDataModule(num_samples=10, image_size=16, num_classes=7, seed=6)
    other.setup("fit")
    assert not torch.equal(other.train_set.tensors[0], a[0])
    # Asking for validation samples leaves the training set as it was.
    no_val = SyntheticImageDataModule(num_samples=10, image_size=16, num_classes=7, seed=5)
    no_val.setup("fit")
    assert torch.equal(no_val.train_set.tensors[0], a[0])
    assert (dms[0].num_classes, dms[0].image_size) == (7, 16)


def test_synthetic_loaders():
    dm = SyntheticImageDataModule(num_samples=10, image_size=8, batch_size=4)
    with pytest.raises(RuntimeError, match=r"call setup\('fit'\)"):
        dm.train_dataloader()
    dm.setup("fit")
    loader = dm.train_dataloader()
    x, y = next(iter(loader))
    assert x.shape == (4, 3, 8, 8) and y.shape == (4,)
    assert (loader.num_workers, loader.persistent_workers) == (0, False)
    assert dm.val_dataloader() == []  # val_samples=0: Lightning skips validation
    workers = SyntheticImageDataModule(num_samples=10, num_workers=2)
    workers.setup("fit")
    assert workers.train_dataloader().persistent_workers  # not started until iterated


# ---------------------------------------------------------------- CIFAR-10


def test_cifar10_offline_names_data_dir(tmp_path, monkeypatch):
    def offline(self):
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(datasets.CIFAR10, "download", offline)
    dm = CIFAR10DataModule(tmp_path / "nothing")
    with raises_cli(FileNotFoundError, match="--data-dir") as info:
        dm.prepare_data()
    assert "\n" not in str(info.value) and "URLError" in str(info.value)
    with raises_cli(FileNotFoundError, match="--data-dir"):
        dm.setup("fit")  # a node that never ran prepare_data says the same


def _fake_cifar(root: Path, per_batch: int) -> None:
    """The cifar-10-batches-py pickle layout, with random pixels (torchvision's md5 check is patched out)."""
    folder = root / datasets.CIFAR10.base_folder
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for name in names:
        entry = {"data": rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8),
                 "labels": rng.integers(0, 10, per_batch).tolist()}
        (folder / name).write_bytes(pickle.dumps(entry))
    (folder / "batches.meta").write_bytes(pickle.dumps({"label_names": [f"c{i}" for i in range(10)]}))


def test_cifar10_transforms_and_loaders(tmp_path, monkeypatch):
    _fake_cifar(tmp_path, per_batch=4)
    monkeypatch.setattr(datasets.cifar, "check_integrity", lambda path, md5=None: Path(path).is_file())
    dm = CIFAR10DataModule(tmp_path, batch_size=8, num_workers=0, pin_memory=False)
    dm.prepare_data()  # present and "verified": no download
    dm.setup("fit")
    assert (len(dm.train_set), len(dm.val_set), dm.num_classes, dm.image_size) == (20, 4, 10, 32)
    assert dm.test_set is dm.val_set  # CIFAR-10 has no separate validation split
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (8, 3, 32, 32) and x.dtype == torch.float32 and y.dtype == torch.int64
    val_x, _ = next(iter(dm.val_dataloader()))
    # Uniform pixels normalized with CIFAR statistics: mean (0.5 - 0.48) / 0.25 ~ 0.1, spread ~1.2.
    assert abs(val_x.mean().item()) < 0.5 and 0.8 < val_x.std().item() < 1.6


# ---------------------------------------------------------------- ImageFolder


@pytest.mark.parametrize("present, state", [((), "neither"), (("train",), "only train/"),
                                            (("val",), "only val/")])
def test_imagefolder_layout_errors(tmp_path, present, state):
    for split in present:
        (tmp_path / split / "a").mkdir(parents=True)
    dm = ImageFolderDataModule(tmp_path, image_size=32)
    for step in (dm.prepare_data, lambda: dm.setup("fit"), lambda: dm.num_classes):
        with pytest.raises(FileNotFoundError) as info:
            step()
        message = cli_text(info.value)
        assert message.startswith("--data imagefolder needs <dir>/train and <dir>/val class subfolders; ")
        assert message.endswith(f"--data-dir {tmp_path} has {state}") and "\n" not in message


def test_imagefolder_missing_dir(tmp_path):
    with pytest.raises(FileNotFoundError, match="has neither"):
        ImageFolderDataModule(tmp_path / "nope").setup("fit")


@pytest.fixture(scope="module")
def digits(tmp_path_factory, mnist_dir) -> Path:
    """10 classes x (30 train + 10 val) real MNIST digits as 32 px RGB PNGs in an ImageFolder tree."""
    from PIL import Image

    mnist = datasets.MNIST(root=mnist_dir, train=True, download=False)
    root = tmp_path_factory.mktemp("digits")
    wanted = {"train": 30, "val": 10}
    written = {(split, c): 0 for split in wanted for c in range(10)}
    for index, (image, label) in enumerate(zip(mnist.data.numpy(), mnist.targets.tolist(), strict=True)):
        split = "train" if written["train", label] < wanted["train"] else "val"
        if written[split, label] == wanted[split]:
            continue
        folder = root / split / str(label)
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(image).resize((32, 32), Image.BILINEAR).convert("RGB").save(folder / f"{index}.png")
        written[split, label] += 1
        if all(written[key] == wanted[key[0]] for key in written):
            break
    return root


def test_imagefolder_transforms(digits):
    dm = ImageFolderDataModule(digits, batch_size=16, image_size=24, num_workers=0, pin_memory=False)
    assert (dm.num_classes, dm.image_size) == (10, 24)
    dm.setup("fit")
    assert (len(dm.train_set), len(dm.val_set)) == (300, 100)
    assert dm.train_set.classes == dm.val_set.classes == [str(d) for d in range(10)]
    x, y = dm.train_set[0]
    assert x.shape == (3, 24, 24) and x.dtype == torch.float32 and y == 0
    # Validation is deterministic (resize to 27, center-crop 24) and sees each image exactly once.
    first = dm.val_set[0][0]
    assert torch.equal(first, dm.val_set[0][0]) and first.shape == (3, 24, 24)
    seen = torch.cat([labels for _, labels in dm.val_dataloader()])
    assert torch.equal(seen.bincount(), torch.full((10,), 10))
    # Black MNIST background normalized with ImageNet statistics: (0 - 0.485) / 0.229 ~ -2.1.
    assert first[0, 0, 0].item() == pytest.approx(-0.485 / 0.229, abs=1e-3)


def test_imagefolder_val_classes_must_match_train(digits, tmp_path):
    for split, classes in (("train", ("0", "1", "2")), ("val", ("0", "2", "7"))):
        for c in classes:
            (tmp_path / split).mkdir(exist_ok=True)
            (tmp_path / split / c).symlink_to(digits / split / c)
    with pytest.raises(ValueError, match=r"val/ class folders differ .*missing in val: \['1'\], extra in val: "
                                         r"\['7'\]"):
        ImageFolderDataModule(tmp_path).setup("fit")


class _RecordLoss(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


@pytest.mark.slow  # over 30 s: the fast suite keeps its 10-minute budget
def test_resnet_learns_digits_from_png_folder(digits):
    # 16 px (not 32): a quarter of the compute on shared CPU cores, and the CIFAR stem still leaves layer4
    # 2x2. min_crop_scale=1: RandomResizedCrop still runs (whole image, random aspect), but an 8% crop of
    # a digit is a stroke fragment that 24 steps cannot learn from. lr 0.01: 0.05 overshoots the fresh head
    # at batch 16 and the loss climbs for the first tens of steps.
    seed_everything(0, verbose=False)
    dm = ImageFolderDataModule(digits, batch_size=16, image_size=16, num_workers=0, pin_memory=False,
                               min_crop_scale=1.0)
    model = ResNetClassifier(arch="resnet18", num_classes=dm.num_classes, cifar_stem=True, lr=0.01,
                             cosine=False)
    recorder = _RecordLoss()
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=24, limit_val_batches=0, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[recorder])
    trainer.fit(model, dm)
    losses = recorder.losses
    assert len(losses) == 24
    first, last = np.mean(losses[:6]), np.mean(losses[-6:])
    assert first > 2.0  # chance level is ln(10) = 2.3
    assert last < first - 0.4, losses
