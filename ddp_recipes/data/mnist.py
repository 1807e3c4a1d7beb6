"""MNIST as in-memory tensors, with a seeded validation split and exact DDP evaluation.

Decoding every sample through PIL + ``ToTensor`` on every epoch (the write-up's loader) is the bottleneck;
here the idx files are decoded once per process into one normalized float tensor.
Reads torchvision's layout: ``<data_dir>/MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte``.
"""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path

import torch
from torch.utils.data import TensorDataset
from torchvision.datasets import MNIST
from typing_extensions import override

from ddp_recipes.config.world import will_be_local_zero
from ddp_recipes.data.base import SplitDataModule
from ddp_recipes.data.samplers import TensorBatchDataset, _world
from ddp_recipes.errors import ConfigError, DataError, MissingDataError, lit

MEAN, STD = 0.1307, 0.3081  # over the 60k MNIST training images; the write-up's Normalize values
_SPLITS = ("train", "t10k")
_IMAGE_MAGIC, _LABEL_MAGIC = 2051, 2049  # idx headers: uint8 data with 3 and 1 dimensions
# torchvision downloads with no timeout: behind a firewall that drops packets rank 0 would hang while
# the other ranks wait at the barrier after prepare_data. Bound each socket operation instead.
_DOWNLOAD_TIMEOUT_S = 30.0


def _raw_dir(data_dir: str | Path) -> Path:
    return Path(data_dir) / "MNIST" / "raw"


def _files(data_dir: str | Path, split: str) -> tuple[Path, Path]:
    raw = _raw_dir(data_dir)
    return raw / f"{split}-images-idx3-ubyte", raw / f"{split}-labels-idx1-ubyte"


def _header(path: Path, magic: int, ndim: int) -> list[int]:
    """The dimensions in an idx file's header, checked against the file's size."""
    with open(path, "rb") as f:
        head = f.read(4 + 4 * ndim)
    if len(head) < 4 + 4 * ndim or int.from_bytes(head[:4], "big") != magic:
        raise DataError(f"{path.name} is not an MNIST idx file (bad header)")
    dims = [int.from_bytes(head[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    expected = 4 + 4 * ndim + torch.Size(dims).numel()
    if path.stat().st_size != expected:
        raise DataError(f"{path.name} has {path.stat().st_size} bytes, its header promises {expected} (truncated?)")
    return dims


def check_mnist(data_dir: str | Path) -> dict[str, int]:
    """Sample counts per split, after checking that the four idx files exist and are whole (else one line
    naming ``--data-dir``: a ``FileNotFoundError`` or ``ValueError``)."""
    raw = _raw_dir(data_dir)
    paths = [p for split in _SPLITS for p in _files(data_dir, split)]
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        raise MissingDataError(
            f"MNIST not found under {lit(raw)} (missing {', '.join(missing)}): pass {{data_dir}} pointing at a "
            "folder holding MNIST/raw/{train,t10k}-*-ubyte")
    counts = {}
    try:
        for split in _SPLITS:
            images, labels = _files(data_dir, split)
            n, rows, cols = _header(images, _IMAGE_MAGIC, 3)
            (n_labels,) = _header(labels, _LABEL_MAGIC, 1)
            if (rows, cols) != (28, 28) or n != n_labels or n == 0:
                raise DataError(f"{split}: {n} images of {rows}x{cols} vs {n_labels} labels")
            counts[split] = n
    except OSError as e:  # unreadable: permissions, a directory in a file's place, ...
        raise DataError(f"MNIST under {lit(raw)} is unreadable ({lit(e)}): pass {{data_dir}} pointing at a readable "
                         "copy of MNIST/raw/{train,t10k}-*-ubyte") from e
    except ValueError as e:
        raise DataError(f"MNIST under {lit(raw)} is corrupt ({lit(e)}): delete it or pass {{data_dir}} pointing at a "
                         "good copy of MNIST/raw/{train,t10k}-*-ubyte") from e
    return counts


def load_split(data_dir: str | Path, train: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """All images of a split as normalized float32 ``[N, 1, 28, 28]`` and their int64 labels."""
    check_mnist(data_dir)
    ds = MNIST(root=os.fspath(data_dir), train=train, download=False)
    images = ds.data.unsqueeze(1).float().div_(255).sub_(MEAN).div_(STD)
    labels = ds.targets.long()
    if labels.numel() and (labels.min() < 0 or labels.max() > 9):
        raise DataError(f"MNIST under {lit(_raw_dir(data_dir))} is corrupt (labels outside 0-9): pass {{data_dir}} "
                         "pointing at a good copy of MNIST/raw/{train,t10k}-*-ubyte")
    return images, labels


class MNISTDataModule(SplitDataModule):
    """MNIST train/val/test as ``TensorDataset``s; ``val_size`` images are held out of the train split."""

    num_classes = 10
    dims = (1, 28, 28)

    def __init__(self, data_dir: str | Path = "data", batch_size: int = 64, val_size: int = 0, seed: int = 42,
                 num_workers: int = 0, download: bool = True, pin_memory: bool | None = None) -> None:
        super().__init__()
        if batch_size < 1:
            raise ConfigError(f"{{batch_size}} must be >= 1 (got {batch_size})")
        if val_size < 0:
            raise ConfigError(f"{{val_size}} must be >= 0 (got {val_size})")
        self.data_dir = Path(data_dir)
        self.batch_size = batch_size
        self.val_size = val_size
        self.seed = seed
        self.num_workers = num_workers
        self.download = download
        self._pin_memory = pin_memory  # None: pinned exactly when the trainer trains on CUDA (SplitDataModule)
        self.train_set: TensorDataset | None = None
        self.val_set: TensorDataset | None = None
        self.test_set: TensorDataset | None = None
        self.train_indices: torch.Tensor | None = None  # rows of the train files in each split
        self.val_indices: torch.Tensor | None = None

    @override
    def prepare_data(self) -> None:
        """Download on local rank 0 only when the files are missing; fail with one line when we cannot."""
        try:
            check_mnist(self.data_dir)
            return
        except FileNotFoundError:
            if not self.download:
                raise
        previous_timeout = socket.getdefaulttimeout()
        socket.setdefaulttimeout(_DOWNLOAD_TIMEOUT_S)
        # The folders a failed download leaves are removed again: a mistyped --data-dir creates nothing.
        made, folder = [], _raw_dir(self.data_dir).absolute()
        while not folder.exists() and folder != folder.parent:  # every folder the download would create
            made.append(folder)
            folder = folder.parent
        made.reverse()
        try:
            for train in (True, False):
                MNIST(root=os.fspath(self.data_dir), train=train, download=True)
        except Exception as e:  # torchvision raises RuntimeError after every mirror failed (offline)
            if made:
                shutil.rmtree(made[0], ignore_errors=True)  # the outermost new folder: all of it is this attempt's
            raise MissingDataError(
                f"MNIST not found under {_raw_dir(self.data_dir)} and it could not be downloaded "
                f"({type(e).__name__}; offline?): pass {{data_dir}} pointing at a folder holding "
                "MNIST/raw/{train,t10k}-*-ubyte") from None
        finally:
            socket.setdefaulttimeout(previous_timeout)
        check_mnist(self.data_dir)

    @override
    def setup(self, stage: str | None = None) -> None:
        """Decode the needed splits once; every rank draws the same validation split from ``seed``."""
        # Other nodes never ran prepare_data: check here too, with the same message.
        self._check_hold_out(check_mnist(self.data_dir)["train"], _world()[0])
        if stage in (None, "fit", "validate") and self.train_set is None:
            images, labels = load_split(self.data_dir, train=True)
            perm = torch.randperm(len(labels), generator=torch.Generator().manual_seed(self.seed))
            self.val_indices, self.train_indices = perm[:self.val_size], perm[self.val_size:]
            self.train_set = TensorBatchDataset(images[self.train_indices], labels[self.train_indices])
            self.val_set = TensorBatchDataset(images[self.val_indices], labels[self.val_indices])
        if stage in (None, "test", "predict") and self.test_set is None:
            self.test_set = TensorBatchDataset(*load_split(self.data_dir, train=False))

    def check_split(self, world_size: int) -> None:
        """``val_size`` against the files and the ranks, before any process starts. Missing files are downloaded
        here first, on the node's first process, so a failed download is one line, not one per rank."""
        try:
            train = check_mnist(self.data_dir)["train"]
        except FileNotFoundError:
            if not self.download:
                raise
            if not will_be_local_zero():
                return  # the node's first process downloads; this one checks in setup
            self.prepare_data()
            train = check_mnist(self.data_dir)["train"]
        self._check_hold_out(train, world_size)

    def _check_hold_out(self, train: int, world_size: int) -> None:
        left = train - self.val_size
        if left < max(1, world_size):
            short = "leaves no training data" if left < 1 else f"leaves {left} training image(s) for {world_size} ranks"
            raise ConfigError(f"{{val_size}} {self.val_size} {short} (the train split has {train} images); pass a "
                              f"{{val_size}} of at most {train - max(1, world_size)}")

    @override
    def eval_sizes(self) -> dict[str, int]:
        try:
            counts = check_mnist(self.data_dir)
        except FileNotFoundError:  # still to be downloaded: checked when the loaders are made
            return {}
        return {"validation": self.val_size, "test": counts["t10k"]}

    @override
    def more_eval_samples(self, what: str, need: int) -> str:
        if what == "validation":
            return f"pass {{val_size}} {need} or more"
        return super().more_eval_samples(what, need)

    @property
    def train_size(self) -> int:
        """Training images after the validation hold-out (reads the file headers before ``setup``)."""
        if self.train_set is not None:
            return len(self.train_set)
        return check_mnist(self.data_dir)["train"] - self.val_size
