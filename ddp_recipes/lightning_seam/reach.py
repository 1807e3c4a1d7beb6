"""Every read and write of Lightning's private state: each touch says what it works around and its upstream issue
or PR, all checked on Lightning :data:`CHECKED_ON`. Private names are looked up when used (:func:`private`), so a
release that moved one fails :func:`~ddp_recipes.lightning_seam.check.check_lightning`, not the pack's import."""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from typing import Any

CHECKED_ON = "2.6.6"  # the Lightning versions every touch was checked on


class Moved:
    """Stands in for a private Lightning class a release removed (the start-up check names it)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("a private Lightning class the pack relies on has moved: see ddp_recipes.lightning_seam")


def private(module: str, name: str) -> Any:
    """``module.name`` of Lightning, or :class:`Moved` when this release has no such name."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return Moved


# ---- the fit loop and its epoch loop: exact continuation -----------------------------------------------------
# Lightning restarts an epoch cut by max_steps/max_time, or written at its end, off by a batch or an epoch
# (related: Lightning#19367, #19815, #18060; the restart stages of PR#20379; the cases the pack puts right have no
# upstream issue found), and builds the training iterator before it restores the loop state, so a saved loader
# position is never loaded (no upstream issue found).

def batches_that_stepped(trainer: Any) -> int:
    """The step Lightning logs at: PR#13467 restores it (Lightning#12274), one ahead after an epoch-end stop."""
    return trainer.fit_loop.epoch_loop._batches_that_stepped


def set_batches_that_stepped(trainer: Any, step: int) -> None:
    """Put the logging step on ``step``."""
    trainer.fit_loop.epoch_loop._batches_that_stepped = step


def epoch_batches_done(trainer: Any) -> bool:
    """Whether the epoch ran to its last batch (Lightning counts an epoch cut by a limit as done)."""
    return trainer.fit_loop.epoch_loop._num_ready_batches_reached()


def restart_stage_none(trainer: Any) -> bool:
    """Whether the fit loop restored no restart stage."""
    from lightning.pytorch.loops.fit_loop import RestartStage

    return trainer.fit_loop._restart_stage == RestartStage.NONE


def restart_mid_epoch(trainer: Any) -> None:
    """Give the fit loop a mid-epoch checkpoint's restart stage (a ``final.ckpt`` then continues its cut epoch)."""
    from lightning.pytorch.loops.fit_loop import RestartStage

    trainer.fit_loop._restart_stage = RestartStage.RESTARTED_MID_EPOCH


def train_loaders(trainer: Any) -> list[Any]:
    """The loaders of the fit loop's ``setup_data()`` ([] before it)."""
    combined = trainer.fit_loop._combined_loader
    return list(combined.flattened) if combined is not None else []


def train_fetcher(trainer: Any) -> Any:
    """The fit loop's data fetcher (None before ``setup_data()``)."""
    return trainer.fit_loop._data_fetcher


def load_skipped_loader_states(trainer: Any) -> None:
    """Load the checkpoint's loader states Lightning left pending (a no-op when it loaded them, or none)."""
    trainer.fit_loop._load_combined_loader_states()


def iteration_based(trainer: Any) -> bool:
    """Whether steps bound the fit (an epoch-end restart then counts the epoch processed twice)."""
    return trainer.fit_loop._iteration_based_training()


def validation_due(trainer: Any, fetcher: Any) -> bool:
    """Whether the epoch's validation is still to run (else a restart on its last batch trains one batch more)."""
    return trainer.fit_loop.epoch_loop._should_check_val_fx(fetcher)


def can_stop_early(trainer: Any) -> bool:
    """Whether ``should_stop`` ends the fit now (min_epochs/min_steps met); no public equivalent."""
    return bool(trainer.fit_loop._can_stop_early)


def set_sampler_epoch(loader: Any, epoch: int) -> None:
    """``set_epoch`` on the loader's samplers as Lightning calls it (one ahead after an epoch-end resume)."""
    private("lightning.fabric.utilities.data", "_set_sampler_epoch")(loader, epoch)


#: Lightning's per-step SIGTERM broadcast (from PR#20825): a collective and a ``.item()`` per step at 2+ ranks,
#: Lightning#21487. The pack's stop is agreed at step boundaries instead.
SIGTERM_BROADCAST = "_broadcast_sigterm_tensor"


def replace_sigterm_broadcast(trainer: Any, replacement: Callable[[], None]) -> None:
    """Put ``replacement`` in place of this trainer's per-step SIGTERM broadcast (this loop only)."""
    loop = trainer.fit_loop.epoch_loop
    if callable(getattr(type(loop), SIGTERM_BROADCAST, None)):
        setattr(loop, SIGTERM_BROADCAST, replacement)


def epoch_results(trainer: Any) -> list[Any]:
    """The epoch's logged results: prog_bar values Lightning ``.item()``s every batch end (no upstream issue found)."""
    return list(trainer.fit_loop.epoch_loop._results.values())


# ---- the trainer's connectors ---------------------------------------------------------------------------------

def record_logged_metrics(trainer: Any, metrics: dict[str, float]) -> None:
    """Add to ``trainer.logged_metrics`` without a ``logger.save()`` per call (no upstream issue found)."""
    trainer._logger_connector._logged_metrics.update(metrics)


def logs_this_step(trainer: Any) -> bool:
    """Lightning's own test for "the logger writes this step" (log_every_n_steps); no public equivalent."""
    connector = getattr(trainer, "_logger_connector", None)
    return connector is None or bool(getattr(connector, "should_update_logs", True))


def loaded_checkpoint(trainer: Any) -> dict[str, Any]:
    """The checkpoint Lightning loaded for this fit, before it restores the loops ({}: none)."""
    return getattr(trainer._checkpoint_connector, "_loaded_checkpoint", None) or {}


def cluster_environment(trainer: Any) -> Any:
    """The cluster environment, also of a one-device run (whose strategy has none)."""
    return trainer._accelerator_connector.cluster_environment


def is_distributed(trainer: Any) -> bool:
    """Whether Lightning shards this trainer's loaders; no public equivalent."""
    return bool(trainer._accelerator_connector.is_distributed)


def uses_distributed_sampler(trainer: Any) -> bool:
    """The Trainer's ``use_distributed_sampler`` argument, which it does not keep publicly."""
    return bool(trainer._accelerator_connector.use_distributed_sampler)


def silence_litmodels_tip(trainer: Any) -> None:
    """Drop Lightning's model-registry advert, held until fit with its default checkpoint."""
    if getattr(trainer._callback_connector, "_pending_litmodels_tip", None):
        trainer._callback_connector._pending_litmodels_tip = False


def update_dataloader(loader: Any, sampler: Any, mode: Any) -> Any:
    """``loader`` rebuilt around ``sampler`` with the user's constructor arguments, as Lightning rebuilds it."""
    return private("lightning.pytorch.utilities.data", "_update_dataloader")(loader, sampler, mode=mode)


def loader_args_given(loader: Any) -> set[str] | None:
    """The constructor arguments a loader made inside a ``*_dataloader`` hook was given, by name or position, as
    Lightning records them for its rebuild; None for a loader made elsewhere (a default is then no choice)."""
    names = getattr(loader, "__pl_saved_arg_names", None)
    return None if names is None else {*names, *getattr(loader, "__pl_saved_kwargs", {})}


def last_checkpoints_of(callback: Any, trainer: Any) -> set[str]:
    """A ModelCheckpoint's ``last`` files, for the survey of a run's checkpoints."""
    return callback._find_last_checkpoints(trainer)


# ---- callback hooks switched off -----------------------------------------------------------------------------
# Lightning's _call_callback_hooks skips a hook that is not callable: a per-batch hook set to None on the instance
# costs no lookup and no profiler entry per step (no upstream issue found).

def switch_off_hook(callback: Any, name: str) -> None:
    """Take ``callback``'s hook ``name`` off Lightning's callback loop (this instance only)."""
    setattr(callback, name, None)


def switch_on_hook(callback: Any, name: str) -> None:
    """Undo :func:`switch_off_hook`: the class's hook is seen again."""
    if vars(callback).get(name, ...) is None:
        delattr(callback, name)


# ---- the strategy and its launcher ----------------------------------------------------------------------------

# The launcher behind --devices N; the pack's ObservedLauncher re-runs its launch body with its own observer
# (Lightning's SIGKILLs rank 0 with exit 1 when a child fails first; no upstream issue found).
SubprocessScriptLauncher = private("lightning.pytorch.strategies.launchers", "_SubprocessScriptLauncher")


def ddp_kwargs(strategy: Any) -> dict[str, Any] | None:
    """What a DDPStrategy passes to ``DistributedDataParallel`` (None for another strategy); no public accessor."""
    return getattr(strategy, "_ddp_kwargs", None)


def rewrap_module(strategy: Any, module: Any) -> None:
    """Re-wrap ``module`` in DDP as the strategy did: a parameter unfrozen later is all-reduced (no issue found)."""
    sync = getattr(strategy, "_layer_sync", None)
    if sync is not None:
        module = sync.apply(module)  # in place: the LightningModule and its parameter objects are kept
    strategy.model = strategy._setup_model(module)
    strategy._register_ddp_hooks()


def register_ddp_comm_hook(**kwargs: Any) -> None:
    """Lightning's comm-hook registration, which its DDPStrategy calls on CUDA only (no upstream issue found)."""
    private("lightning.pytorch.overrides.distributed", "_register_ddp_comm_hook")(**kwargs)


def wrap_children_start(launcher: Any, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace the subprocess launcher's child start with ``wrap(start)``."""
    launcher._call_children_scripts = wrap(launcher._call_children_scripts)


def set_num_threads_if_needed(num_processes: int) -> None:
    """Lightning's per-rank thread budget, as its launcher sets it."""
    private("lightning.fabric.utilities.distributed", "_set_num_threads_if_needed")(num_processes=num_processes)


def destroy_dist_connection() -> None:
    """Lightning's process-group teardown."""
    private("lightning.fabric.utilities.distributed", "_destroy_dist_connection")()


def keep_dist_connection_at_exit() -> None:
    """Take Lightning's atexit teardown of the group off: a failing rank leaves it to the process's end."""
    import atexit

    atexit.unregister(private("lightning.fabric.utilities.distributed", "_destroy_dist_connection"))


# ---- loggers, summaries, paths --------------------------------------------------------------------------------

def flat_params(params: Any) -> dict[str, Any]:
    """Hyper-parameters flattened as Lightning's loggers flatten them."""
    convert = private("lightning.fabric.utilities.logger", "_convert_params")
    return private("lightning.fabric.utilities.logger", "_flatten_dict")(convert(params))


def sanitized_params(logger: Any, flat: dict[str, Any]) -> dict[str, Any]:
    """``flat`` as a TensorBoardLogger writes hyper-parameters."""
    return logger._sanitize_params(flat)


def tracking_uri(logger: Any) -> str:
    """An MLFlowLogger's tracking URI; no public accessor."""
    return logger._tracking_uri


def summary_table(*args: Any) -> str:
    """Lightning's model-summary table (the caller drops its "0 Total Flops" line)."""
    return private("lightning.pytorch.utilities.model_summary.model_summary", "_format_summary_table")(*args)


def is_local_path(path: Any) -> bool:
    """Whether Lightning reads ``path`` as a local file."""
    return private("lightning.fabric.utilities.cloud_io", "_is_local_file_protocol")(path)


@contextlib.contextmanager
def no_ampere_check() -> Iterator[None]:
    """Lightning's peak-FLOPs table for a named device, without its Ampere test of the live one."""
    from unittest import mock

    with mock.patch("lightning.fabric.accelerators.cuda._is_ampere_or_later", lambda *_: False):
        yield
