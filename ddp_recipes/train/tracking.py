"""Experiment tracking: the run's loggers (``--logger csv,tensorboard,mlflow,wandb``) and one tracker run
per job, across preemption and ``--resume``.

Each tracker is Lightning's own logger class, so only global rank 0 writes: Lightning gives every other
rank a no-op experiment (W&B opens one run, not one per rank). The tracker packages are optional extras;
a missing one is a one-line :class:`~ddp_recipes.errors.ConfigError` naming the extra, raised while the
Trainer is built, before any process is launched.

One job, one tracker run: :class:`TrackerRun` records each logger's run identity in every checkpoint
(CSV/TensorBoard version folder, MLflow run id and tracking URI, W&B run id and project). A run resumed
from that checkpoint (``--resume``) logs into the same tracker run, its steps continuing from the
checkpoint's; a run started without ``--resume`` gets a new version or run. Resuming with other trackers
than the checkpoint's fails in one line.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from typing import Any

import lightning as L
from lightning.pytorch.loggers import CSVLogger, Logger, MLFlowLogger, TensorBoardLogger, WandbLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from ddp_recipes.checkpointing.checkpoint import TrainerStateCallback
from ddp_recipes.config.run_config import RunConfig
from ddp_recipes.config.world import will_be_global_zero
from ddp_recipes.errors import ConfigError, lit
from ddp_recipes.extras import install_hint
from ddp_recipes.lightning_seam import reach
from ddp_recipes.storage import is_url, location, same_path
from ddp_recipes.storage.store import cache_dir
from ddp_recipes.train.loggers import ContinuedCSVLogger, ContinuedMLFlowLogger

CSV_DIR = "logs"  # <output-dir>/logs/version_N/metrics.csv; a resume continues a recorded version only here
TENSORBOARD_DIR = "tensorboard"  # <output-dir>/tensorboard/version_N/events.out.tfevents.*
MLFLOW_DB = "mlflow.db"  # the default store: <output-dir>/mlflow.db (MLflow 3 refuses a plain-folder store)

# tracker -> (the modules any one of which it needs, the pip extra that installs them)
_PACKAGES = {"tensorboard": (("tensorboard", "tensorboardX"), "tensorboard"),
             "mlflow": (("mlflow",), "mlflow"), "wandb": (("wandb",), "wandb")}


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # ValueError: set to None in sys.modules, i.e. blocked
        return False


def check_tracker_packages(names: tuple[str, ...]) -> None:
    """A one-line ConfigError naming ``--logger`` and the pip extra when a tracker's package is missing."""
    for name in names:
        modules, extra = _PACKAGES.get(name, ((), ""))
        if modules and not any(_installed(m) for m in modules):
            raise ConfigError(f"{{logger}} {name} needs the {modules[0]} package: "
                              f"{lit(install_hint(extra, modules[0]))}", "logger")


# ---- the loggers ------------------------------------------------------------------------------------------

def build_loggers(cfg: RunConfig, checkpoint: dict[str, Any] | None = None) -> list[Logger] | bool:
    """The loggers ``--logger`` names (False for ``none``); resumed from ``checkpoint``, the same tracker runs
    as the checkpoint's, continuing after its step."""
    names = cfg.trackers
    check_tracker_packages(names)
    recorded = recorded_runs(checkpoint)
    if recorded is not None and set(recorded) != set(names):
        had = ",".join(recorded) or "none"
        raise ConfigError(f"{{logger}} {lit(cfg.logger)} but the checkpoint's run logged to {had}: pass {{logger}} "
                          f"{had} to continue its tracker run(s), or start a new run without {{resume}}", "logger")
    if not names:
        return False
    step = int(checkpoint.get("global_step", 0)) if recorded is not None and checkpoint is not None else None
    builders = {"csv": _csv, "tensorboard": _tensorboard, "mlflow": _mlflow, "wandb": _wandb}
    # MLflow's client opens (and migrates) a SQLite store when it is made: only the rank that logs gets one.
    # The others log nothing anyway, so a shorter list there changes nothing.
    return [builders[name](cfg, (recorded or {}).get(name), step) for name in names
            if name != "mlflow" or logging_rank()]


def logging_rank() -> bool:
    """Whether this process will be global rank 0, the one that logs (see
    :func:`~ddp_recipes.config.world.will_be_global_zero`)."""
    return will_be_global_zero()


def _continued_version(cfg: RunConfig, tracker: str, folder: str, recorded: dict[str, Any] | None) -> Any:
    """The checkpoint's CSV/TensorBoard version to continue, or None for a new one: a checkpoint of another
    output dir (``--resume PATH``) has its version folder there, and this output dir's folder of that number
    is another run's, which continuing would cut at the checkpoint's step."""
    version = recorded.get("version") if recorded else None
    if version is None:
        return None
    theirs = (recorded or {}).get("log_dir")
    mine = os.path.join(cfg.output_dir, folder, version if isinstance(version, str) else f"version_{version}")
    if theirs is None or same_path(str(theirs), mine):
        return version
    rank_zero_warn(f"{tracker}: the checkpoint's run is {theirs}, outside --output-dir {cfg.output_dir}; logging to "
                   f"a new version in {os.path.join(cfg.output_dir, folder)}")
    return None


def _csv(cfg: RunConfig, recorded: dict[str, Any] | None, step: int | None) -> Logger:
    version = _continued_version(cfg, "csv", CSV_DIR, recorded)
    return ContinuedCSVLogger(cfg.output_dir, name=CSV_DIR, version=version,
                              resume_step=step if version is not None else None)


def _tensorboard(cfg: RunConfig, recorded: dict[str, Any] | None, step: int | None) -> Logger:
    version = _continued_version(cfg, "tensorboard", TENSORBOARD_DIR, recorded)
    # purge_step: events a run killed after its last checkpoint logged past it are hidden, so the resumed
    # run's steps are the only ones there. No hp_metric placeholder: TrackerRun writes the hparams session.
    extra = {"purge_step": step + 1} if version is not None and step is not None else {}
    return TensorBoardLogger(cfg.output_dir, name=TENSORBOARD_DIR, version=version, default_hp_metric=False, **extra)


def mlflow_uri(cfg: RunConfig) -> str:
    """``--tracking-uri``, else ``$MLFLOW_TRACKING_URI``, else a SQLite store in the output dir."""
    uri = cfg.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    if is_url(cfg.output_dir):
        raise ConfigError(f"{{logger}} mlflow with {{output_dir}} {lit(cfg.output_dir)}: the default store is a local "
                          "SQLite file; pass {tracking_uri} (a tracking server)", "tracking_uri")
    return "sqlite:///" + os.path.abspath(location(cfg.output_dir) / MLFLOW_DB)  # file:// is a local folder


def _mlflow(cfg: RunConfig, recorded: dict[str, Any] | None, step: int | None) -> Logger:
    uri = mlflow_uri(cfg)
    run_id = recorded.get("run_id") if recorded else None
    if run_id is not None:
        saved_uri = recorded.get("tracking_uri")
        if saved_uri and saved_uri != uri:
            raise ConfigError(f"{{tracking_uri}} {lit(uri)} is not where the checkpoint's MLflow run {run_id} is "
                              f"({lit(saved_uri)}); pass {{tracking_uri}} {lit(saved_uri)} to continue it",
                              "tracking_uri")
        _check_mlflow_run(uri, run_id)
    local = uri.startswith("sqlite:///") and not cfg.tracking_uri and not os.environ.get("MLFLOW_TRACKING_URI")
    # A local store keeps its artifacts beside it (MLflow's default is ./mlruns under the working directory).
    artifacts = "file:" + os.path.abspath(location(cfg.output_dir) / "mlartifacts") if local else None
    return ContinuedMLFlowLogger(experiment_name=cfg.experiment_name, run_name=cfg.run_name, tracking_uri=uri,
                                 run_id=run_id, artifact_location=artifacts)


def _check_mlflow_run(uri: str, run_id: str) -> None:
    """On rank 0, before any process starts: the recorded run must still exist at ``uri``."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    try:
        run = MlflowClient(uri).get_run(run_id)
    except MlflowException as err:
        raise ConfigError(f"{{tracking_uri}} {lit(uri)} has no MLflow run {run_id} (the checkpoint's): "
                          f"{lit(str(err).splitlines()[0])}; point {{tracking_uri}} at its server, or start a new "
                          "run without {resume}", "tracking_uri") from None
    if run.info.lifecycle_stage == "deleted":
        raise ConfigError(f"the checkpoint's MLflow run {run_id} is deleted at {{tracking_uri}} {lit(uri)}; restore "
                          "it (mlflow gc has not run yet) or start a new run without {resume}", "tracking_uri")


def _wandb(cfg: RunConfig, recorded: dict[str, Any] | None, step: int | None) -> Logger:
    project = cfg.wandb_project or cfg.experiment_name
    run_id = recorded.get("id") if recorded else None
    if run_id is not None:
        for name, now in (("wandb_project", project), ("wandb_entity", cfg.wandb_entity)):
            saved = recorded.get(name.removeprefix("wandb_"))
            if saved is not None and now is not None and saved != now:
                raise ConfigError(f"{{{name}}} {lit(now)} but the checkpoint's W&B run {run_id} is in {lit(saved)}; "
                                  f"pass {{{name}}} {lit(saved)} to continue it", name)
    extra: dict[str, Any] = {"entity": cfg.wandb_entity} if cfg.wandb_entity else {}
    save_dir = cfg.output_dir
    if is_url(cfg.output_dir):  # W&B writes a local folder: Path-joined, a URL becomes ./s3:/bucket/... in the cwd
        if cfg.wandb_offline or os.environ.get("WANDB_MODE") in ("offline", "dryrun"):
            raise ConfigError(f"{{logger}} wandb offline with {{output_dir}} {lit(cfg.output_dir)}: an offline W&B "
                              "run is a local folder, which an object store cannot hold; pass a local {output_dir}, "
                              "or drop {wandb_offline} (and WANDB_MODE=offline) to stream the run to the W&B server",
                              "wandb_offline")
        # Online, the folder only stages what W&B streams to its server: $WANDB_DIR, else this process's cache.
        save_dir = os.environ.get("WANDB_DIR") or os.fspath(cache_dir() / "wandb")
    if cfg.wandb_offline:
        # wandb.init's own switch: Lightning's offline=True would set WANDB_MODE in this process's environment.
        extra["mode"] = "offline"
    # resume="allow" (Lightning's): with the checkpoint's id, the same run continues; a new id otherwise.
    return WandbLogger(project=project, name=cfg.run_name, save_dir=save_dir, id=run_id, log_model=False,
                       **extra)


# ---- the run's identity, in the checkpoint -----------------------------------------------------------------

def identity(logger: Logger) -> tuple[str, dict[str, Any]] | None:
    """(tracker name, what names its run) of one of Lightning's loggers; None for any other logger. Rank 0."""
    if isinstance(logger, CSVLogger):
        return "csv", {"version": logger.version, "log_dir": logger.log_dir}
    if isinstance(logger, TensorBoardLogger):
        return "tensorboard", {"version": logger.version, "log_dir": logger.log_dir}
    if isinstance(logger, MLFlowLogger):
        return "mlflow", {"run_id": logger.run_id, "experiment_id": logger.experiment_id,
                          "tracking_uri": reach.tracking_uri(logger)}
    if isinstance(logger, WandbLogger):
        run = logger.experiment
        return "wandb", {"id": logger.version, "project": getattr(run, "project", None) or logger.name,
                         "entity": getattr(run, "entity", None) or None,
                         "dir": os.path.dirname(run.dir) if getattr(run, "dir", None) else None}
    return None


def identities(loggers: list[Logger]) -> dict[str, dict[str, Any]]:
    """Each tracker's run identity (the first logger of each kind). Call on rank 0 only: elsewhere the
    loggers have no run."""
    found: dict[str, dict[str, Any]] = {}
    for logger in loggers:
        named = identity(logger)
        if named is not None:
            found.setdefault(*named)
    return found


def recorded_runs(checkpoint: dict[str, Any] | None) -> dict[str, dict[str, Any]] | None:
    """The tracker runs a checkpoint records (None: it holds no TrackerRun state, e.g. a run with ``--logger
    none`` or a build_trainer script's)."""
    state = ((checkpoint or {}).get("callbacks") or {}).get(TrackerRun.__qualname__)
    if not isinstance(state, dict) or "loggers" not in state:
        return None
    return dict(state["loggers"])


def run_params(cfg: RunConfig) -> dict[str, Any]:
    """The hyper-parameters a run logs once: its resolved config (``--resume`` left out: it says how this
    process started, not what the run is) and the plan it resolved to."""
    config = {k: v for k, v in cfg.to_dict().items() if k != "resume"}
    return {"config": config, "plan": dataclasses.asdict(cfg.plan)}


class TrackerRun(TrainerStateCallback):
    """Records the loggers' run identities in every checkpoint (rank 0's state is the one saved), logs the
    run's config and plan as hyper-parameters once when fitting starts, and marks a continued MLflow run
    running again (a preempted run ended FAILED)."""

    def __init__(self, params: dict[str, Any] | None = None) -> None:
        self.params = params
        self._check_step = False

    @override
    def state_dict(self) -> dict[str, Any]:
        trainer = self._trainer
        if trainer is None or not trainer.is_global_zero:
            return {}
        return {"loggers": identities(trainer.loggers)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass  # read before the Trainer exists (build_loggers), where the loggers are made

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._check_step = trainer.ckpt_path is not None

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self._check_step:  # once per fit, at its first batch: one flag per step otherwise
            self._check_step = False
            align_logging_step(trainer, pl_module)

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        for logger in trainer.loggers:
            if isinstance(logger, ContinuedMLFlowLogger) and logger.continued:
                logger.experiment.update_run(logger.run_id, status="RUNNING")
        if self.params:
            log_params(trainer.loggers, self.params)
        found = identities(trainer.loggers)
        if found:
            rank_zero_info("tracking " + "; ".join(f"{name} {_where(name, run)}" for name, run in found.items()))


def align_logging_step(trainer: L.Trainer, pl_module: L.LightningModule) -> None:
    """Resumed from a checkpoint written where training stopped at an epoch's end (``--max-steps`` reached
    there, or a preemption during that epoch's last validation), Lightning 2.6 restarts with the step it logs
    at (``_batches_that_stepped``) one ahead of ``global_step``: every point of the continued tracker run
    (losses, validation, live metrics) one step later than in the run never stopped, one more per such
    resume. With one optimizer under automatic optimization the two are equal at every batch start."""
    if (pl_module.automatic_optimization and len(trainer.optimizers) == 1
            and reach.batches_that_stepped(trainer) != trainer.global_step):
        reach.set_batches_that_stepped(trainer, trainer.global_step)


def _where(name: str, run: dict[str, Any]) -> str:
    if name == "mlflow":
        return f"run {run['run_id']} at {run['tracking_uri']}"
    if name == "wandb":
        return f"run {run['id']} ({run['project']}{', ' + run['dir'] if run.get('dir') else ''})"
    return str(run["log_dir"])


def log_params(loggers: list[Logger], params: dict[str, Any]) -> None:
    """Log ``params`` to every logger; a TensorBoard logger also gets them as an HParams session (Lightning
    writes one only along with a metric, which would be a -1 placeholder)."""
    for logger in loggers:
        logger.log_hyperparams(params)
        if isinstance(logger, TensorBoardLogger):
            if _installed("tensorboard"):
                from torch.utils.tensorboard.summary import hparams
            else:  # the other package Lightning's TensorBoardLogger runs on
                from tensorboardX.summary import hparams

            flat = reach.sanitized_params(logger, reach.flat_params(params))
            flat = {k: ("None" if v is None else v) for k, v in flat.items()}
            writer = logger.experiment._get_file_writer()
            for summary in hparams(flat, {}):
                writer.add_summary(summary)

