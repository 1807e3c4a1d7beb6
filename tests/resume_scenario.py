"""The resume scenario several test modules share: a tiny image folder, the ResNet recipe's flags over it at 1
or 2 ranks (random crops decoded in a loader worker, dropout, warm-up), and the uninterrupted run an interrupted
one must end equal to. Its fixtures are imported by tests/conftest.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.launch import run, saved_step

CAPTURED_STEP_LIMIT_S = 240


# Session-scoped: the folder is only read, and the straight runs over it are shared by every module that compares
# against them (each is a 2-process ResNet run; module scope ran straight(2) once per module).
@pytest.fixture(scope="session")
def images(tmp_path_factory) -> Path:
    """A tiny ImageFolder tree: 2 classes x 24 train / 6 val noise images of 20 px (random crops to 16)."""
    root = tmp_path_factory.mktemp("imgs")
    rng = np.random.default_rng(0)
    for split, n in (("train", 24), ("val", 6)):
        for cls in ("a", "b"):
            folder = root / split / cls
            folder.mkdir(parents=True)
            for i in range(n):
                Image.fromarray(rng.integers(0, 255, (20, 20, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    return root


def args(images: Path, devices: int, *extra: str) -> list[str]:
    # 48 images / (4 per device x 2 ranks) = 6 steps per epoch at 2 ranks, 12 at 1.
    return ["--accelerator", "cpu", "--data", "imagefolder", "--data-dir", str(images), "--image-size", "16",
            "--min-crop-scale", "0.3", "--batch-size", "4", "--num-workers", "1", "--dropout", "0.3",
            "--lr", "0.05", "--warmup-epochs", "0.5", "--devices", str(devices), *extra]


RESNET = ["-m", "recipes.resnet"]


# 12 optimizer steps either way: 2 ranks x 6 per epoch; 1 rank x 12 micro-batches / 2 accumulated x 2 epochs.
RUNS = {2: ["--max-epochs", "2"], 1: ["--max-epochs", "2", "--accumulate-grad-batches", "2"]}


@pytest.fixture(scope="session")
def straight(images, tmp_path_factory):
    """``straight(devices)``: the uninterrupted run (12 steps) an interrupted one must end equal to; each
    world size is run once, when a test first asks for it."""
    outs: dict[int, Path] = {}

    def get(devices: int) -> Path:
        if devices not in outs:
            out = tmp_path_factory.mktemp(f"straight{devices}")
            run([*RESNET, *args(images, devices, *RUNS[devices]), "--output-dir", str(out)], timeout=600, check=True)
            outs[devices] = out / "checkpoints" / "last.ckpt"
            assert saved_step(outs[devices]) == 12
        return outs[devices]

    return get
