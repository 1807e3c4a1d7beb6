"""Run at start-up by every process the tests start: ``tests/launch.py`` puts this folder on their PYTHONPATH.

A deprecation raised by a call in the pack's own code is an error in those processes too, as
``pyproject.toml``'s ``filterwarnings`` makes it in the pytest process (see docs/testing.md, "Deprecations"):
a 2-rank run's warnings never reach pytest. PYTHONWARNINGS cannot say this: its module field is one exact
module name, not a pattern, and the pack has some 150 modules. Python imports ``sitecustomize`` after it has
applied PYTHONWARNINGS, so these filters come first and win over the ``ignore`` that quiet launches set.
``__main__`` is the child's own script: a recipe run with ``-m``, a scenario, ``-c`` code (``__mp_main__`` in a
process that multiprocessing spawned from it).

This file shadows the environment's own ``sitecustomize`` (Debian's Python has one): it runs that one first.
"""

import importlib.machinery
import importlib.util
import os
import sys
import warnings

# The same pattern as pyproject.toml's filterwarnings, plus __main__ (tests/cross_cutting/test_deprecations.py
# checks that the two agree).
OWN_MODULES = r"(ddp_recipes|recipes|tests)(\..*)?$"
CATEGORIES = (DeprecationWarning, PendingDeprecationWarning, FutureWarning)


def _run_shadowed() -> None:
    """The ``sitecustomize`` this one hides (the next on sys.path), run as Python would have run it."""
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


_run_shadowed()  # first: a filter it sets must not come before ours
for category in CATEGORIES:
    warnings.filterwarnings("error", category=category, module=OWN_MODULES)
    warnings.filterwarnings("error", category=category, module=r"__(mp_)?main__$")
