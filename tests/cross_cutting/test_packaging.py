"""The version ranges pyproject.toml admits are ones CI runs: each floor is pinned, exactly, in the stack that
`make test-stack` installs (.ci/gpu-stack.txt, the lent GPU machine's), and that stack is nothing but the
lent machine's packages."""

from __future__ import annotations

import os
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from tests.launch import ROOT, run

# The lent GPU machine's packages: the stack must hold these and nothing else.
LENT_MACHINE = {"torch", "torchvision", "torchmetrics", "lightning", "numpy", "matplotlib", "pyyaml", "tensorboard",
                "pytest", "pytest-timeout"}
# Its versions where they are known (the others are pinned at the pack's floors).
LENT_VERSIONS = {"torch": "2.11.0", "torchvision": "0.26.0", "torchmetrics": "1.9.0", "lightning": "2.6.6",
                 "numpy": "2.5.2"}
STACK_PYTHON = {"python_version": "3.12", "python_full_version": "3.12.0"}  # the lent machine's, the stack's


def stack_pins() -> dict[str, Version]:
    pins = {}
    for line in (ROOT / ".ci" / "gpu-stack.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            pins[name.strip().lower()] = Version(version.strip())
    return pins


def floors(environment: dict[str, str] | None = None) -> dict[str, Version]:
    """Each pyproject requirement's ``>=`` floor, by package (the runtime ones and every extra's), for the Python
    of ``environment`` (default: the stack's): a requirement whose marker leaves that Python out is left out."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    found = {}
    for text in [*project["dependencies"], *(r for extra in project["optional-dependencies"].values() for r in extra)]:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate(environment or STACK_PYTHON):
            continue
        for spec in req.specifier:
            if spec.operator == ">=":
                found[req.name.lower()] = Version(spec.version)
    return found


def test_the_stack_is_the_lent_machines_and_pins_its_known_versions():
    pins = stack_pins()
    assert set(pins) == LENT_MACHINE
    assert {name: str(pins[name]) for name in LENT_VERSIONS} == LENT_VERSIONS


def test_every_floor_of_a_stack_package_is_the_version_the_stack_runs():
    pins, found = stack_pins(), floors()
    runtime = {Requirement(r).name.lower() for r in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
               ["dependencies"]}
    assert runtime <= set(pins), "a runtime dependency the lent machine lacks cannot run there"
    for name in sorted(set(pins) & set(found)):
        assert found[name] == pins[name], f"pyproject's {name}>={found[name]} is not what CI runs ({pins[name]})"


def test_make_test_stack_hides_the_shared_data_as_the_lent_machine_lacks_it(tmp_path):
    """``make test-stack`` sets DDP_RECIPES_SHARED_DATA=none: every test's SHARED_DATA then names no folder,
    as on the lent machine where ../shared does not travel; a folder given instead is the one used."""
    makefile = (ROOT / "Makefile").read_text()
    assert "DDP_RECIPES_SHARED_DATA=none $(STACK_VENV)/bin/python -m pytest" in makefile
    probe = ["-c", "from tests.helpers import SHARED_DATA; print(SHARED_DATA, (SHARED_DATA / 'MNIST').exists())"]
    hidden = run(probe, env={"DDP_RECIPES_SHARED_DATA": "none"}, port=False, check=True, cwd=ROOT)
    assert hidden.stdout.strip().endswith("False"), hidden.stdout
    (tmp_path / "MNIST").mkdir()
    named = run(probe, env={"DDP_RECIPES_SHARED_DATA": str(tmp_path)}, port=False, check=True, cwd=ROOT)
    assert named.stdout.strip() == f"{tmp_path} True", named.stdout


def test_every_other_floor_is_met_by_what_this_environment_runs():
    """The extras' floors (not on the lent machine) were raised to the releases CI ran; the environment the
    suite runs in (`make install`'s newest) must still meet each one it installs, or the floor promises a
    release no one runs."""
    import importlib.metadata
    import platform

    pins, checked = stack_pins(), []
    here = {"python_version": ".".join(platform.python_version_tuple()[:2]),
            "python_full_version": platform.python_version()}
    for name, floor in sorted(floors(here).items()):
        if name == "ddp-recipes":
            continue
        try:
            installed = Version(importlib.metadata.version(name))
        except importlib.metadata.PackageNotFoundError:
            continue  # an extra this environment lacks (the stack): its tests skip, naming it
        assert installed >= floor, f"pyproject's {name}>={floor}, but this environment runs {installed}"
        checked.append(name)
    if importlib.metadata.version("torch") != str(pins["torch"]):  # make install's environment has every extra
        assert {"mlflow", "wandb", "s3fs", "moto", "jsonargparse", "ruff", "pillow"} <= set(checked), checked


def test_install_hints_list_each_extras_own_requirements():
    """A missing optional package's message names what pyproject's extra holds (the extras of an extra
    expanded), as pip specs a user can run in the pack's environment however it was installed."""
    from ddp_recipes.extras import extra_requirements, install_hint

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]

    def expanded(name: str) -> set[str]:
        out: set[str] = set()
        for text in extras[name]:
            req = Requirement(text)
            out |= set().union(*(expanded(e) for e in req.extras)) if req.name == "ddp-recipes" else {str(req)}
        return out

    for name in (n for n in extras if n != "dev"):
        hint = install_hint(name, "fallback-package")
        assert hint.startswith("pip install ") and hint.endswith(f"(the pack's {name} extra)"), hint
        if not extra_requirements(name):  # a source tree without the pack's metadata (the stack): the names given
            assert hint == f"pip install fallback-package (the pack's {name} extra)"
            continue
        named = {str(Requirement(spec)) for spec in extra_requirements(name)}
        assert named == {str(Requirement(s)) for s in expanded(name)}, (name, named)
        assert all(f"'{spec}'" in hint for spec in extra_requirements(name)), hint


def test_nothing_tells_a_user_to_install_the_pack_by_name():
    """No index serves ddp-recipes: an install line must work from a checkout (`pip install -e '.[cloud]'`) or
    name the extra's own packages."""
    by_name = ("pip install 'ddp-recipes", 'pip install "ddp-recipes', "pip install ddp-recipes")
    files = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "ddp_recipes").rglob("*.py"),
             *(ROOT / "recipes").rglob("*.py"), *(ROOT / "examples").rglob("*")]
    found = [f"{f.relative_to(ROOT)}:{n}" for f in files if f.is_file() and f.suffix in (".md", ".py", ".yaml", ".sh")
             for n, line in enumerate(f.read_text().splitlines(), 1) if any(s in line for s in by_name)]
    assert not found, f"install lines that no index serves: {found}"


NEWEST_CHECK = "DDP_RECIPES_CHECK_NEWEST"  # .ci/run sets it where `make install` resolved from the public registry


def registry_newest(name: str) -> Version:
    """The newest final release of ``name`` the public registry serves (pip's own view, no machine-local pip
    configuration: what a user's fresh install resolves from)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PIP_CONFIG_FILE": os.devnull}
    done = subprocess.run([sys.executable, "-m", "pip", "index", "versions", name], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    listed = done.stdout.split("Available versions:", 1)[1].splitlines()[0]
    return max(Version(v.strip()) for v in listed.split(",") if v.strip() and not Version(v.strip()).is_prerelease)


@pytest.mark.skipif(os.environ.get(NEWEST_CHECK) != "1",
                    reason=f"asks the package registry; CI sets {NEWEST_CHECK}=1 where it installed the newest")
@pytest.mark.parametrize("name", ["torch", "torchvision", "lightning", "torchmetrics", "torchcodec"])
def test_ci_ran_the_newest_release_a_user_gets(name):
    """The range is kept honest: where CI installed the newest releases pyproject admits, each of the stack's
    packages must be the newest the registry serves. A new release pyproject excludes (the next torch, Lightning
    2.7) fails here, the day it is out, instead of users' installs being downgraded to what CI ran."""
    import importlib.metadata

    installed = Version(Version(importlib.metadata.version(name)).public)
    newest = registry_newest(name)
    assert installed == newest, (f"the registry serves {name} {newest} but CI ran {installed}: admit it in "
                                 "pyproject.toml (and fix what breaks) or say in docs/testing.md why it is excluded")


def test_the_package_metadata_uses_no_deprecated_form():
    """pyproject.toml as the build backend reads it warns of nothing: a deprecated form (the TOML-table
    ``license`` setuptools 77 deprecates, removed 2027-02-18) would stop `make install` the day it is removed."""
    setuptools = pytest.importorskip("setuptools")
    if Version(setuptools.__version__) < Version("77"):
        pytest.skip(f"setuptools {setuptools.__version__} here; the build backend pyproject requires is >= 77")
    code = ("import warnings; warnings.simplefilter('error')\n"
            "from setuptools.config.pyprojecttoml import apply_configuration\n"
            "from setuptools.dist import Distribution\n"
            "apply_configuration(Distribution(), 'pyproject.toml')\n")
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
