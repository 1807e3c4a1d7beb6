"""Fixtures shared by several test files."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import SHARED_DATA
from tests.marks import pytest_runtest_setup  # noqa: F401 - the hook of @pytest.mark.compiles


@pytest.fixture(scope="module")
def mnist_dir() -> Path:
    """The shared mini-MNIST folder (``tests.helpers.SHARED_DATA``); the test skips, naming it, where it is missing."""
    if not (SHARED_DATA / "MNIST" / "raw").is_dir():
        pytest.skip(f"no MNIST under {SHARED_DATA}")
    return SHARED_DATA


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """End what a test started and left running (a failure between ``start`` and ``finish``): orphans waiting for a
    file that never comes would run forever. Fixtures' processes (an MLflow server) start before the call: kept."""
    from tests.launch import STARTED

    first = len(STARTED)
    yield
    for proc in STARTED[first:]:
        proc.end_leftovers()


@pytest.fixture
def restore_tf32():
    """Put the process-wide TF32 switches back after a test that flips them."""
    saved = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    yield
    torch.set_float32_matmul_precision(saved[0])
    torch.backends.cudnn.allow_tf32 = saved[1]


@pytest.fixture(params=["torchcodec", "torchvision"])
def image_library(request, monkeypatch) -> str:
    """Each image decoder library in turn as the pack's choice (ddp_recipes.data.decoders), in this process and in
    the processes it starts (the environment variable); torchcodec skips where it is missing (the lent stack)."""
    import importlib.util

    from ddp_recipes.data.decoders import ENV, image_decoders

    if request.param == "torchcodec" and importlib.util.find_spec("torchcodec") is None:
        pytest.skip("torchcodec is the decode extra: pip install -e '.[decode]'")
    monkeypatch.setenv(ENV, request.param)  # "torchcodec": the default choice where it imports
    image_decoders.cache_clear()
    yield request.param
    image_decoders.cache_clear()


# The cloud tests' S3 server (moto on 127.0.0.1), shared by the session: see tests/s3server.py.
from tests.resume_scenario import images, straight  # noqa: E402, F401 - the resume scenario's fixtures
from tests.s3server import s3  # noqa: E402, F401
