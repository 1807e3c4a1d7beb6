"""Your own dataset as a LightningDataModule, run by a recipe:

    python -m recipes.mnist --datamodule-class my_data:NpzDataModule --data-dir DIR --devices 2

``DIR`` holds ``train.npz`` and ``test.npz``, each with arrays ``x`` (N, C, H, W; uint8 0-255 or float)
and ``y`` (N,) of class indices. The recipe passes each ``__init__`` parameter it knows by name
(``data_dir``, ``batch_size``: the per-device batch of the run's plan, ``seed``, ``num_workers``, ...);
the others keep their defaults.

Subclassing ``SplitDataModule`` gives the pack's loaders: a training order that resumes exactly from
any step (``resumable_train_loader``) and evaluation sharded without padding, so every test image
counts once at any world size. A plain ``DataLoader(shuffle=True)`` works too (Lightning shards it), but a
mid-epoch resume then revisits the epoch's first batches.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset, random_split

from ddp_recipes.data.base import SplitDataModule


def load_npz(path: Path) -> TensorDataset:
    with np.load(path) as arrays:
        x, y = torch.from_numpy(arrays["x"]), torch.from_numpy(arrays["y"]).long()
    if not x.is_floating_point():
        x = x.float() / 255.0
    return TensorDataset((x - x.mean()) / x.std().clamp_min(1e-6), y)


class NpzDataModule(SplitDataModule):
    def __init__(self, data_dir: str, batch_size: int, seed: int = 0, num_workers: int = 0,
                 val_fraction: float = 0.1) -> None:
        super().__init__()
        self.data_dir, self.batch_size, self.seed = Path(data_dir), batch_size, seed
        self.num_workers, self.val_fraction = num_workers, val_fraction
        self.pin_memory = torch.cuda.is_available()
        for name in ("train.npz", "test.npz"):
            if not (self.data_dir / name).is_file():
                raise FileNotFoundError(f"--data-dir {data_dir} has no {name}")
        with np.load(self.data_dir / "train.npz") as arrays:
            self.num_classes = int(arrays["y"].max()) + 1  # the ResNet recipe sizes its head from this

    def setup(self, stage: str) -> None:
        full = load_npz(self.data_dir / "train.npz")
        n_val = int(len(full) * self.val_fraction)
        # The same split on every rank and every run: a generator of its own, never the global RNG.
        self.train_set, self.val_set = random_split(full, [len(full) - n_val, n_val],
                                                    generator=torch.Generator().manual_seed(1234))
        self.test_set = load_npz(self.data_dir / "test.npz")
