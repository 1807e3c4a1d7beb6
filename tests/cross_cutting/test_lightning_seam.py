"""Lightning's private state is reached from one seam (``ddp_recipes.lightning_seam``), and the seam says when a
Lightning release moved what it relies on: one line, exit 2, before any training step."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import lightning as L
import pytest
from lightning.fabric.utilities import data as fabric_data
from lightning.fabric.utilities import logger as fabric_logger
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loops.fit_loop import _FitLoop
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer import call
from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector
from lightning.pytorch.trainer.connectors.data_connector import _DataConnector

from ddp_recipes.errors import ConfigError
from ddp_recipes.lightning_seam.check import ASSUMPTIONS, OVERRIDDEN, admitted_lightning, broken, check_lightning
from tests.helpers import cpu_trainer, refused_mnist

ROOT = Path(__file__).resolve().parents[2]
SEAM = "ddp_recipes/lightning_seam/"
LIGHTNING = Path(L.__file__).parent
# Still reached directly, to be wired to the seam (connectors.install_checkpoint_route, reach.last_checkpoints_of)
# when the run-folder rewrite of #53.4/53.5 lands; empty this set then.
PENDING: set[str] = set()


def _lightning_private_names() -> set[str]:
    """Every ``_name`` a class of Lightning (pytorch and fabric) defines: its methods and the attributes it
    assigns on ``self``."""
    names: set[str] = set()
    for path in [*(LIGHTNING / "pytorch").rglob("*.py"), *(LIGHTNING / "fabric").rglob("*.py")]:
        for cls in (n for n in ast.walk(ast.parse(path.read_text(encoding="utf-8"))) if isinstance(n, ast.ClassDef)):
            for node in ast.walk(cls):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    names.add(node.name)
                elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                      and isinstance(node.value, ast.Name) and node.value.id == "self"):
                    names.add(node.attr)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


PRIVATE = _lightning_private_names()
MODULES = [p for top in ("ddp_recipes", "recipes", "benchmarks") for p in sorted((ROOT / top).rglob("*.py"))]
_LIGHTNING_PATH = re.compile(r"^(lightning|lightning_fabric|pytorch_lightning)(\.\w+)*\._\w+")


def _reaches(path: Path) -> list[str]:
    """Where ``path`` names Lightning's private state: ``<not self>._name`` for a name Lightning's classes define
    (``super()._name`` only inside the override ``_name`` itself: the seam's table lists those), ``getattr``
    and friends with such a name, a private import from Lightning, a dotted path to a private name, or a hook
    set to None (relying on Lightning's callback loop skipping it)."""
    found: list[str] = []

    def visit(node: ast.AST, function: str | None) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            function = node.name
        if isinstance(node, ast.Attribute) and node.attr in PRIVATE:
            base = node.value
            own = isinstance(base, ast.Name) and base.id in ("self", "cls")
            override = (isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id == "super"
                        and function == node.attr)
            if not own and not override:
                found.append(f"{node.lineno}: .{node.attr}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) > 1
              and isinstance(node.args[1], ast.Constant) and node.args[1].value in PRIVATE):
            found.append(f"{node.lineno}: {node.func.id}(..., {node.args[1].value!r})")
        elif isinstance(node, ast.ImportFrom) and _LIGHTNING_PATH.match(f"{node.module}._x") and any(
                a.name.startswith("_") for a in node.names):
            found.append(f"{node.lineno}: from {node.module} import {', '.join(a.name for a in node.names)}")
        elif isinstance(node, ast.ImportFrom | ast.Import) and any(
                _LIGHTNING_PATH.match(name) for name in [getattr(node, "module", None) or "",
                                                          *(a.name for a in node.names)]):
            found.append(f"{node.lineno}: a private Lightning module")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _LIGHTNING_PATH.match(node.value):
            found.append(f"{node.lineno}: {node.value!r}")
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and node.value.value is None and any(
                isinstance(t, ast.Attribute) and t.attr.startswith("on_") for t in node.targets):
            found.append(f"{node.lineno}: a hook switched off")  # Lightning's callback loop skips a None hook
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
              and len(node.args) == 3 and isinstance(node.args[2], ast.Constant) and node.args[2].value is None):
            found.append(f"{node.lineno}: setattr(..., None): a hook switched off?")
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(ast.parse(path.read_text(encoding="utf-8")), None)
    return found


def test_the_scan_sees_lightnings_private_names():
    assert {"_batches_that_stepped", "_signal_connector", "_prepare_dataloader", "_restart_stage"} <= PRIVATE


def test_no_module_outside_the_seam_reaches_lightnings_private_state():
    reached = {str(p.relative_to(ROOT)): _reaches(p) for p in MODULES if not str(p.relative_to(ROOT)).startswith(SEAM)}
    assert {path: where for path, where in reached.items() if where and path not in PENDING} == {}


def _lightning_overrides(cls: type) -> list[str]:
    """The private names ``cls`` defines itself that a Lightning class among its bases has too."""
    bases = [b for b in cls.__mro__[1:] if b.__module__.split(".")[0] in ("lightning", "lightning_fabric")]
    return [name for name in vars(cls) if name.startswith("_") and not name.startswith("__") and name != "_abc_impl"
            and any(name in vars(b) or name in _init_names(b) for b in bases)]


def _init_names(cls: type) -> tuple[str, ...]:
    code = getattr(vars(cls).get("__init__"), "__code__", None)
    return code.co_names if code is not None else ()


def test_overrides_of_lightnings_private_methods_are_in_the_seams_table():
    """A class outside the seam that overrides a private method of Lightning's (a subclass of its strategy, of
    ModelCheckpoint, ...) names it in ``check.OVERRIDDEN``, so the start-up check sees a rename upstream."""
    listed = {name for names in OVERRIDDEN.values() for name in names}
    unlisted = []
    for path in MODULES:
        where = str(path.relative_to(ROOT))
        if where.startswith(SEAM) or where in PENDING or "ddp_recipes/gpu" in where:
            continue
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        module = importlib.import_module(name)
        for cls in vars(module).values():
            if isinstance(cls, type) and cls.__module__ == module.__name__:
                unlisted += [f"{where} {cls.__name__}.{n}" for n in _lightning_overrides(cls) if n not in listed]
    assert unlisted == []


# ---- the start-up check, each assumption broken in turn --------------------------------------------------------

def _calls_every_hook(trainer, hook_name, *args, **kwargs):  # a _call_callback_hooks that calls None too
    for callback in trainer.callbacks:
        getattr(callback, hook_name)(trainer, trainer.lightning_module, *args, **kwargs)


BREAK = {  # how a release could move each assumption, done to a real Trainer (or the class it is made of)
    "_TrainingEpochLoop._batches_that_stepped":
        lambda t, mp: mp.delattr(t.fit_loop.epoch_loop, "_batches_that_stepped"),
    "_TrainingEpochLoop._num_ready_batches_reached()":
        lambda t, mp: mp.delattr(_TrainingEpochLoop, "_num_ready_batches_reached"),
    "_FitLoop._restart_stage": lambda t, mp: mp.delattr(t.fit_loop, "_restart_stage"),
    "_FitLoop._combined_loader/_data_fetcher/_load_combined_loader_states()":
        lambda t, mp: mp.delattr(_FitLoop, "_load_combined_loader_states"),
    "_FitLoop._iteration_based_training()/_TrainingEpochLoop._should_check_val_fx(data_fetcher)":
        lambda t, mp: mp.setattr(_TrainingEpochLoop, "_should_check_val_fx", lambda self: False),
    "_FitLoop._can_stop_early": lambda t, mp: mp.delattr(_FitLoop, "_can_stop_early"),
    "fabric.utilities.data._set_sampler_epoch": lambda t, mp: mp.delattr(fabric_data, "_set_sampler_epoch"),
    "_TrainingEpochLoop._broadcast_sigterm_tensor()":
        lambda t, mp: mp.delattr(_TrainingEpochLoop, "_broadcast_sigterm_tensor"),
    "_TrainingEpochLoop._results": lambda t, mp: mp.delattr(t.fit_loop.epoch_loop, "_results"),
    "_LoggerConnector._logged_metrics/should_update_logs":
        lambda t, mp: mp.delattr(t._logger_connector, "_logged_metrics"),
    "_SignalConnector": lambda t, mp: mp.setattr(t, "_signal_connector", object()),
    "_CheckpointConnector._parse_ckpt_path/resume_start/_loaded_checkpoint":
        lambda t, mp: mp.setattr(_CheckpointConnector, "_parse_ckpt_path", lambda self, ckpt_path: ckpt_path),
    "_DataConnector._prepare_dataloader/utilities.data._update_dataloader":
        lambda t, mp: mp.delattr(_DataConnector, "_prepare_dataloader"),
    "_AcceleratorConnector.cluster_environment/is_distributed/use_distributed_sampler":
        lambda t, mp: mp.delattr(t._accelerator_connector, "use_distributed_sampler"),
    "trainer.call._call_callback_hooks skipping a hook that is not callable":
        lambda t, mp: mp.setattr(call, "_call_callback_hooks", _calls_every_hook),
    "DDPStrategy/ModelCheckpoint/ExperimentWriter private methods (OVERRIDDEN), DDPStrategy._ddp_kwargs":
        lambda t, mp: mp.delattr(ModelCheckpoint, "_save_topk_checkpoint"),
    "_SubprocessScriptLauncher._call_children_scripts/_set_num_threads_if_needed":
        lambda t, mp: mp.delattr(_SubprocessScriptLauncher, "_call_children_scripts"),
    "utilities.logger._flatten_dict/_convert_params, MLFlowLogger._tracking_uri":
        lambda t, mp: mp.delattr(fabric_logger, "_flatten_dict"),
}


def test_every_assumption_has_a_way_to_break_it():
    assert sorted(a.what for a in ASSUMPTIONS) == sorted(BREAK)


@pytest.fixture(scope="module")
def trainer():
    return cpu_trainer()


def test_an_unmoved_lightning_passes(trainer):
    assert broken(trainer) is None
    check_lightning(trainer)


@pytest.mark.parametrize("assumption", ASSUMPTIONS, ids=[a.what for a in ASSUMPTIONS])
def test_a_moved_assumption_stops_with_one_line(trainer, monkeypatch, assumption):
    BREAK[assumption.what](trainer, monkeypatch)
    assert broken(trainer) is assumption
    with pytest.raises(ConfigError) as err:
        check_lightning(trainer)
    line = err.value.cli()
    assert line == str(err.value) and "\n" not in line
    assert f"lightning {L.__version__} changed {assumption.what}" in line
    assert assumption.guarantee in line and admitted_lightning() in line


def test_the_fix_names_the_range_this_install_admits():
    # the package metadata's requirement, as pyproject.toml writes it
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    spec = re.search(r'"lightning([^"]*)"', pyproject).group(1)
    assert admitted_lightning().removeprefix("lightning") in (spec, ",".join(sorted(spec.split(","))))


# ---- end to end: a moved assumption stops a run before its first step ----------------------------------------

def test_a_recipe_stops_before_its_first_step(mnist_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.delattr(_TrainingEpochLoop, "_num_ready_batches_reached")
    out = tmp_path / "out"
    line = refused_mnist(["--data-dir", str(mnist_dir), "--no-download", "--accelerator", "cpu", "--max-steps", "2",
                          "--output-dir", str(out)], capsys)
    assert f"lightning {L.__version__} changed _TrainingEpochLoop._num_ready_batches_reached()" in line
    assert not list(out.rglob("*.ckpt")), "nothing trained, nothing saved"


def test_a_plain_lightning_trainer_with_the_strategy_stops_before_launch(monkeypatch):
    from ddp_recipes.ddp.strategy import TunedDDPStrategy
    from tests.tiny_modules import tiny_module_and_data

    model, loader = tiny_module_and_data()
    plain = cpu_trainer(strategy=TunedDDPStrategy(), max_steps=1)
    monkeypatch.delattr(plain.fit_loop.epoch_loop, "_batches_that_stepped")
    with pytest.raises(ConfigError, match="changed _TrainingEpochLoop._batches_that_stepped"):
        plain.fit(model, loader)
    assert plain.global_step == 0


def test_a_checkpoint_route_resolves_the_path_and_decides_the_file(tmp_path):
    """The seam's checkpoint route (the run folder's rank-0 decision goes through it): ``parse`` sees the fit's
    ``ckpt_path`` with Lightning's own resolution at hand, ``resume`` gives the file every rank loads."""
    from ddp_recipes.lightning_seam.connectors import install_checkpoint_route
    from tests.tiny_modules import tiny_module_and_data

    model, loader = tiny_module_and_data()
    first = cpu_trainer(max_steps=2)
    first.fit(model, loader)
    first.save_checkpoint(tmp_path / "a.ckpt")
    seen: list[tuple[str, object]] = []

    class Route:
        def parse(self, trainer, state_fn, ckpt_path, default):
            seen.append(("parse", ckpt_path))
            return default(str(tmp_path / "a.ckpt")) if ckpt_path == "mine" else default(ckpt_path)

        def resume(self, trainer, checkpoint_path):
            seen.append(("resume", checkpoint_path))
            return checkpoint_path

    model, loader = tiny_module_and_data()
    second = cpu_trainer(max_steps=3)
    install_checkpoint_route(second, Route())
    second.fit(model, loader, ckpt_path="mine")
    assert seen == [("parse", "mine"), ("resume", str(tmp_path / "a.ckpt"))]
    assert second.global_step == 3  # continued from step 2


def test_an_install_without_lightnings_sources_passes(trainer, monkeypatch):
    """Slim images ship Lightning as .pyc only, where reading a function's source raises OSError: the check reads
    what Lightning does, not how its source is written, and lets a Lightning that keeps every assumption run."""
    import inspect

    def no_source(obj):
        raise OSError("could not get source code")

    monkeypatch.setattr(inspect, "getsource", no_source)
    assert broken(trainer) is None


def test_a_checkout_run_without_install_names_the_range_too(monkeypatch):
    """The lent machine's stack (make test-stack) runs the pack from its checkout, not installed: no package
    metadata. The fix still names the range, from the checkout's pyproject.toml, as a pip argument."""
    import importlib.metadata

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "requires", not_installed)
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert admitted_lightning() == "lightning" + re.search(r'"lightning([^"]*)"', pyproject).group(1)
