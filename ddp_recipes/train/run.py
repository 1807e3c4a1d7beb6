"""What every recipe does around ``fit``: print the resolved setup once, measure steady-state throughput,
log to CSV, and write ``summary.json`` on rank 0 (atomically)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, TQDMProgressBar
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities.data import extract_batch_size
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from typing_extensions import override

from ddp_recipes.atomic import write_json_atomic
from ddp_recipes.checkpointing.checkpoint import (
    CHECKPOINT_DIR,
    check_compatible,
    plain_data,
    read_checkpoint,
    resolve_resume,
)
from ddp_recipes.checkpointing.preemption import LastCheckpoint
from ddp_recipes.config.cli import writable_dir
from ddp_recipes.config.run_config import RunConfig
from ddp_recipes.data.samplers import loader_batch_size
from ddp_recipes.errors import ConfigError
from ddp_recipes.train.perf import (
    flops_summary,
    input_wait,
    peak_flops,
    tf32_state,
    training_flops_per_sample,
)
from ddp_recipes.train.trainer import build_trainer
from ddp_recipes.train.userclass import RecipeClasses, RecordClasses, class_path


class ThroughputMeter(Callback):
    """Steady-state training samples/s over all ranks, from rank-local wall time between optimizer steps,
    and the fraction of that time the loop waited for its next batch.

    DDP's gradient all-reduce makes every step a synchronisation point, so one rank's clock measures the
    whole group. The first ``warmup_steps`` intervals (allocator, first all-reduce, bucket rebuild, loader
    workers starting; at most half of a short run) and the time outside training batches (validation,
    epoch ends) are excluded.
    """

    def __init__(self, warmup_steps: int = 5) -> None:
        self.warmup_steps = warmup_steps
        self.intervals: list[tuple[int, float, float | None]] = []  # (samples over all ranks, seconds, wait s)
        self.example: torch.Tensor | None = None  # the first batch's input, for the FLOP count
        self.first_step_s: float | None = None  # the fit's first batch: with --compile, its compilation
        self._last: float | None = None
        self._first_start: float | None = None

    @override
    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._last = None  # do not count the gap across validation and the epoch boundary

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._last = None  # validation inside an epoch (val_check_interval) is not step time either

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self._first_start is None:
            self._first_start = time.perf_counter()
        if self.example is None:
            first = batch[0] if isinstance(batch, list | tuple) and batch else batch
            if torch.is_tensor(first):
                self.example = torch.empty(first.shape, dtype=first.dtype, device="meta")

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        now = time.perf_counter()
        if self.first_step_s is None and self._first_start is not None:
            self.first_step_s = now - self._first_start
        if self._last is not None:
            self.intervals.append((_batch_len(batch) * trainer.world_size, now - self._last, input_wait(trainer)))
        self._last = now

    def _steady(self) -> list[tuple[int, float, float | None]]:
        return self.intervals[min(self.warmup_steps, len(self.intervals) // 2):]

    @property
    def samples_per_sec(self) -> float | None:
        steady = self._steady()
        seconds = sum(t for _, t, _ in steady)
        return sum(n for n, _, _ in steady) / seconds if seconds > 0 else None

    @property
    def step_s_median(self) -> float | None:
        steady = sorted(t for _, t, _ in self._steady())
        return steady[len(steady) // 2] if steady else None

    @property
    def input_wait_fraction(self) -> float | None:
        """Share of the steady step time rank 0 spent waiting for the next batch (None: not measured)."""
        steady = self._steady()
        seconds = sum(t for _, t, _ in steady)
        if not steady or seconds <= 0 or any(w is None for _, _, w in steady):
            return None
        return min(1.0, sum(w for _, _, w in steady) / seconds)


def _batch_len(batch: Any) -> int:
    """Samples in a batch, by Lightning's own rule (the first tensor's leading dimension, also inside dicts
    and lists; a dict's keys are not samples); 1 when nothing in it has a length."""
    try:
        return int(extract_batch_size(batch))
    except (MisconfigurationException, RecursionError, TypeError):
        return 1


def checkpoint_callbacks(cfg: RunConfig, has_val: bool, model_class: type | None = None) -> list[Callback]:
    """``last.ckpt`` at each epoch end, every ``--checkpoint-every-n-steps`` and on preemption; ``best.ckpt``
    by the model class's ``monitor`` (``val_acc``) when there is validation. Both in
    ``<output-dir>/checkpoints``, through the atomic IO."""
    folder = Path(cfg.output_dir) / CHECKPOINT_DIR
    callbacks: list[Callback] = [LastCheckpoint(folder, every_n_steps=cfg.checkpoint_every_n_steps)]
    if has_val:
        monitor = getattr(model_class, "monitor", "val_acc")
        callbacks.append(ModelCheckpoint(dirpath=folder, filename="best", monitor=monitor,
                                         mode="min" if monitor.endswith("loss") else "max",
                                         save_top_k=1, save_last=False, enable_version_counter=False))
    return callbacks


def has_loader(datamodule: L.LightningDataModule, stage: str) -> bool:
    """Whether a DataModule defines ``<stage>_dataloader`` (a user's may have no validation or test set)."""
    from lightning.pytorch.utilities.model_helpers import is_overridden

    return is_overridden(f"{stage}_dataloader", datamodule, L.LightningDataModule)


def open_resume(cfg: RunConfig) -> tuple[str | None, dict[str, Any] | None]:
    """The checkpoint ``--resume`` names and its contents ((None, None): start fresh).

    Every rank resolves and reads the same file; a bad one fails here, before training touches anything.
    """
    resume = resolve_resume(cfg.resume, cfg.output_dir)
    return (resume, read_checkpoint(resume)) if resume else (None, None)


def resume_checkpoint(cfg: RunConfig, expected: dict[str, Any], accepted: dict[str, tuple] | None = None) -> str | None:
    """The checkpoint ``--resume`` names (None: start fresh), checked against this run's model flags."""
    resume, checkpoint = open_resume(cfg)
    if resume:
        check_compatible(checkpoint, resume, expected, accepted)
    return resume


class PlannedBatch(Callback):
    """Fails every rank before the first step when the training loader's batch is not the run's plan.

    A user's DataModule that ignores the ``batch_size`` it was given would make the printed global batch,
    the LR scaling and the resume arithmetic silently wrong.
    """

    def __init__(self, per_device: int, source: str) -> None:
        self.per_device, self.source = per_device, source

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        batch = loader_batch_size(trainer.train_dataloader)
        if batch is not None and batch != self.per_device:
            raise ConfigError(f"{{datamodule_class}} {self.source}: its training loader has batch_size {batch} but "
                              f"the run plans {self.per_device} per device; build the loader with the batch_size given "
                              "to __init__")


def make_trainer(cfg: RunConfig, callbacks: list[Callback] | None = None, **kwargs: Any) -> L.Trainer:
    """build_trainer with the recipe's logging: CSV metrics under ``<output-dir>/logs``, a progress bar."""
    kwargs.setdefault("logger", CSVLogger(cfg.output_dir, name="logs"))
    kwargs.setdefault("default_root_dir", cfg.output_dir)
    kwargs.setdefault("log_every_n_steps", 10)
    # A bar redrawn every step costs more than an MLP step on MNIST; 20 steps is still live.
    progress = [TQDMProgressBar(refresh_rate=20)] if kwargs.get("enable_progress_bar", True) else []
    return build_trainer(plan=cfg.plan, callbacks=[*progress, *(callbacks or [])], **kwargs)


def describe_setup(cfg: RunConfig, trainer: L.Trainer, lr: float) -> str:
    """The one block a run prints: world, batch arithmetic, precision, strategy."""
    plan = cfg.plan
    per_device, accum, global_batch = plan.batch.astuple()
    strategy = type(trainer.strategy).__name__
    hook = getattr(trainer.strategy, "comm_hook", None)
    lines = [
        f"world size       {trainer.world_size} ({trainer.num_nodes} node(s) x {trainer.num_devices} device(s), "
        f"{trainer.strategy.root_device.type})",
        f"batch            {per_device} per device x {trainer.world_size} x {accum} accumulation = "
        f"{global_batch} global",
        f"learning rate    {lr:g} (base {plan.base_lr:g} at batch {plan.reference_batch}, scaling {plan.lr_scaling}, "
        f"warm-up {plan.warmup_epochs:g} epochs)",
        f"precision        {trainer.precision}" + (f", torch.compile ({plan.compile_backend})"
                                                  if plan.compile_backend else ""),
        f"tf32             {tf32_state(trainer.strategy.root_device.type)}",
        f"strategy         {strategy}" + (f" (comm hook {hook}, sync BN {plan.ddp.sync_batchnorm}, "
                                          f"find unused {plan.ddp.find_unused_parameters})" if hook else ""),
        f"output           {cfg.output_dir}",
    ]
    return "\n".join(lines)


def scalar_metrics(trainer: L.Trainer) -> dict[str, float]:
    """The trainer's current logged scalars (epoch values are already synced across ranks)."""
    return {k: float(v) for k, v in trainer.callback_metrics.items() if torch.is_tensor(v) and v.numel() == 1}


def summarize(cfg: RunConfig, trainer: L.Trainer, meter: ThroughputMeter, fit_seconds: float,
              metrics: dict[str, float], test_metrics: dict[str, float],
              extra: dict[str, Any] | None = None, flops: dict[str, Any] | None = None) -> dict[str, Any]:
    """The fields of summary.json (see the README for each one). Every rank calls it (one collective)."""
    wait = worst_rank(trainer, meter.input_wait_fraction)
    batch = cfg.plan.batch
    return {
        "world_size": trainer.world_size,
        "num_nodes": trainer.num_nodes,
        "devices_per_node": trainer.num_devices,
        "per_device_batch_size": batch.per_device,
        "accumulate_grad_batches": batch.accumulation,
        "global_batch_size": batch.global_batch,
        "precision": trainer.precision,
        "epochs": trainer.current_epoch,
        "steps": trainer.global_step,
        "fit_seconds": round(fit_seconds, 3),
        "train_samples_per_sec": round(meter.samples_per_sec, 1) if meter.samples_per_sec else None,
        "input_wait_fraction": round(wait, 4) if wait is not None else None,
        "first_step_seconds": round(meter.first_step_s, 3) if meter.first_step_s is not None else None,
        # The first step's excess over a steady one: tracing and code generation (recompiles for other
        # shapes, e.g. a short last batch or evaluation, come on top and are not counted here).
        "compile_seconds": (round(max(0.0, meter.first_step_s - (meter.step_s_median or 0.0)), 3)
                            if cfg.plan.compile_backend and meter.first_step_s is not None else None),
        **(flops or {}),
        "final_train_loss": metrics.get("train_loss_epoch", metrics.get("train_loss")),
        **{k: v for k, v in test_metrics.items()},
        "metrics": metrics,
        "config": cfg.to_dict(),
        "torch_version": torch.__version__,
        "lightning_version": L.__version__,
        **(extra or {}),
    }


def worst_rank(trainer: L.Trainer, value: float | None) -> float | None:
    """The largest of the ranks' ``value`` (None where a rank has none): a rank whose loader is slow shows
    it in its own wait, while the others wait in the all-reduce. Every rank must call it."""
    local = torch.tensor(-1.0 if value is None else float(value), dtype=torch.float64,
                         device=trainer.strategy.root_device)
    worst = float(trainer.strategy.reduce(local, reduce_op="max"))
    return None if worst < 0 else worst


def run_fit_test(cfg: RunConfig, build_model: Callable[[], L.LightningModule], datamodule: L.LightningDataModule,
                 lr: float,
                 callbacks: list[Callback] | None = None, ckpt_path: str | None = None, test: bool = True,
                 extra: dict[str, Any] | None = None, save_final: bool = True,
                 classes: RecipeClasses | None = None, **trainer_kwargs: Any) -> dict[str, Any]:
    """Fit, test, and write ``<output-dir>/summary.json`` on rank 0. Returns the summary (every rank).

    ``build_model`` is called after the trainer has seeded every rank, so the initial weights depend on
    ``--seed`` only (not on whatever drew random numbers earlier in the process).
    """
    out = writable_dir(cfg.output_dir, "output_dir")
    meter = ThroughputMeter()
    callbacks = [meter, *(callbacks or [])]
    if classes is not None:
        callbacks.append(RecordClasses(classes))
        extra = {**classes.record(), **(extra or {})}
        if classes.datamodule is not None:
            callbacks.append(PlannedBatch(cfg.plan.batch.per_device, class_path(classes.datamodule)))
    trainer = make_trainer(cfg, callbacks=callbacks, **trainer_kwargs)
    model = build_model()
    if cfg.plan.compile_backend:
        # Lightning unwraps the compiled module and compiles its forward; called inside DDP's forward, dynamo
        # applies DDPOptimizer (one graph per gradient bucket). Checkpoints keep the plain module's keys.
        model = torch.compile(model, backend=cfg.plan.compile_backend)
    if trainer.is_global_zero:
        print(describe_setup(cfg, trainer, lr), flush=True)
    start = time.perf_counter()
    # weights_only: Lightning's restore must not unpickle code either (read_checkpoint already vetted it).
    with plain_data():
        trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path, weights_only=True if ckpt_path else None)
    fit_seconds = time.perf_counter() - start
    fit_metrics = scalar_metrics(trainer)  # before test(), which replaces the callback metrics
    if save_final:
        # Collective-safe: every rank calls it, rank 0 writes. The weights the test below evaluates.
        trainer.save_checkpoint(out / "final.ckpt", weights_only=False)
    test_metrics: dict[str, float] = {}
    if test:
        results = trainer.test(model, datamodule=datamodule, verbose=False)
        test_metrics = {k: float(v) for k, v in (results[0] if results else {}).items()}
    flops_per_sample = (training_flops_per_sample(build_model, meter.example) if meter.example is not None
                        else None)
    flops = flops_summary(flops_per_sample, meter.samples_per_sec, trainer.world_size,
                          peak_flops(trainer.strategy.root_device, trainer.precision))
    summary = summarize(cfg, trainer, meter, fit_seconds, fit_metrics, test_metrics, extra, flops)
    if trainer.is_global_zero:
        write_json_atomic(out / "summary.json", summary)
        shown = {k: summary[k] for k in ("world_size", "global_batch_size", "epochs", "steps", "fit_seconds",
                                         "train_samples_per_sec", "input_wait_fraction", "mfu") if k in summary}
        shown.update({k: round(v, 4) for k, v in test_metrics.items()})
        print("summary " + json.dumps(shown), flush=True)
    return summary


def run_test_only(cfg: RunConfig, build_model: Callable[[], L.LightningModule], datamodule: L.LightningDataModule,
                  ckpt_path: str, checkpoint: dict[str, Any], classes: RecipeClasses | None = None) -> dict[str, Any]:
    """Evaluate the checkpoint ``ckpt_path`` on the test set, no training: every rank loads it, the test set
    is sharded exactly (no padded duplicates), and the metrics are the whole set's. When the checkpoint
    holds EMA weights (``--model-ema``) they are evaluated too (``test_acc_ema``, ...). Writes
    ``<output-dir>/test.json`` on rank 0 and returns the same dict on every rank."""
    from ddp_recipes.optim.ema import ModelEMA, ema_state_dict

    out = writable_dir(cfg.output_dir, "output_dir")
    callbacks: list[Callback] = []
    ema_state = next((state for key, state in (checkpoint.get("callbacks") or {}).items()
                      if str(key).split("{")[0] == ModelEMA.__qualname__), None)
    if ema_state and ema_state_dict(checkpoint) is not None:
        ema = ModelEMA(decay=float(ema_state.get("decay", 0.99998)), update_every=int(ema_state.get("update_every", 1)))
        ema.load_state_dict(ema_state)  # Lightning restores callback state for fit only
        callbacks.append(ema)
    trainer = make_trainer(cfg, callbacks=callbacks, logger=False, enable_checkpointing=False)
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
