"""The run configuration shared by every recipe, and the CLI generated from it.

A recipe subclasses :class:`RunConfig` (a dataclass), adds its own fields, and gets flat kebab-case flags
(``--devices``, ``--max-steps``) from :func:`parse_config`. Each field carries a one-line ``help`` in its
metadata; validation lives in ``__post_init__`` and names the flag it rejects.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass
from typing import Any

from ddp_recipes.config.choices import (
    PRECISION_FLAGS,
    Accelerator,
    CommHook,
    LRScaling,
    PrecisionFlag,
    check_choice,
    check_choices,
    parse_trackers,
)
from ddp_recipes.config.cli import opt
from ddp_recipes.config.plan import DDPOptions, RunPlan
from ddp_recipes.config.trainer_settings import PACK_OWNED, callback_spec, check_trainer_settings
from ddp_recipes.config.world import default_num_workers, lightning_precision
from ddp_recipes.errors import ConfigError

# Checked once, where the plan resolves them (resolve_precision, resolve_accelerator, check_ddp_values,
# RunPlan.resolve), not a second time by the generic Literal check.
_PLAN_OWNED = ("precision", "accelerator", "comm_hook", "lr_scaling")


@dataclass
class RunConfig:
    """Everything about *how* a recipe runs: devices, precision, batch arithmetic, DDP knobs, seed."""

    devices: int | None = opt(None, "devices (processes) per node; default 1, or torchrun's --nproc-per-node")
    num_nodes: int | None = opt(None, "number of nodes; default 1, or torchrun's --nnodes")
    accelerator: Accelerator = opt("auto", "cpu, gpu/cuda or auto (CUDA when available)")
    precision: PrecisionFlag = opt("32-true", "32-true, 16-mixed (CUDA; bf16-mixed on CPU), bf16-mixed, or Lightning's "
                                              "bf16-true, 16-true, 64-true; Lightning's 32, 16, bf16, 64 mean 32-true, "
                                              "16-mixed, bf16-mixed, 64-true")
    max_epochs: int | None = opt(None, "stop after this many epochs (recipe default when neither limit is set)")
    max_steps: int = opt(-1, "stop after this many optimizer steps (-1: no step limit)")
    batch_size: int | None = opt(None, "per-device batch size (default: recipe's, or derived from --global-batch-size)")
    global_batch_size: int | None = opt(
        None, "samples per optimizer step over all devices = batch-size x world size x accumulation"
    )
    accumulate_grad_batches: int | None = opt(None, "micro-batches per optimizer step (all-reduce only on the last)")
    lr: float | None = opt(None, "base learning rate at --lr-reference-batch (recipe default when unset)")
    lr_scaling: LRScaling = opt("linear", "scale the LR from --lr-reference-batch to the global batch: linear, sqrt "
                                          "or none")
    lr_reference_batch: int | None = opt(None, "the global batch the base --lr was tuned for (recipe default)")
    warmup_epochs: float = opt(0.0, "LR warm-up length in epochs (fractions allowed), then the schedule (0: none)",
                               aliases=("--lr-warmup-epochs",))
    seed: int = opt(42, "base seed; every rank seeds its random streams with seed + global rank")
    sync_batchnorm: bool = opt(False, "synchronise BatchNorm statistics across ranks (CPU and CUDA)")
    find_unused_parameters: bool = opt(False, "let DDP handle parameters that get no gradient (slower)")
    static_graph: bool = opt(False, "tell DDP the graph is the same every step (enables more optimisations)")
    comm_hook: CommHook = opt("none", "gradient compression for the all-reduce: none, fp16, bf16, powersgd")
    bucket_cap_mb: float = opt(25.0, "DDP gradient bucket size in MiB")
    timeout_s: float = opt(1800.0, "seconds a collective may wait before the run fails instead of hanging")
    hang_report_s: float | None = opt(None, "seconds without a finished batch after which every rank writes its stacks "
                                            "and one line names the stuck rank (default: from the steps seen, 60 s "
                                            "or more, under half --timeout-s; 0: off)")
    output_dir: str | None = opt(None, "where logs, checkpoints and summary.json go: a folder or an object-storage URL "
                                       "(s3://bucket/prefix, gs://..., any fsspec URL), owned by one run (default: "
                                       "runs/<recipe>/version_N, a new N for each run)")
    resume: str = opt("none", "none, auto (the newest complete checkpoint in --output-dir) or a checkpoint PATH or URL")
    checkpoint_every_n_steps: int = opt(0, "also save last.ckpt every N optimizer steps (it is always saved at "
                                           "each epoch end and on SIGTERM/SLURM's requeue signal)")
    compile: bool = opt(False, "torch.compile the model; under DDP its DDPOptimizer splits the graph at "
                               "gradient-bucket boundaries so the all-reduce still overlaps backward (compile time is "
                               "reported apart)")
    compile_backend: str = opt("inductor", "torch.compile backend: inductor (generated kernels), aot_eager (no "
                                           "code generation: checks a model compiles), cudagraphs, ...")
    tf32: bool = opt(True, "FP32 matmuls and convolutions as TF32 on Ampere+ GPUs (NVIDIA's FP32 figures use it; "
                           "no effect on CPU or under bf16/16-mixed autocast regions)")
    num_workers: int | None = opt(None, "DataLoader workers per rank (default: fitted to the cores per rank)")
    model_class: str | None = opt(None, "your LightningModule, package.module:ClassName (a subclass of the recipe's "
                                        "module; recorded in checkpoints so --resume rebuilds it)")
    datamodule_class: str | None = opt(None, "your LightningDataModule, package.module:ClassName (its __init__ gets "
                                             "batch_size and the recipe's data flags it declares)")
    diagnostics: bool = opt(True, "check the run for DDP mistakes (unsharded data, drifting weights, ...) and warn "
                                  "once")
    trainer: dict[str, Any] = opt({}, "a lightning.Trainer setting the recipe does not own, KEY=VALUE, repeatable "
                                      "(--trainer val_check_interval=0.25 --trainer limit_val_batches=10); a trainer: "
                                      "mapping in --config", metavar="KEY=VALUE")
    callbacks: list[Any] = opt([], "a Lightning callback by class path (LearningRateMonitor, pkg.mod.MyCallback) or as "
                                   "a YAML mapping {class_path: ..., init_args: {...}}, repeatable; a callbacks: list "
                                   "in --config, as LightningCLI writes it", metavar="SPEC")
    logger: str = opt("csv", "experiment trackers, comma-separated: csv, tensorboard, mlflow, wandb (or none); logged "
                             "from rank 0 only, continued by --resume")
    log_every_n_steps: int = opt(10, "log the training loss, LR, throughput and input wait every N optimizer steps "
                                     "(0: only per epoch)")
    experiment: str | None = opt(None, "MLflow experiment and default W&B project (default: the recipe's name)")
    run_name: str | None = opt(None, "the tracker run's display name (MLflow, W&B); CSV/TensorBoard use version_N")
    tracking_uri: str | None = opt(None, "MLflow tracking server or store, e.g. http://127.0.0.1:5000 (default: "
                                         "$MLFLOW_TRACKING_URI, else sqlite <output-dir>/mlflow.db)")
    wandb_project: str | None = opt(None, "W&B project (default: --experiment)")
    wandb_entity: str | None = opt(None, "W&B entity (user or team; default: your W&B default)")
    wandb_offline: bool = opt(False, "W&B offline mode: write the run under <output-dir>/wandb, `wandb sync` it later")

    # The recipe's defaults, used where the flags above are left unset. Subclasses override these.
    DEFAULT_BATCH_SIZE: typing.ClassVar[int] = 64
    DEFAULT_LR: typing.ClassVar[float] = 0.01
    DEFAULT_REFERENCE_BATCH: typing.ClassVar[int] = 64
    DEFAULT_MAX_EPOCHS: typing.ClassVar[int] = 5
    DEFAULT_EXPERIMENT: typing.ClassVar[str] = "ddp-recipes"  # --experiment's default: the recipe's name
    DEFAULT_OUTPUT_ROOT: typing.ClassVar[str] = "runs/default"  # --output-dir's default: <this>/version_N

    DEFAULT_NUM_WORKERS: typing.ClassVar[int | None] = 0  # None: fitted to the cores per rank
    # lightning.Trainer settings the recipe sets itself (refused in --trainer), and the flag to use instead.
    TRAINER_OWNED: typing.ClassVar[dict[str, str]] = PACK_OWNED

    def __post_init__(self) -> None:
        # What was asked, before a recipe fills in its resolved defaults (--print-config writes this).
        self.__dict__["_asked"] = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        self._check_positive("devices", "num_nodes", "batch_size", "global_batch_size", "accumulate_grad_batches",
                             "lr_reference_batch", "max_epochs")
        if self.max_steps == 0 or self.max_steps < -1:
            raise ConfigError(f"{{max_steps}} must be a positive step count or -1 for no limit (got {self.max_steps})")
        check_choices(self, owned_elsewhere=_PLAN_OWNED)
        if self.lr is not None and not (self.lr > 0 and math.isfinite(self.lr)):
            raise ConfigError(f"{{lr}} must be a positive number (got {self.lr})")
        if self.warmup_epochs < 0:
            raise ConfigError(f"{{warmup_epochs}} must be >= 0 (got {self.warmup_epochs})")
        if self.num_workers is not None and self.num_workers < 0:
            raise ConfigError(f"{{num_workers}} must be >= 0 (got {self.num_workers})")
        if self.compile:
            from torch._dynamo import list_backends

            check_choice("compile_backend", self.compile_backend, sorted(list_backends(exclude_tags=())))
        parse_trackers(self.logger)
        if self.log_every_n_steps < 0:
            raise ConfigError(f"{{log_every_n_steps}} must be >= 0 (got {self.log_every_n_steps})")
        for name in ("experiment", "run_name", "tracking_uri", "wandb_project", "wandb_entity"):
            if getattr(self, name) is not None and not str(getattr(self, name)).strip():
                raise ConfigError(f"{{{name}}} is empty; give a value or leave it out", name)
        self._check_tracker_flags()
        if self.checkpoint_every_n_steps < 0:
            raise ConfigError(f"{{checkpoint_every_n_steps}} must be >= 0 (got {self.checkpoint_every_n_steps})")
        self.trainer = check_trainer_settings(self.trainer, self.TRAINER_OWNED)
        self.callbacks = [callback_spec(spec) for spec in self.callbacks]
        self.__dict__["_asked"].update(trainer=dict(self.trainer), callbacks=list(self.callbacks))  # as read
        self.check_values()
        # Resolve now, once: a bad combination fails before any process starts, and everything downstream
        # reads the frozen plan instead of re-deriving it.
        self.__dict__["_plan"] = self.resolve()

    def check_values(self) -> None:
        """A recipe's own flags, checked after the shared ones and before the plan resolves (which may import
        torch to ask about CUDA): a subclass checks here what needs neither torch nor the plan, changing no field
        (the values as asked are recorded before), and fills in its defaults after ``super().__post_init__()``."""

    # Tracker flags and the trackers they configure (a flag without one of them would be dropped silently).
    _TRACKER_FLAGS: typing.ClassVar[dict[str, tuple[str, ...]]] = {
        "tracking_uri": ("mlflow",), "experiment": ("mlflow", "wandb"), "run_name": ("mlflow", "wandb"),
        "wandb_project": ("wandb",), "wandb_entity": ("wandb",), "wandb_offline": ("wandb",)}

    def _check_tracker_flags(self) -> None:
        for name, trackers in self._TRACKER_FLAGS.items():
            if getattr(self, name) not in (None, False) and not set(trackers) & set(self.trackers):
                needs = " or ".join(trackers)
                example = ",".join([*self.trackers, trackers[0]])
                raise ConfigError(f"{{{name}}} has no effect without {needs} in {{logger}} (it is {self.logger}): add "
                                  f"{needs} to {{logger}} (e.g. {{logger}} {example}), or drop {{{name}}}", name)

    def _check_positive(self, *names: str) -> None:
        for name in names:
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{{{name}}} must be >= 1 (got {value})", name)

    def default_num_workers(self, devices_per_node: int) -> int:
        """Loader workers per rank when ``--num-workers`` is unset (``DEFAULT_NUM_WORKERS``; None: fitted to
        the cores per rank)."""
        if self.DEFAULT_NUM_WORKERS is not None:
            return self.DEFAULT_NUM_WORKERS
        return default_num_workers(devices_per_node)

    def resolve(self) -> RunPlan:
        """The frozen :class:`~ddp_recipes.config.plan.RunPlan` of this config (see :attr:`plan`)."""
        ddp = DDPOptions(find_unused_parameters=self.find_unused_parameters, static_graph=self.static_graph,
                         comm_hook=self.comm_hook, bucket_cap_mb=self.bucket_cap_mb,
                         sync_batchnorm=self.sync_batchnorm, timeout_s=self.timeout_s,
                         hang_report_s=self.hang_report_s)
        # The recipe's default epochs unless only --max-steps was given (then -1: no epoch limit).
        max_epochs = self.max_epochs if self.max_epochs is not None else (
            -1 if self.max_steps > 0 else self.DEFAULT_MAX_EPOCHS)
        plan = RunPlan.resolve(
            devices=self.devices, num_nodes=self.num_nodes, accelerator=self.accelerator,
            precision=lightning_precision(self.precision, PRECISION_FLAGS),  # the recipes' subset of Lightning's
            ddp=ddp, accumulate_grad_batches=self.accumulate_grad_batches, per_device_batch=self.batch_size,
            global_batch=self.global_batch_size, default_batch=self.DEFAULT_BATCH_SIZE, lr_scaling=self.lr_scaling,
            max_epochs=max_epochs, max_steps=self.max_steps, seed=self.seed, tf32=self.tf32,
            diagnostics=self.diagnostics, base_lr=self.lr if self.lr is not None else self.DEFAULT_LR,
            reference_batch=self.lr_reference_batch or self.DEFAULT_REFERENCE_BATCH, warmup_epochs=self.warmup_epochs,
            compile_backend=self.compile_backend if self.compile else None)
        workers = self.num_workers if self.num_workers is not None else self.default_num_workers(plan.devices)
        return plan.replace(num_workers=workers)

    @property
    def plan(self) -> RunPlan:
        """What runs, resolved once when the config was made: world, accelerator, precision, batch plan, LR,
        loader workers and DDP options. The runner, the trainer and the DataModules read this."""
        return self.__dict__["_plan"]

    @property
    def batch_flag(self) -> str:
        """The batch flag the user set, as messages name it (``--global-batch-size`` when given)."""
        return "{global_batch_size}" if self.global_batch_size is not None else "{batch_size}"

    def check_batch_fits(self, train_samples: int | None) -> None:
        """The per-device batch against the training data's size (None: not known before the ranks start; the
        trainer's :class:`~ddp_recipes.train.callbacks.BatchFitsData` checks it there)."""
        if train_samples is not None:
            self.plan.batch.check_fits(train_samples, self.plan.world_size, self.batch_flag)

    @property
    def trackers(self) -> tuple[str, ...]:
        """``--logger`` as tracker names, in the order given (empty: ``--logger none``)."""
        return parse_trackers(self.logger)

    @property
    def experiment_name(self) -> str:
        """``--experiment``, else the recipe's name."""
        return self.experiment or self.DEFAULT_EXPERIMENT

    @property
    def asked(self) -> dict[str, Any]:
        """The field values as given, before the recipe resolved its defaults (``--print-config`` writes them)."""
        return dict(self.__dict__.get("_asked") or self.to_dict())

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)



def changed_fields(config: Any, *names: str) -> list[str]:
    """The fields of the dataclass ``config`` among ``names`` whose value is not their default, in that order."""
    defaults = {f.name: f.default for f in dataclasses.fields(config)}
    return [name for name in names if getattr(config, name) != defaults[name]]


def refuse_unused(config: Any, needs: list[tuple[bool, tuple[str, ...], str]]) -> None:
    """A field given where it has no effect is refused, never silently dropped. ``needs`` holds, per rule,
    (its requirement is missing, the fields that need it, the requirement in words with ``{field}`` markers)."""
    for missing, names, requirement in needs:
        changed = changed_fields(config, *names) if missing else []
        if changed:
            raise ConfigError(f"{{{changed[0]}}} has no effect without {requirement}; add it or drop "
                              f"{{{changed[0]}}}", changed[0])


def build_from(cls: type, config: Any, renames: dict[str, str] | None = None, **values: Any) -> Any:
    """The dataclass ``cls`` (a component's settings, checked in its ``__post_init__``) from the same-named fields
    of ``config``; ``renames`` maps a field of ``cls`` to the config's field that holds it, ``values`` replace
    the config's. Its :class:`ConfigError` names the config's fields (the flags)."""
    renames = renames or {}
    given = {f.name: getattr(config, renames.get(f.name, f.name)) for f in dataclasses.fields(cls)
             if f.init and hasattr(config, renames.get(f.name, f.name))}
    try:
        return cls(**{**given, **values})
    except ConfigError as err:
        if not renames:
            raise
        raise err.renamed(**renames) from None
