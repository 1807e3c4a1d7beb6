"""No hidden deprecations (docs/testing.md, "Deprecations"): a deprecation raised by a call in the pack's own code
fails the suite, in the pytest process (pyproject.toml's ``filterwarnings``) and in the processes the tests start
(``tests/childsite/sitecustomize.py``); a third-party one listed in pyproject.toml is ignored, any other is shown.

Python attributes a warning to the module of the frame ``stacklevel`` names, read from that frame's globals'
``__name__``: a deprecated API warns with ``stacklevel=2``, so the warning is its caller's. The probes below run a
call from a frame whose globals say ``ddp_recipes.<x>``, exactly as a call from the pack's own module would.
"""

from __future__ import annotations

import ast
import os
import re
import textwrap
import tomllib

import pytest

from tests.launch import CHILD_SITE, ROOT, run

# A pytest run of this file, with the repository's pyproject.toml as its configuration, outside the repository.
PROBE = textwrap.dedent('''
    import warnings

    import pytest


    def old_api(category):
        """A third-party API that deprecates itself the usual way: the warning is its caller's."""
        warnings.warn("old_api is deprecated", category, stacklevel=2)


    def call_from(module, category):
        """Call old_api from a frame of ``module`` (its globals' __name__)."""
        scope = {"__name__": module, "old_api": old_api}
        exec("def call(category):\\n    old_api(category)\\n", scope)
        scope["call"](category)


    @pytest.mark.parametrize("module", ["ddp_recipes.data.image_folder", "recipes.mnist", "tests.data.test_x"])
    @pytest.mark.parametrize("category", [DeprecationWarning, PendingDeprecationWarning, FutureWarning])
    def test_own(module, category):
        call_from(module, category)


    @pytest.mark.parametrize("module", ["somelib.io", "ddp_recipes_plugin"])
    def test_third_party(module):
        call_from(module, DeprecationWarning)


    def test_listed_torchvision_fallback():
        # torchvision 0.29's own warning, as its decode_jpeg raises it (stacklevel 1: torchvision.io.image's)
        warnings.warn_explicit(
            "The image decoding and encoding capabilities of TorchVision are deprecated since torchvision 0.29 "
            "and will be removed in a future release.", DeprecationWarning, "torchvision/io/image.py", 33,
            module="torchvision.io.image")
''')


def outcomes(text: str) -> dict[str, str]:
    """``-rA``'s short summary: each test id and PASSED or FAILED."""
    return {m[2]: m[1] for m in re.finditer(r"^(PASSED|FAILED) \S+::(\S+)", text, re.M)}


def test_the_suites_configuration_fails_a_deprecation_from_the_packs_own_call(tmp_path):
    (tmp_path / "test_probe.py").write_text(PROBE)
    # No PYTHONPATH: not the child site's filters, only pyproject.toml's decide.
    done = run(["-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "-c", ROOT / "pyproject.toml",
                "--rootdir", tmp_path, "test_probe.py"], cwd=tmp_path, quiet=False, port=False,
               env={"PYTHONPATH": ""}, timeout=120)
    seen = outcomes(done.stdout)
    own = {k: v for k, v in seen.items() if k.startswith("test_own[")}
    assert len(own) == 9 and set(own.values()) == {"FAILED"}, done.stdout[-3000:]
    assert "Warning: old_api is deprecated" in done.stdout
    # A third-party module's own deprecation (and a module that only looks like ours) is shown, not an error;
    # a listed one is not even shown.
    assert seen["test_third_party[somelib.io]"] == seen["test_third_party[ddp_recipes_plugin]"] == "PASSED"
    assert seen["test_listed_torchvision_fallback"] == "PASSED"
    shown = done.stdout.partition("warnings summary")[2]
    assert "test_third_party[somelib.io]" in shown and "TorchVision are deprecated" not in shown, shown


# A call in ``module`` that raises a ``category`` warning, then a line that says the process went on.
CALL_FROM = ("scope = {{'__name__': {module!r}}}; "
             "exec('import warnings\\ndef call():\\n    warnings.warn(\"old\", {category}, stacklevel=1)', scope); "
             "scope['call'](); print('went on')")


@pytest.mark.parametrize("module", ["ddp_recipes.train.run", "recipes.resnet", "tests.scenarios.x", "__main__"])
def test_a_child_fails_on_a_deprecation_from_the_packs_own_code(module):
    """Even with PYTHONWARNINGS=ignore (what a quiet launch sets), as in a recipe's rank."""
    for category in ("DeprecationWarning", "FutureWarning"):
        done = run(["-c", CALL_FROM.format(module=module, category=category)], port=False, timeout=60)
        assert done.returncode == 1 and f"{category}: old" in done.stderr, done.stderr
        assert "went on" not in done.stdout


def test_a_child_goes_on_past_a_third_party_deprecation():
    done = run(["-c", CALL_FROM.format(module="somelib.io", category="DeprecationWarning")], port=False,
               timeout=60, check=True)
    assert "went on" in done.stdout


def test_the_child_site_runs_the_environments_own_sitecustomize_first(tmp_path):
    """tests/childsite/sitecustomize.py hides the one the environment has (Debian's Python has one): it runs it,
    before its own filters, so that a filter that one sets does not win over them."""
    (tmp_path / "sitecustomize.py").write_text("import warnings\nwarnings.simplefilter('always')\n"
                                               "print('the environment\\'s own')\n")
    path = os.pathsep.join([str(CHILD_SITE), str(tmp_path)])
    done = run(["-c", CALL_FROM.format(module="ddp_recipes.x", category="DeprecationWarning")], port=False,
               timeout=60, env={"PYTHONPATH": path})
    assert done.stdout == "the environment's own\n"
    assert done.returncode == 1 and "DeprecationWarning: old" in done.stderr, done.stderr


def test_the_child_site_and_pyproject_name_the_same_modules():
    """One pattern in both places, and pyproject.toml's own-module lines last, so that they win over every
    third-party line above them."""
    tree = ast.parse((CHILD_SITE / "sitecustomize.py").read_text())
    pattern = next(node.value.value for node in tree.body if isinstance(node, ast.Assign)
                   and getattr(node.targets[0], "id", "") == "OWN_MODULES")
    lines = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["filterwarnings"]
    own = [f"error::{c}:{pattern}" for c in ("DeprecationWarning", "PendingDeprecationWarning", "FutureWarning")]
    assert lines[-3:] == own, lines
    assert "ignore::DeprecationWarning" not in lines  # never wholesale again
