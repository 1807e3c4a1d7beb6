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
