"""build_trainer: one call from a single-device script to a correct multi-device Lightning Trainer."""

from __future__ import annotations

import gc
import logging
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.plugins.environments import ClusterEnvironment, KubeflowEnvironment
from lightning.pytorch.callbacks import Checkpoint, ModelSummary, ProgressBar
from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from ddp_recipes.checkpointing.checkpoint import CHECKPOINT_DIR, AtomicCheckpointIO
from ddp_recipes.checkpointing.exact_continuation import PREBUILT, ResumeState
from ddp_recipes.checkpointing.files import see_published
from ddp_recipes.checkpointing.last import LastCheckpoint
from ddp_recipes.checkpointing.position import RunPosition
from ddp_recipes.checkpointing.preemption import AgreedStop
from ddp_recipes.checkpointing.run_folder import ownership
from ddp_recipes.checkpointing.run_folder.resume import check_checkpoint_names, find_last_checkpoint
from ddp_recipes.config.plan import DDPOptions, RunPlan
from ddp_recipes.config.world import (
    check_node_env,
    cuda_devices,
    launched_by_torchrun,
    launched_per_pod,
    will_be_global_zero,
)
from ddp_recipes.data.adopt import adopt_user_loaders
from ddp_recipes.ddp.strategy import TunedDDPStrategy
from ddp_recipes.errors import ConfigError, lit
from ddp_recipes.lightning_seam.check import check_lightning
from ddp_recipes.lightning_seam.reach import silence_litmodels_tip
from ddp_recipes.storage import is_url, location
from ddp_recipes.train.callbacks import BatchFitsData
from ddp_recipes.train.checkpoints import DefaultCheckpoint
from ddp_recipes.train.diagnostics import DDPDiagnostics
from ddp_recipes.train.hooks import SkipUnusedHooks
from ddp_recipes.train.perf import BF16Check, InputWaitProfiler, TF32Setting, configure_tf32
from ddp_recipes.train.progress import LoggedMetricsBar, ModelTable
from ddp_recipes.train.rank_watch import RankWatch


def build_trainer(
    *,
    devices: int | str | list[int] | None = None,
    num_nodes: int | None = None,
    accelerator: str | None = "auto",
    precision: str | int = "32-true",
    sync_batchnorm: bool = False,
    find_unused_parameters: bool = False,
    static_graph: bool = False,
    comm_hook: str = "none",
    bucket_cap_mb: float | None = None,
    seed: int | None = None,
    accumulate_grad_batches: int = 1,
    max_epochs: int | None = None,
    max_steps: int = -1,
    timeout_s: float | str | None = None,
    hang_report_s: float | str | None = None,
    diagnostics: bool = True,
    lr_scaling: str | None = None,
    warmup_epochs: float | None = None,
    reference_batch: int | None = None,
    global_batch: int | None = None,
    tf32: bool = True,
    strategy_kwargs: dict[str, Any] | None = None,
    preemption: bool = True,
    checkpoint_dir: str | None = None,
    checkpoint_every_n_steps: int = 0,
    **trainer_kwargs: Any,
) -> L.Trainer:
    """A Lightning Trainer for ``devices`` x ``num_nodes`` processes.

    One device on one node: no DDP wrap (Lightning's single-device strategy). Otherwise
    :class:`TunedDDPStrategy` with the DDP knobs given here. Works when Lightning launches the processes
    (``devices=N``) and under torchrun (world taken from its environment). ``seed`` seeds every rank
    identically now (identical initial weights and set-up) and with seed + rank when training starts.
    ``diagnostics`` adds :class:`DDPDiagnostics` (the troubleshooting table as checks, reported once on
    rank 0); ``lr_scaling``, ``warmup_epochs``, ``reference_batch`` and ``global_batch`` tell it the run's
    LR facts, so it can warn when the global batch left the reference batch without LR scaling or warm-up
    (left unset, that check is skipped). ``tf32`` runs FP32 matmuls and convolutions as TF32 on Ampere+
    GPUs (no effect on CPU). Unless a ``profiler`` is given, :class:`~ddp_recipes.train.perf.InputWaitProfiler`
    times the loop's wait for each batch. At 2+ ranks, a rank without a finished batch for ``hang_report_s``
    (default: derived from the steps seen; 0: off) writes its stacks under ``<default_root_dir>/stall-reports`` and
    one line names the stuck rank (:mod:`ddp_recipes.train.rank_watch`). Any other keyword goes to
    ``lightning.Trainer``; ``strategy_kwargs`` to TunedDDPStrategy.

    The keywords resolve one :class:`~ddp_recipes.config.plan.RunPlan` (each value checked once, where the
    plan owns it), and the Trainer is built from it by :func:`trainer_for`, the function a recipe's
    resolved config goes to as well.

    Lightning's own spellings are accepted with their meaning: ``devices`` as an int, ``"auto"``, ``"2"``,
    ``"0,1"`` or a list of indices; ``accelerator=None``; ``precision`` 32/16/"bf16"/"bf16-true"...;
    ``callbacks`` and ``plugins`` as one object or a list; any DDPStrategy keyword in ``strategy_kwargs``.

    The run's lifecycle (what ``python -m recipes.X`` gets, on by default): :class:`LastCheckpoint` writes
    ``<checkpoint_dir>/last.ckpt`` (default ``<default_root_dir>/checkpoints``) at every epoch end and every
    ``checkpoint_every_n_steps`` steps; SIGTERM (and SLURM's requeue signal) only set a flag, every rank
    saves at the next step boundary and exits with 128 + signal; ``trainer.fit(..., ckpt_path="last")``
    continues from the newest complete checkpoint (starting fresh when there is none). ``preemption=False``
    leaves ``last.ckpt`` and signals to the caller (Lightning's own handlers run); ``enable_checkpointing=False`` at
    2+ ranks keeps the pack's agreement: a signal stops every rank together, saving nothing.
    Without a checkpoint callback of the caller's, Lightning's default ``ModelCheckpoint()`` is added as Lightning
    adds it (in ``last.ckpt``'s folder): ``trainer.checkpoint_callback`` and ``ckpt_path="best"`` mean what they
    mean to Lightning.
    Training loaders Lightning re-creates get the pack's resumable order and per-sample augmentation
    seeding; evaluation loaders an unpadded shard (:mod:`ddp_recipes.data.adopt`).
    """
    devices, device_ids = _devices(devices, accelerator)
    accelerator = _accelerator(accelerator)
    strategy_kwargs = dict(strategy_kwargs or {})
    if "seed" in strategy_kwargs:  # one seed for the run: the strategy's is build_trainer's
        given = strategy_kwargs.pop("seed")
        if seed is not None and given is not None and seed != given:
            raise ConfigError(f"{{seed}} is set twice with different values ({seed} and {given} in "
                              "strategy_kwargs); set it once")
        seed = given if seed is None else seed
    ddp = DDPOptions(find_unused_parameters=find_unused_parameters, static_graph=static_graph, comm_hook=comm_hook,
                     bucket_cap_mb=bucket_cap_mb, sync_batchnorm=sync_batchnorm, timeout_s=timeout_s,
                     hang_report_s=hang_report_s)
    plan = RunPlan.resolve(devices=devices, num_nodes=num_nodes, accelerator=accelerator, precision=precision,
                           ddp=ddp, accumulate_grad_batches=accumulate_grad_batches, lr_scaling=lr_scaling,
                           max_epochs=max_epochs, max_steps=max_steps, seed=seed, tf32=tf32,
                           diagnostics=diagnostics, warmup_epochs=warmup_epochs, reference_batch=reference_batch)
    if trainer_kwargs.get("strategy") == "auto":
        # Lightning's default, which LightningCLI(trainer_class=build_trainer) passes on every run: "choose for me"
        # is the pack's choice here (TunedDDPStrategy on more than one device), as when it is left out.
        del trainer_kwargs["strategy"]
    if device_ids is not None:
        trainer_kwargs["devices"] = device_ids if plan.accelerator == "cuda" else len(device_ids)
    lifecycle = Lifecycle(preemption, checkpoint_dir, checkpoint_every_n_steps, prebuilt=models_built_before(seed),
                          library=True)
    return trainer_for(plan, lifecycle=lifecycle, global_batch=global_batch, strategy_kwargs=strategy_kwargs,
                       **trainer_kwargs)


def trainer_for(plan: RunPlan, *, lifecycle: Lifecycle | None = None, global_batch: int | None = None,
                strategy_kwargs: dict[str, Any] | None = None, **trainer_kwargs: Any) -> L.Trainer:
    """The Trainer of a resolved :class:`~ddp_recipes.config.plan.RunPlan`: what :func:`build_trainer` ends in
    and what a recipe's ``cfg.plan`` goes to (``ddp_recipes.train.run.make_trainer``). The plan decides the
    world, precision, accumulation and limits: a ``trainer_kwargs`` entry for one of those is Lightning's
    "multiple values" TypeError. ``global_batch`` (for the diagnostics) is the plan's batch plan's when it has one.
    """
    check_node_env(plan.num_nodes, plan.accelerator)  # here, not in the plan: a config may be made on any machine
    configure_tf32(plan.tf32, plan.accelerator)
    if plan.batch is not None:
        global_batch = plan.batch.global_batch
    if trainer_kwargs.get("profiler") is None:  # None is Lightning's default (LightningCLI passes it): no profiler
        trainer_kwargs["profiler"] = InputWaitProfiler()
    if plan.seed is not None:
        # Same seed on every rank before the model is built: identical initial weights everywhere.
        L.seed_everything(plan.seed, workers=True, verbose=False)

    plugins = _as_list(trainer_kwargs.pop("plugins", None), "plugins")
    own_io = next((p for p in plugins if isinstance(p, CheckpointIO)), None)
    if own_io is None:
        plugins.append(AtomicCheckpointIO())  # a kill mid-save keeps the previous checkpoint intact
    elif not isinstance(own_io, AtomicCheckpointIO):
        rank_zero_warn(f"plugins: {type(own_io).__name__} replaces the pack's AtomicCheckpointIO: saves are no longer "
                       "atomic (a kill mid-save can leave a truncated last.ckpt) and on object storage no manifest is "
                       'written for ckpt_path="last" to find; subclass AtomicCheckpointIO to keep both')
    if launched_per_pod() and plan.distributed and not any(isinstance(p, ClusterEnvironment) for p in plugins):
        # One process per pod (RANK/WORLD_SIZE from the operator, no torchrun): Lightning does not detect
        # Kubeflow's environment and would take every pod for node 0; this one reads RANK as the pod's rank.
        plugins.append(KubeflowEnvironment())
    callbacks = _as_list(trainer_kwargs.pop("callbacks", None), "callbacks")
    # enable_checkpointing=False (the bench, evaluation): Lightning refuses any Checkpoint callback then.
    checkpointing = trainer_kwargs.get("enable_checkpointing", True) is not False
    # Lightning adds its own ModelCheckpoint() only to a Trainer with no Checkpoint callback, and LastCheckpoint is
    # one: without this a script's ckpt_path="best" and trainer.checkpoint_callback.best_model_path would fail.
    theirs = [c for c in callbacks if isinstance(c, Checkpoint) and not isinstance(c, LastCheckpoint)]
    lightning_default = lifecycle is not None and lifecycle.library and checkpointing and not theirs
    last = lifecycle.callback(callbacks) if lifecycle is not None and checkpointing else None
    if last is not None:
        # After every ModelCheckpoint (Lightning keeps the Checkpoints' order): trainer.checkpoint_callback is then
        # the ModelCheckpoint, as in Lightning, and a save of theirs at the same boundary lands in last.ckpt's
        # copy of their state, so a resumed run knows the files they wrote.
        callbacks.remove(last)
        callbacks.append(last)
    if plan.distributed and (lifecycle is None or lifecycle.preemption) and not any(isinstance(c, AgreedStop)
                                                                                   for c in callbacks):
        # No last.ckpt (enable_checkpointing=False): still no SIGTERM broadcast and read before every step.
        # preemption=False is the caller's promise to handle signals with Lightning's own handlers: left to them.
        callbacks.append(AgreedStop())
    if plan.accelerator == "cuda":
        callbacks.append(TF32Setting(plan.tf32))  # again in each rank: spawned ranks do not inherit it
        if not plan.distributed:
            callbacks.append(BF16Check())  # TunedDDPStrategy checks in its ranks; one device has Lightning's strategy
    if trainer_kwargs.get("enable_progress_bar", True) is not False and not any(isinstance(c, ProgressBar)
                                                                                for c in callbacks):
        # Lightning's default bar redraws every step (more host time than an MNIST-MLP step) and its loss
        # would be a device read per step; this one shows the logger's value, every 20 steps. A user's own
        # bar replaces it: Lightning refuses two.
        callbacks.insert(0, LoggedMetricsBar(refresh_rate=20))
    if trainer_kwargs.get("enable_model_summary", True) is not False and not any(isinstance(c, ModelSummary)
                                                                                  for c in callbacks):
        # Lightning's table without its "0 Total Flops" (not counted); Lightning's own default is then off, or
        # it would say at every start that it skipped it.
        callbacks.append(ModelTable())
        trainer_kwargs["enable_model_summary"] = False
    if not any(isinstance(c, ResumeState) for c in callbacks):
        # Per-rank streams from seed + rank once training starts; a resumed run gets the checkpoint's
        # streams, loader position and comm-hook state back instead (and this run's LRs).
        callbacks.append(ResumeState(seed=plan.seed, prebuilt=lifecycle.prebuilt if lifecycle is not None else None))
    if not any(isinstance(c, BatchFitsData) for c in callbacks):
        callbacks.append(BatchFitsData())
    if not any(isinstance(c, RunPosition) for c in callbacks):
        # After ResumeState (which repositions the loader): a resumed run that would repeat, skip or overrun
        # batches fails at once instead of ending with more steps than its limit.
        callbacks.append(RunPosition())
    if plan.diagnostics and not any(isinstance(c, DDPDiagnostics) for c in callbacks):
        callbacks.append(DDPDiagnostics(lr_scaling=plan.lr_scaling, warmup_epochs=plan.warmup_epochs,
                                        reference_batch=plan.reference_batch, global_batch=global_batch,
                                        library=lifecycle is not None and lifecycle.library))
    if plan.distributed and not any(isinstance(c, RankWatch) for c in callbacks):
        # After DDPDiagnostics, which reports its straggler finding; the hang report needs no diagnostics.
        library = lifecycle is not None and lifecycle.library
        callbacks.append(RankWatch(plan.ddp.hang_report_s, plan.ddp.timeout_s,
                                   "build_trainer(hang_report_s=...)" if library else "--hang-report-s"))
    if not any(isinstance(c, SkipUnusedHooks) for c in callbacks):
        callbacks.append(SkipUnusedHooks())  # no callback's empty per-batch hooks on the step's path
    ddp = plan.ddp
    if "strategy" not in trainer_kwargs:
        if plan.distributed:
            trainer_kwargs["strategy"] = TunedDDPStrategy.from_options(ddp, seed=plan.seed, **(strategy_kwargs or {}))
        else:
            if ddp.comm_hook != "none" or ddp.find_unused_parameters or ddp.sync_batchnorm:
                rank_zero_info("1 device: no DDP wrap, so --comm-hook, --find-unused-parameters and "
                               "--sync-batchnorm have nothing to do.")
            trainer_kwargs["strategy"] = "auto"
    trainer_kwargs.setdefault("devices", plan.devices)
    with without_adverts():
        trainer = L.Trainer(
            accelerator="gpu" if plan.accelerator == "cuda" else "cpu",
            num_nodes=plan.num_nodes,
            precision=plan.precision,
            sync_batchnorm=ddp.sync_batchnorm and plan.distributed,
            accumulate_grad_batches=plan.accumulation,
            max_epochs=plan.max_epochs,
            max_steps=plan.max_steps,
            plugins=plugins,
            callbacks=callbacks,
            **trainer_kwargs,
        )
    # the same advert for Lightning's model registry, held until fit (only set with its default checkpoint)
    silence_litmodels_tip(trainer)
    check_lightning(trainer)  # before anything is written or launched: one line if Lightning moved
    if last is not None and last.dirpath is None:
        last.dirpath = location(trainer.default_root_dir) / CHECKPOINT_DIR
    if last is not None and lifecycle is not None and lifecycle.library:  # a recipe proved its --output-dir already
        refuse_unwritable(last.dirpath, "checkpoint_dir" if lifecycle.checkpoint_dir else "default_root_dir")
    if last is not None and lightning_default:
        # Lightning's default (no monitor, save_top_k=1: "best" is the newest epoch's), in last.ckpt's folder
        # rather than the logger's version folder: a run continued with ckpt_path="last" gets a new version folder,
        # where Lightning would drop the restored state (top-k files, best_model_score) with a warning.
        trainer.callbacks.insert(trainer.callbacks.index(last), DefaultCheckpoint(dirpath=str(last.dirpath)))
    if last is not None:
        check_checkpoint_names(trainer.callbacks, last)  # the dirpaths given; the others when fit sets them
    see_published(trainer.checkpoint_callbacks)  # ModelCheckpoint's version counter on a URL
    if lifecycle is not None:  # a recipe's loaders are resumable already and left alone; a user's are adopted
        adopt_user_loaders(trainer)
        find_last_checkpoint(trainer)
    return trainer


def refuse_unwritable(folder: Any, param: str) -> None:
    """The checkpoint folder of a ``build_trainer`` run, on the process that will write it (rank 0), before any
    rank starts: a local folder that cannot be made or written (a read-only mount, another user's folder) is one
    ``ConfigError`` naming ``param``, not an ``OSError`` on rank 0 when the run starts. Nothing is created: the
    nearest existing folder is asked (a URL is checked by its store when the run starts)."""
    if is_url(folder) or not will_be_global_zero():
        return
    existing = Path(os.path.abspath(folder))
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if existing.is_dir() and os.access(existing, os.W_OK | os.X_OK):
        return
    why = "not a folder" if not existing.is_dir() else (
        "read-only file system" if os.statvfs(existing).f_flag & os.ST_RDONLY else "permission denied")
    raise ConfigError(f"{{{param}}}: the checkpoint folder {lit(folder)} cannot be written ({why} at {lit(existing)}); "
                      f"pass a writable {{{param}}}", param)


class _NoAdverts(logging.Filter):
    @override
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("💡 Tip:")


@contextmanager
def without_adverts() -> Iterator[None]:
    """Lightning's "💡 Tip: ... try installing litlogger" lines, which it prints when a Trainer is made, left out
    while build_trainer makes one (and only then: the logger's filters are as they were afterwards)."""
    from lightning_utilities.core import rank_zero

    logger = rank_zero.log  # where every rank_zero_info of Lightning goes
    quiet = _NoAdverts()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


class Lifecycle:
    """build_trainer's ``preemption``, ``checkpoint_dir`` and ``checkpoint_every_n_steps`` (a recipe's run: the
    defaults, with its own :class:`LastCheckpoint` among the callbacks)."""

    def __init__(self, preemption: bool = True, checkpoint_dir: str | None = None, every_n_steps: int = 0,
                 prebuilt: str | None = None, library: bool = False) -> None:
        if not isinstance(preemption, bool):
            raise ConfigError(f"{{preemption}} must be True or False (got {lit(repr(preemption))})")
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 0:
            raise ConfigError(f"{{checkpoint_every_n_steps}} must be an integer >= 0 (got {lit(repr(every_n_steps))})")
        self.preemption, self.checkpoint_dir, self.every_n_steps = preemption, checkpoint_dir, every_n_steps
        # the mark of the LightningModules that existed before seed= seeded (models_built_before)
        self.prebuilt = prebuilt
        self.library = library  # a build_trainer script (its messages name arguments), not a recipe (flags)

    def callback(self, callbacks: list[Any]) -> LastCheckpoint | None:
        """The run's LastCheckpoint (the caller's own, else a new one appended); None when opted out."""
        own = next((c for c in callbacks if isinstance(c, LastCheckpoint)), None)
        if own is not None or not self.preemption:
            return own
        last = LastCheckpoint(self.checkpoint_dir or ".", every_n_steps=self.every_n_steps,
                              words=ownership.LIBRARY if self.library else ownership.RECIPE)
        if self.checkpoint_dir is None:
            last.dirpath = None  # set from the Trainer's default_root_dir once it exists
        callbacks.append(last)
        return last


def models_built_before(seed: int | None) -> str | None:
    """Mark the LightningModules alive now, before ``build_trainer(seed=...)`` seeds the random streams: their
    initial weights came from whatever the streams were, and seeding now cannot change them. Returns this
    call's mark (each module's ``PREBUILT`` attribute holds it), or None when there is no seed, or the script
    seeded already (``lightning.seed_everything`` sets ``PL_GLOBAL_SEED``; ``torch.manual_seed`` leaves an
    initial seed below 2**32, which torch's own random 64-bit one almost never is): its models were built from
    a seeded stream. :class:`ResumeState` names such a model when it starts training from scratch, with the
    fix. A mark, not a set of the modules, because it travels with a module pickled into spawned ranks (and
    the Trainer's callbacks must pickle too). Walks the garbage collector's objects once (milliseconds)."""
    if seed is None or os.environ.get("PL_GLOBAL_SEED") is not None or torch.initial_seed() < 2**32:
        return None
    mark = uuid.uuid4().hex
    # type(), not isinstance: some objects (torch.distributed's deprecated reduce_op) warn on __class__ access.
    for obj in gc.get_objects():
        if issubclass(type(obj), L.LightningModule):
            obj.__dict__[PREBUILT] = mark  # a plain attribute: no nn.Module registration, no state_dict entry
    return mark


def _as_list(value: Any, name: str) -> list[Any]:
    """Lightning's ``callbacks``/``plugins``: None, one object or a list of them."""
    if value is None:
        return []
    if isinstance(value, list | tuple):
        return list(value)
    if isinstance(value, str | bytes | dict):
        raise ConfigError(f"{{{name}}} must be one object or a list of them (got {lit(repr(value))})", name)
    return [value]


def _devices(devices: Any, accelerator: Any) -> tuple[int | None, list[int] | None]:
    """Lightning's ``devices`` spellings as (count for the plan, indices for the Trainer or None)."""
    if devices is None:
        return devices, None
    if isinstance(devices, str):
        text = devices.strip()
        if text == "auto":
            if launched_by_torchrun():
                return None, None
            cuda = str(accelerator).lower() in ("auto", "gpu", "cuda", "none") and cuda_devices()
            return (cuda_devices() if cuda else 1), None  # Lightning's CPU "auto" is one process
        if "," in text:
            try:
                devices = [int(part) for part in text.split(",") if part.strip()]
            except ValueError:
                devices = text
        else:
            try:
                devices = int(text)
            except ValueError:
                devices = text
    if isinstance(devices, list | tuple) and devices and all(isinstance(d, int) and not isinstance(d, bool)
                                                              and d >= 0 for d in devices):
        return len(devices), list(devices)
    if isinstance(devices, int) and not isinstance(devices, bool):
        if devices == -1:  # Lightning: every visible device
            if not cuda_devices():
                raise ConfigError("{devices} -1 (every GPU) but torch sees no CUDA device; give a number of "
                                  "CPU processes, e.g. {devices} 2")
            return cuda_devices(), None
        return devices, None
    raise ConfigError(f"{{devices}} must be a number, \"auto\", a numeric string such as \"2\" or \"0,1\", or a list "
                      f"of device indices (got {lit(repr(devices))})")


def _accelerator(accelerator: Any) -> str:
    """None as Lightning's "auto"; a CPU/CUDA Accelerator object by its name."""
    if accelerator is None:
        return "auto"
    if isinstance(accelerator, str):
        return accelerator
    from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator

    if isinstance(accelerator, CPUAccelerator):
        return "cpu"
    if isinstance(accelerator, CUDAAccelerator):
        return "cuda"
    raise ConfigError(f"{{accelerator}} must be one of auto, cpu, gpu, cuda (got {lit(repr(accelerator))})")
