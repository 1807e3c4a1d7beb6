"""Small helpers shared by the tests."""

from __future__ import annotations

import socket
from pathlib import Path

# The repository's sibling folder holds the real mini-MNIST that tests and CI use (never written to).
SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def free_port() -> int:
    """A TCP port that was free a moment ago on localhost."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_mnist_subset(dest: Path, n_train: int, n_test: int) -> Path:
    """Write an MNIST-layout folder holding the first ``n_train`` / ``n_test`` images of the shared data."""
    import numpy as np

    raw_in, raw_out = SHARED_DATA / "MNIST" / "raw", dest / "MNIST" / "raw"
    raw_out.mkdir(parents=True, exist_ok=True)
    for split, count in (("train", n_train), ("t10k", n_test)):
        images = (raw_in / f"{split}-images-idx3-ubyte").read_bytes()
        labels = (raw_in / f"{split}-labels-idx1-ubyte").read_bytes()
        header = np.frombuffer(images[:16], dtype=">i4").copy()
        header[1] = count
        (raw_out / f"{split}-images-idx3-ubyte").write_bytes(header.tobytes() + images[16:16 + count * 784])
        lab_header = np.frombuffer(labels[:8], dtype=">i4").copy()
        lab_header[1] = count
        (raw_out / f"{split}-labels-idx1-ubyte").write_bytes(lab_header.tobytes() + labels[8:8 + count])
    return dest
