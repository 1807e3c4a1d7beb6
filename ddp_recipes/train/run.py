"""What every recipe does around ``fit``: open the run before it builds anything (the classes it trains, from
``--model-class``/``--datamodule-class`` or a script's, the user's Trainer surface, the checkpoint ``--resume``
names), print the resolved setup once, measure steady-state throughput, log to the ``--logger`` trackers, and
write ``summary.json`` on rank 0 (atomically)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from ddp_recipes.checkpointing import kept
from ddp_recipes.checkpointing.checkpoint import plain_data, read_checkpoint
from ddp_recipes.checkpointing.run_folder.output_dir import discard_unused_output_dirs, output_folder
from ddp_recipes.checkpointing.run_folder.resume import Continue, open_resume, refuse_other_runs
from ddp_recipes.config.cli import fail
from ddp_recipes.config.run_config import RunConfig, changed_fields
from ddp_recipes.data.unreadable import describe as describe_unreadable
from ddp_recipes.errors import ConfigError
from ddp_recipes.storage.retry import StorageError
from ddp_recipes.storage.store import write_json_atomic
from ddp_recipes.train.attempts import AttemptLog
from ddp_recipes.train.callbacks import BatchFitsData, PlannedBatch, ThroughputMeter
from ddp_recipes.train.console import LogCadence, quiet_recipe_console
from ddp_recipes.train.perf import (
    flops_summary,
    peak_flops,
    tf32_state,
    training_flops_per_sample,
)
from ddp_recipes.train.summary import scalar_metrics, summarize
from ddp_recipes.train.surface import UserSurface, open_surface
from ddp_recipes.train.tracking import TrackerRun, build_loggers, identities, run_params
from ddp_recipes.train.trainer import Lifecycle, trainer_for
from ddp_recipes.train.userclass import RecipeClasses, RecordClasses, class_path, follow_checkpoint, resolve_classes


@dataclass(frozen=True)
class RunStart:
    """A recipe run as opened: its classes (those of the checkpoint it resumes), the user's part of the
    Trainer, and the checkpoint to resume (path and header; None: a fresh run)."""

    classes: RecipeClasses
    user: UserSurface
    resume: str | None
    checkpoint: dict[str, Any] | None


def open_run(cfg: RunConfig, base: type[L.LightningModule], model_cls: type | None = None,
             datamodule_cls: type | None = None, callbacks: Any = None, logger: Any = None,
             trainer_kwargs: dict[str, Any] | None = None, *, training: bool = True) -> RunStart:
    """Open a recipe's run before any process starts: the classes (``base`` or the user's subclass), the
    user's callbacks, logger and Trainer settings, and ``--resume``'s checkpoint (its header: tensors unread),
    whose recorded classes the run then follows. ``training`` False (``--test-only``) only reads the output
    folder."""
    quiet_recipe_console()
    classes = resolve_classes(base, model_cls, datamodule_cls, cfg.model_class, cfg.datamodule_class)
    user = open_surface(cfg, callbacks, logger, trainer_kwargs)
    resume, checkpoint = open_resume(cfg, training, debugging=bool(user.trainer_kwargs.get("fast_dev_run")))
    if resume:
        classes = follow_checkpoint(classes, checkpoint, resume)
    return RunStart(classes, user, resume, checkpoint)


def said_by_the_nodes_first() -> bool:
    """Whether a refusal is another process's to print: under torchrun every rank's process runs the recipe's
    checks alike before the process group is up (the same flags, the node's same files), so each would print the
    same line; the node's first process (LOCAL_RANK 0) prints it, the others exit 2 silently. Lightning's own
    launcher checks once, in the process that starts the ranks."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return False  # inside the run: each rank's error is its own (an agreed one is printed by rank 0)
    return "TORCHELASTIC_RUN_ID" in os.environ and os.environ.get("LOCAL_RANK", "0") != "0"


@contextmanager
def refused_in_one_line(prog: str, data_dir: str | None = None) -> Iterator[None]:
    """A recipe's ``main`` after its flags: bad input (a :class:`ConfigError`, naming its flag) is one line and exit
    2, and the run leaves nothing behind (not even the empty ``version_N`` of a default output dir); an image
    file no decoder reads is named relative to ``data_dir``, from any decoder, in a loader worker or not; so is a
    stream whose store stopped delivering mid-run, and a store of ``--output-dir`` that stopped taking the run's
    files: their line says whether a checkpoint is kept, and where (:mod:`~ddp_recipes.checkpointing.kept`).
    Anything else is a bug and keeps its traceback."""
    kept.reset()
    try:
        yield
    except StorageError as err:  # the store of --output-dir (or of --data-dir, read before the launch)
        discard_unused_output_dirs()
        after = kept.current().words("once the store answers")
        fail(f"{err.cli()}; {after}" if after else err, prog)
    except ConfigError as err:
        discard_unused_output_dirs()
        if said_by_the_nodes_first():
            raise SystemExit(2) from None
        fail(err, prog)
    except OSError as err:
        name = describe_unreadable(err)  # "train/c1/x.jpg (why)"
        if name is not None:
            fail(f"--data-dir {data_dir} holds an image that cannot be decoded: {name}; remove or replace it", prog)
        from ddp_recipes.data.stream import StreamCacheError, describe_outage  # here: only --data stream raises it

        outage = describe_outage(err)  # "reading train sample 17 failed (why)"
        if outage is None:
            raise
        if isinstance(err, StreamCacheError):  # the node's disk: the line names the cache and its fix
            fail(outage, prog)
        after = kept.current().words("once the store answers") or "rerun the same command once the store answers"
        fail(f"--data-dir {data_dir}: {outage}; {after}", prog)


def debug_run(trainer_kwargs: dict[str, Any]) -> bool:
    """Whether the run is a ``fast_dev_run``: a debugging run that writes no checkpoint and no summary.json
    (Lightning suppresses its checkpoints and loggers), so it never touches a run's folder."""
    return bool(trainer_kwargs.get("fast_dev_run"))


def has_loader(datamodule: L.LightningDataModule, stage: str) -> bool:
    """Whether a DataModule defines ``<stage>_dataloader`` (a user's may have no validation or test set)."""
    from lightning.pytorch.utilities.model_helpers import is_overridden

    return is_overridden(f"{stage}_dataloader", datamodule, L.LightningDataModule)


def make_trainer(cfg: RunConfig, callbacks: list[Callback] | None = None, checkpoint: dict[str, Any] | None = None,
                 **kwargs: Any) -> L.Trainer:
    """The Trainer of ``cfg.plan`` (:func:`~ddp_recipes.train.trainer.trainer_for`, what ``build_trainer`` ends
    in) with the recipe's logging: the ``--logger`` trackers (:mod:`ddp_recipes.train.tracking`; resumed from
    ``checkpoint``, its tracker runs; a ``logger`` keyword replaces them). ``kwargs`` (a run's
    ``--trainer`` settings, ``logger``, ...) win over these defaults."""
    if "logger" not in kwargs:
        kwargs["logger"] = build_loggers(cfg, checkpoint)
    # A list, even an empty one (a rank that holds no logger): every rank gets the same callbacks.
    if kwargs["logger"] not in (False, None) and not any(isinstance(c, TrackerRun) for c in callbacks or []):
        callbacks = [*(callbacks or []), TrackerRun(run_params(cfg))]
    kwargs.setdefault("default_root_dir", cfg.output_dir)
    kwargs.setdefault("log_every_n_steps", cfg.log_every_n_steps)
    return trainer_for(cfg.plan, lifecycle=Lifecycle(), callbacks=list(callbacks or []), **kwargs)


def describe_setup(cfg: RunConfig, trainer: L.Trainer, datamodule: L.LightningDataModule | None = None) -> str:
    """The one block a run prints: world, batch arithmetic, learning rate, precision, strategy, output, and the
    data when its DataModule describes itself (``describe()``)."""
    plan = cfg.plan
    per_device, accum, global_batch = plan.batch.astuple()
    strategy = type(trainer.strategy).__name__
    hook = getattr(trainer.strategy, "comm_hook", None)
    lines = [
        f"world size       {trainer.world_size} ({trainer.num_nodes} node(s) x {trainer.num_devices} device(s), "
        f"{trainer.strategy.root_device.type})",
        f"batch            {per_device} per device x {trainer.world_size} x {accum} accumulation = "
        f"{global_batch} global",
        f"learning rate    {plan.lr:g} (base {plan.base_lr:g} at batch {plan.reference_batch}, "
        f"scaling {plan.lr_scaling}, warm-up {plan.warmup_epochs:g} epochs)",
        f"precision        {trainer.precision}" + (f", torch.compile ({plan.compile_backend})"
                                                  if plan.compile_backend else ""),
        f"tf32             {tf32_state(trainer.strategy.root_device.type)}",
        f"strategy         {strategy}" + (f" (comm hook {hook}, sync BN {plan.ddp.sync_batchnorm}, "
                                          f"find unused {plan.ddp.find_unused_parameters})" if hook else ""),
        f"output           {cfg.output_dir}",
    ]
    describe = getattr(datamodule, "describe", None)
    if callable(describe):
        lines.append(f"data             {describe()}")
    return "\n".join(lines)


def run_fit_test(cfg: RunConfig, build_model: Callable[[], L.LightningModule], datamodule: L.LightningDataModule,
                 callbacks: list[Callback] | None = None, ckpt_path: str | None = None, test: bool = True,
                 extra: dict[str, Any] | None = None, save_final: bool = True,
                 classes: RecipeClasses | None = None, checkpoint: dict[str, Any] | None = None,
                 **trainer_kwargs: Any) -> dict[str, Any]:
    """Fit, test, and write ``<output-dir>/summary.json`` on rank 0. Returns the summary (every rank).

    ``build_model`` is called after the trainer has seeded every rank, so the initial weights depend on
    ``--seed`` only (not on whatever drew random numbers earlier in the process). ``checkpoint``: the header
    of ``ckpt_path`` when the caller has read it already (the tracker runs to continue are in it); the
    weights are loaded once, by every rank, in Lightning's restore.
    """
    if ckpt_path and checkpoint is None:
        checkpoint = read_checkpoint(ckpt_path)
    debugging = debug_run(trainer_kwargs)
    started_at = time.time()
    meter = ThroughputMeter(flops_per_sample=lambda example: training_flops_per_sample(build_model, example))
    callbacks = [meter, *(callbacks or []), BatchFitsData(cfg.batch_flag)]
    if changed_fields(cfg, "log_every_n_steps"):  # the recipe's own default says nothing on a short epoch
        callbacks.append(LogCadence())
    if not debugging:  # each launch's record in the run folder: what the stops between them cost
        callbacks.append(AttemptLog(cfg.output_dir, started_at=started_at))
    if classes is not None:
        callbacks.append(RecordClasses(classes))
        extra = {**classes.record(), **(extra or {})}
        if classes.datamodule is not None:
            callbacks.append(PlannedBatch(cfg.plan.batch.per_device, class_path(classes.datamodule)))
    if not debugging:  # after the run's input checks, before the Trainer (its info lines) and any rank start;
        refuse_other_runs(cfg, ckpt_path, checkpoint)  # a debugging run writes nothing, touches no run
    # The trackers are made with the trainer: a missing tracker package fails here, before anything is written.
    trainer = make_trainer(cfg, callbacks=callbacks, checkpoint=checkpoint, **trainer_kwargs)
    out = output_folder(cfg)  # after the trainer: a setting it refuses leaves nothing behind
    model = build_model()
    if cfg.plan.compile_backend:
        # Lightning unwraps the compiled module and compiles its forward and its step methods (training,
        # validation, test, predict): the loss and the step's own code are traced too. The forward, called
        # inside DDP's forward, gets DDPOptimizer (one graph per gradient bucket). Checkpoints keep the
        # plain module's keys.
        model = torch.compile(model, backend=cfg.plan.compile_backend)
    if trainer.is_global_zero:
        print(describe_setup(cfg, trainer, datamodule), flush=True)
    start = time.perf_counter()
    # --resume auto: rank 0 decides for every rank once the process group is up (checkpointing/run_folder/resume.py);
    # it must be ckpt_path, the checkpoint checked before the launch. weights_only: no code runs from the file.
    request = Continue(ckpt_path, checkpoint) if cfg.resume == "auto" else ckpt_path
    with plain_data():
        trainer.fit(model, datamodule=datamodule, ckpt_path=request, weights_only=True if ckpt_path else None)
    fit_seconds = time.perf_counter() - start
    fit_metrics = scalar_metrics(trainer)  # before test(), which replaces the callback metrics
    if save_final and not debugging:
        # Collective-safe: every rank calls it, rank 0 writes. The weights the test below evaluates.
        trainer.save_checkpoint(out / "final.ckpt", weights_only=False)
    test_metrics: dict[str, float] = {}
    if test:
        results = trainer.test(model, datamodule=datamodule, verbose=False)
        test_metrics = {k: float(v) for k, v in (results[0] if results else {}).items()}
    flops_per_sample = meter.flops_per_sample or (training_flops_per_sample(build_model, meter.example)
                                                  if meter.example is not None else None)
    flops = flops_summary(flops_per_sample, meter.samples_per_sec, trainer.world_size,
                          peak_flops(trainer.strategy.root_device, trainer.precision))
    summary = summarize(cfg, trainer, meter, fit_seconds, fit_metrics, test_metrics, extra, flops,
                        attempts=not debugging)
    if trainer.is_global_zero:
        summary["trackers"] = identities(trainer.loggers)
        if not debugging:
            write_json_atomic(out / "summary.json", summary)
        shown = {k: summary[k] for k in ("world_size", "global_batch_size", "epochs", "steps", "fit_seconds",
                                         "train_samples_per_sec", "input_wait_fraction", "mfu") if k in summary}
        shown.update({k: round(v, 4) for k, v in test_metrics.items()})
        print("summary " + json.dumps(shown), flush=True)
    return summary


def run_test_only(cfg: RunConfig, build_model: Callable[[], L.LightningModule], datamodule: L.LightningDataModule,
                  ckpt_path: str, checkpoint: dict[str, Any], classes: RecipeClasses | None = None,
                  user_callbacks: list[Callback] | None = None, **trainer_kwargs: Any) -> dict[str, Any]:
    """Evaluate the checkpoint ``ckpt_path`` on the test set, no training: every rank loads it, the test set
    is sharded exactly (no padded duplicates), and the metrics are the whole set's. When the checkpoint
    holds EMA weights (``--model-ema``) they are evaluated too (``test_acc_ema``, ...). Writes
    ``<output-dir>/test.json`` on rank 0 and returns the same dict on every rank. ``user_callbacks`` and
    ``trainer_kwargs`` are the run's own (:mod:`ddp_recipes.train.surface`); no logger unless one is given."""
    from ddp_recipes.config.ema import EMAArgs
    from ddp_recipes.optim.ema import ModelEMA, ema_state_dict

    out = output_folder(cfg)
    callbacks: list[Callback] = []
    ema_state = next((state for key, state in (checkpoint.get("callbacks") or {}).items()
                      if str(key).split("{")[0] == ModelEMA.__qualname__), None)
    if ema_state and ema_state_dict(checkpoint) is not None:
        ema = ModelEMA(decay=float(ema_state.get("decay", EMAArgs.decay)),
                       update_every=int(ema_state.get("update_every", 1)))
        ema.load_state_dict(ema_state)  # Lightning restores callback state for fit only
        callbacks.append(ema)
    trainer_kwargs = {"logger": False, **trainer_kwargs, "enable_checkpointing": False}
    trainer = make_trainer(cfg, callbacks=[*callbacks, *(user_callbacks or [])], **trainer_kwargs)
    model = build_model()
    with plain_data():
        results = trainer.test(model, datamodule=datamodule, ckpt_path=ckpt_path, weights_only=True, verbose=False)
    metrics = {k: float(v) for k, v in (results[0] if results else {}).items()}
    summary = {"checkpoint": ckpt_path, "world_size": trainer.world_size, "precision": trainer.precision,
               "ema": bool(callbacks), **metrics, "config": cfg.to_dict(),
               **(classes.record() if classes is not None else {})}
    if trainer.is_global_zero:
        write_json_atomic(out / "test.json", summary)
        print("test " + json.dumps({"checkpoint": ckpt_path, **{k: round(v, 4) for k, v in metrics.items()}}),
              flush=True)
    return summary
