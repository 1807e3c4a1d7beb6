"""The suite's shared marks: those that need a hook (tests/conftest.py takes the hook from here; a test can load
this module alone with ``pytest -p tests.marks``, without the torch import that conftest pays for), and
``needs_mnist``.

``@pytest.mark.compiles``: the test ``torch.compile``s on CUDA. It skips, with gpu-check's own reason, where
gpu-check's compiled checks are 'no verdict' (one probe for both, ``tests.gpucheck.machine.compile_blocker``:
no C compiler or no ``Python.h``, no Triton, Triton not finding ``libcuda.so.1``, its caches not writable), so
that the gpu tier does not fail where those checks have no verdict.

``@needs_litdata``: the test needs the ``stream`` extra; it skips naming it.

``@needs_mnist``: the test reads the shared mini-MNIST (``tests.helpers.SHARED_DATA``); it skips, saying so,
where that folder is missing or hidden (``DDP_RECIPES_SHARED_DATA=none``).
"""

from __future__ import annotations

import functools
import importlib.util

import pytest

from tests.helpers import SHARED_DATA

HAVE_MNIST = (SHARED_DATA / "MNIST").exists()
needs_mnist = pytest.mark.skipif(not HAVE_MNIST, reason="shared mini-MNIST missing")
# (the extra's install line is spelled out: importing ddp_recipes here would cost the marks-only load its speed)
needs_litdata = pytest.mark.skipif(importlib.util.find_spec("litdata") is None,
                                   reason="litdata is the stream extra: pip install -e '.[stream]'")


@functools.cache
def compile_problem() -> str | None:
    """gpu-check's own probe (its compiled checks ask the same), asked once per session."""
    from tests.gpucheck.machine import compile_blocker as probe

    return probe()


@pytest.hookimpl(trylast=True)  # after the skipif marks: a test that skips for want of a GPU never probes
def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("compiles") is not None and (why := compile_problem()) is not None:
        pytest.skip(f"torch.compile cannot build code here: {why}")
