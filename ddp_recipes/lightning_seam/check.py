"""The seam's assumptions about Lightning, checked when the pack builds a Trainer, before any training.

Each row of :data:`ASSUMPTIONS` names what the seam relies on, the guarantee of the pack that rests on it, and a
cheap probe of a real Trainer (an attribute or method is there with the shape the seam uses). A Lightning release
that moved one stops the run with one line: the Lightning version, the guarantee that would be lost and the range
of Lightning this install of the pack admits (read from its package metadata). It never trains on without it.
"""

from __future__ import annotations

import importlib.metadata
import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import lightning as L

from ddp_recipes.errors import ConfigError, lit
from ddp_recipes.lightning_seam.connectors import _CheckpointConnector, _DataConnector, _SignalConnector
from ddp_recipes.lightning_seam.reach import SIGTERM_BROADCAST, Moved, SubprocessScriptLauncher, private


class Assumption(NamedTuple):
    what: str  # the private name(s) of Lightning's, as the message names them
    guarantee: str  # what the pack would lose
    holds: Callable[[Any], bool]  # a probe of a built Trainer


def _takes(fn: Any, *names: str) -> bool:
    """Whether ``fn`` is a function whose parameters include ``names``."""
    return callable(fn) and set(names) <= set(inspect.signature(fn).parameters)


def _sets(cls: Any, name: str) -> bool:
    """Whether ``cls``'s ``__init__`` (or a base's) assigns ``name``: an attribute every instance has."""
    return any(name in getattr(vars(k).get("__init__"), "__code__", None).co_names
               for k in inspect.getmro(cls) if "__init__" in vars(k) and hasattr(vars(k)["__init__"], "__code__"))


def _found(module: str, *names: str) -> bool:
    return all(private(module, n) is not Moved for n in names)


def _skips_uncallable_hooks(trainer: Any) -> bool:
    """Lightning's own dispatch, run on a stand-in trainer whose one callback has the hook set to None (what it
    does, not how its source reads: an install may ship .pyc only)."""
    from types import SimpleNamespace

    from lightning.pytorch.trainer import call

    stand_in = SimpleNamespace(lightning_module=None, callbacks=[SimpleNamespace(seam_probe=None)])
    try:
        call._call_callback_hooks(stand_in, "seam_probe")
    except TypeError:  # it called None
        return False
    return True


#: Lightning's private methods the pack's classes outside this folder override, by the Lightning class that has
#: them (2.6.6): a rename upstream would leave the override never called. What each works around is said where
#: it is written: TunedDDPStrategy (comm hooks on every device, CPU SyncBatchNorm, the observed launcher, the
#: per-device bucket view; no upstream issue found), BestCheckpoint (no top-k ranking before a validation ran;
#: its state under ModelCheckpoint's key), the CSV writer (a resumed run keeps its rows).
OVERRIDDEN = {"lightning.pytorch.strategies:DDPStrategy": ("_configure_launcher", "_setup_model", "_register_ddp_hooks",
                                                           "_layer_sync"),
              "lightning.pytorch.callbacks:ModelCheckpoint": ("_save_topk_checkpoint", "_legacy_state_key"),
              "lightning.pytorch.loggers.csv_logs:ExperimentWriter": ("_check_log_dir_exists",)}


def _overridden_exist(trainer: Any) -> bool:
    for where, names in OVERRIDDEN.items():
        cls = private(*where.split(":"))
        if not all(hasattr(cls, n) or _sets(cls, n) for n in names):
            return False
    return (_sets(private("lightning.pytorch.strategies", "DDPStrategy"), "_ddp_kwargs")
            and _found("lightning.pytorch.overrides.distributed", "_register_ddp_comm_hook"))


_FIT, _EPOCH = (lambda t: t.fit_loop), (lambda t: t.fit_loop.epoch_loop)

ASSUMPTIONS: list[Assumption] = [
    Assumption("_TrainingEpochLoop._batches_that_stepped", "a resumed run logs at the steps of the run never stopped",
               lambda t: isinstance(_EPOCH(t)._batches_that_stepped, int)),
    Assumption("_TrainingEpochLoop._num_ready_batches_reached()", "a run stopped inside an epoch continues exactly",
               lambda t: _takes(_EPOCH(t)._num_ready_batches_reached)),
    Assumption("_FitLoop._restart_stage", "a run continued from final.ckpt trains the rest of its cut epoch",
               lambda t: _FIT(t)._restart_stage is not None
               and hasattr(private("lightning.pytorch.loops.fit_loop", "RestartStage"), "RESTARTED_MID_EPOCH")),
    Assumption("_FitLoop._combined_loader/_data_fetcher/_load_combined_loader_states()",
               "a resumed run's loader continues at its saved position",
               lambda t: all(hasattr(_FIT(t), n) for n in ("_combined_loader", "_data_fetcher"))
               and _takes(_FIT(t)._load_combined_loader_states)),
    Assumption("_FitLoop._iteration_based_training()/_TrainingEpochLoop._should_check_val_fx(data_fetcher)",
               "a run resumed at an epoch end starts the next epoch at its first batch",
               lambda t: _takes(_FIT(t)._iteration_based_training)
               and _takes(_EPOCH(t)._should_check_val_fx, "data_fetcher")),
    Assumption("_FitLoop._can_stop_early", "last.ckpt is written where max_time or should_stop ends the fit",
               lambda t: isinstance(_FIT(t)._can_stop_early, bool)),
    Assumption("fabric.utilities.data._set_sampler_epoch", "each resumed epoch shuffles as in the run never stopped",
               lambda t: _found("lightning.fabric.utilities.data", "_set_sampler_epoch")),
    Assumption(f"_TrainingEpochLoop.{SIGTERM_BROADCAST}()", "a step makes no collective or device read for SIGTERM",
               lambda t: callable(getattr(type(_EPOCH(t)), SIGTERM_BROADCAST, None))),
    Assumption("_TrainingEpochLoop._results", "per-step progress-bar reads are named",
               lambda t: callable(getattr(_EPOCH(t)._results, "values", None))),
    Assumption("_LoggerConnector._logged_metrics/should_update_logs",
               "throughput is logged without a logger save per step, train_loss on log steps only",
               lambda t: isinstance(t._logger_connector._logged_metrics, dict)
               and isinstance(t._logger_connector.should_update_logs, bool)),
    Assumption("_SignalConnector", "a preempted run saves last.ckpt on every rank together, at a step boundary",
               lambda t: isinstance(t._signal_connector, _SignalConnector)
               and all(callable(getattr(_SignalConnector, n, None)) for n in
                       ("register_signal_handlers", "_register_signal", "_get_current_signal_handlers"))),
    Assumption("_CheckpointConnector._parse_ckpt_path/resume_start/_loaded_checkpoint",
               "the checkpoint a run continues is decided once, on rank 0",
               lambda t: isinstance(t._checkpoint_connector, _CheckpointConnector)
               and _takes(t._checkpoint_connector._parse_ckpt_path, "state_fn", "ckpt_path", "model_provided",
                          "model_connected") and _takes(t._checkpoint_connector.resume_start, "checkpoint_path")
               and _sets(_CheckpointConnector, "_loaded_checkpoint")),
    Assumption("_DataConnector._prepare_dataloader/utilities.data._update_dataloader",
               "a user's loader resumes exactly and is evaluated without padded duplicates",
               lambda t: isinstance(t._data_connector, _DataConnector)
               and _takes(t._data_connector._prepare_dataloader, "dataloader", "shuffle", "mode")
               and _found("lightning.pytorch.utilities.data", "_update_dataloader")),
    Assumption("_AcceleratorConnector.cluster_environment/is_distributed/use_distributed_sampler",
               "loaders are sharded as Lightning does and SLURM requeues a preempted job",
               lambda t: all(hasattr(t._accelerator_connector, n) for n in
                             ("cluster_environment", "is_distributed", "use_distributed_sampler"))),
    Assumption("trainer.call._call_callback_hooks skipping a hook that is not callable",
               "a callback hook the run switches off costs nothing per step", _skips_uncallable_hooks),
    Assumption("DDPStrategy/ModelCheckpoint/ExperimentWriter private methods (OVERRIDDEN), DDPStrategy._ddp_kwargs",
               "comm hooks work on every device, DDP is re-wrapped when layers unfreeze, best.ckpt is ranked only "
               "after a validation and a resumed CSV log keeps its rows", _overridden_exist),
    Assumption("_SubprocessScriptLauncher._call_children_scripts/_set_num_threads_if_needed",
               "a rank follows its launcher, and a failing rank's exit code is the run's",
               lambda t: callable(getattr(SubprocessScriptLauncher, "_call_children_scripts", None))
               and _found("lightning.fabric.utilities.distributed", "_set_num_threads_if_needed",
                          "_destroy_dist_connection")),
    Assumption("utilities.logger._flatten_dict/_convert_params, MLFlowLogger._tracking_uri",
               "a job keeps one tracker run across resumes",
               lambda t: _found("lightning.fabric.utilities.logger", "_flatten_dict", "_convert_params")
               and _sets(L.pytorch.loggers.MLFlowLogger, "_tracking_uri")),
]


def admitted_lightning() -> str:
    """The Lightning requirement of this install of the pack (its package metadata), e.g. ``lightning>=2.6.6,<2.7``."""
    try:
        requires = importlib.metadata.requires("ddp-recipes") or []
    except importlib.metadata.PackageNotFoundError:  # run from a checkout, not installed: its pyproject.toml
        requires = _checkout_requires()
    found = [r.split(";")[0].replace(" ", "") for r in requires if r.replace(" ", "").startswith("lightning")
             and r.replace(" ", "")[len("lightning"):][:1] in "<>=!~"]
    return found[0] if found else "the lightning range in ddp-recipes' pyproject.toml"


def _checkout_requires() -> list[str]:
    """The dependencies of the checkout this package runs from (``pyproject.toml`` beside ``ddp_recipes/``)."""
    import tomllib
    from pathlib import Path

    try:
        project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text("utf-8"))["project"]
    except (OSError, ValueError, KeyError):
        return []
    return list(project.get("dependencies", [])) if project.get("name") == "ddp-recipes" else []


def broken(trainer: Any) -> Assumption | None:
    """The first assumption ``trainer``'s Lightning breaks (None: all hold)."""
    for assumption in ASSUMPTIONS:
        try:
            if not assumption.holds(trainer):
                return assumption
        except Exception:  # noqa: BLE001 - a probe that cannot even run is an assumption gone
            return assumption
    return None


def check_lightning(trainer: Any) -> None:
    """Raise a one-line :class:`~ddp_recipes.errors.ConfigError` when the installed Lightning broke one of the
    seam's assumptions: its version, the guarantee that would be lost, the Lightning this pack admits."""
    moved = broken(trainer)
    if moved is not None:
        raise ConfigError(lit(f"lightning {L.__version__} changed {moved.what}, which ddp-recipes relies on so that "
                              f"{moved.guarantee}: install a Lightning this ddp-recipes admits (pip install "
                              f"'{admitted_lightning()}')"))


class CheckedLaunch:
    """A launcher's ``launch`` that checks the trainer first: a Trainer built without ``build_trainer`` (plain
    Lightning, LightningCLI) with the pack's strategy is checked before any rank starts. Picklable."""

    def __init__(self, launcher: Any) -> None:
        self.launcher = launcher

    def __call__(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        if trainer is not None:
            check_lightning(trainer)
        return type(self.launcher).launch(self.launcher, function, *args, trainer=trainer, **kwargs)


def check_at_launch(launcher: Any) -> None:
    """Have ``launcher`` check the trainer it launches (see :class:`CheckedLaunch`)."""
    if launcher is not None and not isinstance(vars(launcher).get("launch"), CheckedLaunch):
        launcher.launch = CheckedLaunch(launcher)
