"""What every recipe does around ``fit``: print the resolved setup once, measure steady-state throughput,
log to the ``--logger`` trackers, and write ``summary.json`` on rank 0 (atomically)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from ddp_recipes.checkpointing.checkpoint import plain_data, read_checkpoint
from ddp_recipes.checkpointing.run_folder.output_dir import output_folder
from ddp_recipes.checkpointing.run_folder.ownership import ATTEMPTS_DIR
from ddp_recipes.checkpointing.run_folder.resume import Continue
from ddp_recipes.config.run_config import RunConfig, changed_fields
from ddp_recipes.storage import location
from ddp_recipes.storage.store import write_json_atomic
from ddp_recipes.train.attempts import AttemptLog, read_attempts, stop_costs, trainer_run_id
from ddp_recipes.train.callbacks import BatchFitsData, PlannedBatch, ThroughputMeter
from ddp_recipes.train.console import LogCadence
from ddp_recipes.train.perf import (
    flops_summary,
    peak_flops,
    tf32_state,
    training_flops_per_sample,
)
from ddp_recipes.train.summary import scalar_metrics, summarize
from ddp_recipes.train.tracking import TrackerRun, build_loggers, identities, run_params
from ddp_recipes.train.trainer import Lifecycle, trainer_for
from ddp_recipes.train.userclass import RecipeClasses, RecordClasses, class_path


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
    summary = summarize(cfg, trainer, meter, fit_seconds, fit_metrics, test_metrics, extra, flops)
    if trainer.is_global_zero:
        summary["trackers"] = identities(trainer.loggers)
        if not debugging:
            attempts = read_attempts(location(cfg.output_dir) / ATTEMPTS_DIR, trainer_run_id(trainer))
            summary["stops"] = stop_costs(attempts, time.time())
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
