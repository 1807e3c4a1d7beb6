"""Every read and write of Lightning's private state, as small named functions.

One comment a touch: what it works around; the upstream issue or PR ("no upstream issue found" where there is
none); the Lightning versions it was checked on. A private function or class is looked up when used
(:func:`private`), so a release that moved one fails :func:`~ddp_recipes.lightning_seam.check.check_lightning`
with one line instead of an ImportError at import time.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from typing import Any

CHECKED_ON = "2.6.6"  # the Lightning versions every touch below was checked on


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


# ---- private classes the pack subclasses ------------------------------------------------------------------

# The launcher behind --devices N (2.6.6): ObservedLauncher re-runs its launch body with the pack's observer.
# No upstream issue found (Lightning's observer SIGKILLs rank 0 with exit 1 when a child fails first).
SubprocessScriptLauncher = private("lightning.pytorch.strategies.launchers", "_SubprocessScriptLauncher")


# ---- the fit loop and its epoch loop ----------------------------------------------------------------------

def batches_that_stepped(trainer: Any) -> int:
    """The step Lightning logs at. (2.6.6) Lightning#12274 / PR#13467 restore it; at an epoch-end resume it
    still runs one ahead of ``global_step`` (no upstream issue found)."""
    return trainer.fit_loop.epoch_loop._batches_that_stepped


def set_batches_that_stepped(trainer: Any, step: int) -> None:
    """Put the logging step back on ``step`` (see :func:`batches_that_stepped`)."""
    trainer.fit_loop.epoch_loop._batches_that_stepped = step


def epoch_batches_done(trainer: Any) -> bool:
    """Whether the epoch ran to its last batch. (2.6.6) Lightning counts an epoch cut by max_steps/max_time as
    done; related: Lightning#19367, #19815 (mid-epoch restart off by one)."""
    return trainer.fit_loop.epoch_loop._num_ready_batches_reached()


def restart_stage_none(trainer: Any) -> bool:
    """Whether the fit loop restored no restart stage (2.6.6; stages since PR#20379, no upstream issue found
    for the ``final.ckpt`` restart that skips the cut epoch's rest)."""
    from lightning.pytorch.loops.fit_loop import RestartStage

    return trainer.fit_loop._restart_stage == RestartStage.NONE


def restart_mid_epoch(trainer: Any) -> None:
    """Give the fit loop the restart stage of a mid-epoch checkpoint (see :func:`restart_stage_none`)."""
    from lightning.pytorch.loops.fit_loop import RestartStage

    trainer.fit_loop._restart_stage = RestartStage.RESTARTED_MID_EPOCH


def train_loaders(trainer: Any) -> list[Any]:
    """The loaders of the fit loop's ``setup_data()`` (2.6.6: built before the loop state is restored, so a
    saved loader position is never loaded; no upstream issue found)."""
    combined = trainer.fit_loop._combined_loader
    return list(combined.flattened) if combined is not None else []


def train_fetcher(trainer: Any) -> Any:
    """The fit loop's data fetcher (None before ``setup_data()``). 2.6.6."""
    return trainer.fit_loop._data_fetcher


def load_skipped_loader_states(trainer: Any) -> None:
    """Load the checkpoint's loader states Lightning kept pending (no-op when loaded or none). 2.6.6."""
    trainer.fit_loop._load_combined_loader_states()


def iteration_based(trainer: Any) -> bool:
    """Whether the fit is bounded by steps (2.6.6: an epoch-end restart counts the epoch processed twice;
    no upstream issue found)."""
    return trainer.fit_loop._iteration_based_training()


def validation_due(trainer: Any, fetcher: Any) -> bool:
    """Whether the epoch's validation is still to run at a restart on its last batch (2.6.6: Lightning trains
    one more batch in a finished epoch that has no validation; no upstream issue found)."""
    return trainer.fit_loop.epoch_loop._should_check_val_fx(fetcher)


def can_stop_early(trainer: Any) -> bool:
    """Whether ``should_stop`` ends the fit now (min_epochs/min_steps met). 2.6.6; no public equivalent."""
    return bool(trainer.fit_loop._can_stop_early)


def set_sampler_epoch(loader: Any, epoch: int) -> None:
    """``set_epoch`` on the loader's sampler(s), as Lightning does (2.6.6: after an epoch-end resume Lightning
    gives the count of processed epochs, one ahead; no upstream issue found)."""
    private("lightning.fabric.utilities.data", "_set_sampler_epoch")(loader, epoch)


#: Lightning's per-step SIGTERM broadcast, a method of ``_TrainingEpochLoop`` (Lightning#21487, from PR#20825).
SIGTERM_BROADCAST = "_broadcast_sigterm_tensor"


def replace_sigterm_broadcast(trainer: Any, replacement: Callable[[], None]) -> None:
    """Put ``replacement`` in place of this trainer's per-step SIGTERM broadcast (a collective and a ``.item()``
    per step at 2+ ranks; Lightning#21487). 2.6.6."""
    loop = trainer.fit_loop.epoch_loop
    if callable(getattr(type(loop), SIGTERM_BROADCAST, None)):
        setattr(loop, SIGTERM_BROADCAST, replacement)  # this trainer's loop only


def epoch_results(trainer: Any) -> list[Any]:
    """The training epoch's logged results (2.6.6: the cached prog_bar values Lightning reads with ``.item()``
    every batch end; no upstream issue found)."""
    return list(trainer.fit_loop.epoch_loop._results.values())


# ---- the trainer's connectors -----------------------------------------------------------------------------

def record_logged_metrics(trainer: Any, metrics: dict[str, float]) -> None:
    """Add ``metrics`` to ``trainer.logged_metrics`` without Lightning's ``logger.save()`` per call (2.6.6;
    ``_LoggerConnector.log_metrics`` saves every logger each call; no upstream issue found)."""
    trainer._logger_connector._logged_metrics.update(metrics)


def logs_this_step(trainer: Any) -> bool:
    """Lightning's own test for "the logger writes this step" (log_every_n_steps). 2.6.6; no public equivalent."""
    connector = getattr(trainer, "_logger_connector", None)
    return connector is None or bool(getattr(connector, "should_update_logs", True))


def loaded_checkpoint(trainer: Any) -> dict[str, Any]:
    """The checkpoint Lightning loaded for this fit, before it restores the loops ({} when none). 2.6.6."""
    return getattr(trainer._checkpoint_connector, "_loaded_checkpoint", None) or {}


def cluster_environment(trainer: Any) -> Any:
    """The cluster environment, also of a one-device run (its strategy has none). 2.6.6."""
    return trainer._accelerator_connector.cluster_environment


def is_distributed(trainer: Any) -> bool:
    """Whether Lightning shards the loaders of this trainer. 2.6.6; no public equivalent."""
    return bool(trainer._accelerator_connector.is_distributed)


def uses_distributed_sampler(trainer: Any) -> bool:
    """The Trainer's ``use_distributed_sampler`` argument. 2.6.6; not kept on the Trainer publicly."""
    return bool(trainer._accelerator_connector.use_distributed_sampler)


def silence_litmodels_tip(trainer: Any) -> None:
    """Drop Lightning's pending model-registry advert (2.6.6, printed at fit with its default checkpoint)."""
    if getattr(trainer._callback_connector, "_pending_litmodels_tip", None):
        trainer._callback_connector._pending_litmodels_tip = False


def update_dataloader(loader: Any, sampler: Any, mode: Any) -> Any:
    """``loader`` rebuilt around ``sampler`` with the user's constructor arguments, as Lightning does. 2.6.6."""
    return private("lightning.pytorch.utilities.data", "_update_dataloader")(loader, sampler, mode=mode)


def last_checkpoints_of(callback: Any, trainer: Any) -> set[str]:
    """A ModelCheckpoint's ``last`` files (2.6.6; used to survey a folder's checkpoints)."""
    return callback._find_last_checkpoints(trainer)


# ---- callback hooks switched off --------------------------------------------------------------------------

def switch_off_hook(callback: Any, name: str) -> None:
    """Take ``callback``'s hook ``name`` off Lightning's callback loop for this instance (2.6.6's
    ``_call_callback_hooks`` skips a hook that is not callable): a per-batch hook costs a profiler entry and a
    lookup every batch even when empty. No upstream issue found."""
    setattr(callback, name, None)


def switch_on_hook(callback: Any, name: str) -> None:
    """Undo :func:`switch_off_hook` (the class's hook is seen again)."""
    if vars(callback).get(name, ...) is None:
        delattr(callback, name)


# ---- the strategy and its launcher ------------------------------------------------------------------------

def ddp_kwargs(strategy: Any) -> dict[str, Any] | None:
    """The keyword arguments a DDPStrategy passes to ``DistributedDataParallel`` (None for another strategy).
    2.6.6; no public accessor."""
    return getattr(strategy, "_ddp_kwargs", None)


def rewrap_module(strategy: Any, module: Any) -> None:
    """Wrap ``module`` again in DDP with the strategy's arguments, ``LayerSync`` and comm hook (2.6.6: Lightning
    wraps once; a parameter unfrozen later is never all-reduced; no upstream issue found for BaseFinetuning)."""
    sync = getattr(strategy, "_layer_sync", None)
    if sync is not None:
        module = sync.apply(module)  # in place: the LightningModule and its parameter objects are kept
    strategy.model = strategy._setup_model(module)
    strategy._register_ddp_hooks()


def register_ddp_comm_hook(**kwargs: Any) -> None:
    """Lightning's comm-hook registration, which its DDPStrategy calls only on CUDA (2.6.6; the pack registers
    on every device; no upstream issue found)."""
    private("lightning.pytorch.overrides.distributed", "_register_ddp_comm_hook")(**kwargs)


def wrap_children_start(launcher: Any, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace the subprocess launcher's child start with ``wrap(start)`` (2.6.6: the ranks it starts learn
    their launcher's pid; no upstream issue found)."""
    launcher._call_children_scripts = wrap(launcher._call_children_scripts)


def set_num_threads_if_needed(num_processes: int) -> None:
    """Lightning's per-rank thread budget, as its launcher sets it (2.6.6)."""
    private("lightning.fabric.utilities.distributed", "_set_num_threads_if_needed")(num_processes=num_processes)


def destroy_dist_connection() -> None:
    """Lightning's process-group teardown (2.6.6)."""
    private("lightning.fabric.utilities.distributed", "_destroy_dist_connection")()


def keep_dist_connection_at_exit() -> None:
    """Take Lightning's atexit teardown of the process group off (2.6.6; a failing rank's group stays up,
    torchtitan#1342)."""
    import atexit

    atexit.unregister(private("lightning.fabric.utilities.distributed", "_destroy_dist_connection"))


# ---- loggers, summaries, paths ----------------------------------------------------------------------------

def flat_params(params: Any) -> dict[str, Any]:
    """Hyper-parameters flattened as Lightning's loggers flatten them (2.6.6)."""
    convert = private("lightning.fabric.utilities.logger", "_convert_params")
    return private("lightning.fabric.utilities.logger", "_flatten_dict")(convert(params))


def sanitized_params(logger: Any, flat: dict[str, Any]) -> dict[str, Any]:
    """``flat`` as a TensorBoardLogger writes hyper-parameters (2.6.6)."""
    return logger._sanitize_params(flat)


def tracking_uri(logger: Any) -> str:
    """An MLFlowLogger's tracking URI (2.6.6; no public accessor)."""
    return logger._tracking_uri


def summary_table(*args: Any) -> str:
    """Lightning's model-summary table (2.6.6: its "0 Total Flops" line is dropped by the caller)."""
    return private("lightning.pytorch.utilities.model_summary.model_summary", "_format_summary_table")(*args)


def is_local_path(path: Any) -> bool:
    """Whether Lightning reads ``path`` as a local file (2.6.6)."""
    return private("lightning.fabric.utilities.cloud_io", "_is_local_file_protocol")(path)


@contextlib.contextmanager
def no_ampere_check() -> Iterator[None]:
    """Lightning's peak-FLOPs table without its Ampere test (2.6.6: it reads the live device)."""
    from unittest import mock

    with mock.patch("lightning.fabric.accelerators.cuda._is_ampere_or_later", lambda *_: False):
        yield
