"""The run configuration shared by every recipe, and the CLI generated from it.

A recipe subclasses :class:`RunConfig` (a dataclass), adds its own fields, and gets flat kebab-case flags
(``--devices``, ``--max-steps``) from :func:`parse_config`. Each field carries a one-line ``help`` in its
metadata; validation lives in ``__post_init__`` and names the flag it rejects.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import tempfile
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin

from ddp_recipes.choices import (  # noqa: F401 - re-exported: the config's choice lists
    ACCELERATORS,
    COMM_HOOKS,
    LR_SCALING_RULES,
    PRECISIONS,
    Accelerator,
    CommHook,
    LRScaling,
    Precision,
    check_choice,
)
from ddp_recipes.errors import CheckpointError, ConfigError, DataError, flag  # noqa: F401 - re-exported
from ddp_recipes.world import launched_by_torchrun, resolve_world  # noqa: F401 - re-exported


def opt(default: Any, help: str, **kwargs: Any) -> Any:  # noqa: A002 - mirrors argparse's word
    """A dataclass field with a one-line help text for its CLI flag."""
    if isinstance(default, list | dict):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help, **kwargs})
    return field(default=default, metadata={"help": help, **kwargs})


@dataclass
class RunConfig:
    """Everything about *how* a recipe runs: devices, precision, batch arithmetic, DDP knobs, seed."""

    devices: int | None = opt(None, "devices (processes) per node; default 1, or torchrun's --nproc-per-node")
    num_nodes: int | None = opt(None, "number of nodes; default 1, or torchrun's --nnodes")
    accelerator: str = opt("auto", "cpu, gpu/cuda or auto (CUDA when available)", choices=ACCELERATORS)
    precision: str = opt("32-true", "32-true, 16-mixed (CUDA; bf16-mixed on CPU) or bf16-mixed", choices=PRECISIONS)
    max_epochs: int | None = opt(None, "stop after this many epochs (recipe default when neither limit is set)")
    max_steps: int = opt(-1, "stop after this many optimizer steps (-1: no step limit)")
    batch_size: int | None = opt(None, "per-device batch size (default: recipe's, or derived from --global-batch-size)")
    global_batch_size: int | None = opt(
        None, "samples per optimizer step over all devices = batch-size x world size x accumulation"
    )
    accumulate_grad_batches: int | None = opt(None, "micro-batches per optimizer step (all-reduce only on the last)")
    lr: float | None = opt(None, "base learning rate at --lr-reference-batch (recipe default when unset)")
    lr_scaling: str = opt("linear", "scale the LR from --lr-reference-batch to the global batch: linear, sqrt or none",
                          choices=LR_SCALING_RULES)
    lr_reference_batch: int | None = opt(None, "the global batch the base --lr was tuned for (recipe default)")
    warmup_epochs: float = opt(0.0, "linear LR warm-up length in epochs, then cosine decay (0: constant LR)")
    seed: int = opt(42, "base seed; every rank seeds its random streams with seed + global rank")
    sync_batchnorm: bool = opt(False, "synchronise BatchNorm statistics across ranks (CPU and CUDA)")
    find_unused_parameters: bool = opt(False, "let DDP handle parameters that get no gradient (slower)")
    static_graph: bool = opt(False, "tell DDP the graph is the same every step (enables more optimisations)")
    comm_hook: str = opt("none", "gradient compression for the all-reduce: none, fp16, bf16, powersgd", choices=COMM_HOOKS)
    bucket_cap_mb: float = opt(25.0, "DDP gradient bucket size in MiB")
    timeout_s: float = opt(1800.0, "seconds a collective may wait before the run fails instead of hanging")
    output_dir: str = opt("runs/default", "where logs, checkpoints and summary.json go")
    resume: str = opt("none", "none, auto (the newest complete checkpoint in --output-dir) or a checkpoint PATH")
    checkpoint_every_n_steps: int = opt(0, "also save last.ckpt every N optimizer steps (it is always saved at "
                                           "each epoch end and on SIGTERM/SLURM's requeue signal)")
    compile: bool = opt(False, "torch.compile the model; under DDP its DDPOptimizer splits the graph at gradient-bucket "
                               "boundaries so the all-reduce still overlaps backward (compile time is reported apart)")
    compile_backend: str = opt("inductor", "torch.compile backend: inductor (generated kernels), aot_eager (no "
                                           "code generation: checks a model compiles), cudagraphs, ...")
    tf32: bool = opt(True, "FP32 matmuls and convolutions as TF32 on Ampere+ GPUs (NVIDIA's FP32 figures use it; "
                           "no effect on CPU or under bf16/16-mixed autocast regions)")
    num_workers: int | None = opt(None, "DataLoader workers per rank (default: fitted to the cores per rank)")
    model_class: str | None = opt(None, "your LightningModule, package.module:ClassName (a subclass of the recipe's "
                                        "module; recorded in checkpoints so --resume rebuilds it)")
    datamodule_class: str | None = opt(None, "your LightningDataModule, package.module:ClassName (its __init__ gets "
                                             "batch_size and the recipe's data flags it declares)")
    diagnostics: bool = opt(True, "check the run for DDP mistakes (unsharded data, drifting weights, ...) and warn once")

    # The recipe's defaults, used where the flags above are left unset. Subclasses override these.
    DEFAULT_BATCH_SIZE: typing.ClassVar[int] = 64
    DEFAULT_LR: typing.ClassVar[float] = 0.01
    DEFAULT_REFERENCE_BATCH: typing.ClassVar[int] = 64
    DEFAULT_MAX_EPOCHS: typing.ClassVar[int] = 5

    def __post_init__(self) -> None:
        self._check_positive("devices", "num_nodes", "batch_size", "global_batch_size", "accumulate_grad_batches",
                             "lr_reference_batch", "max_epochs")
        if self.max_steps == 0 or self.max_steps < -1:
            raise ConfigError(f"--max-steps must be a positive step count or -1 for no limit (got {self.max_steps})")
        for name, choices in (("precision", PRECISIONS), ("comm_hook", COMM_HOOKS),
                              ("lr_scaling", LR_SCALING_RULES), ("accelerator", ACCELERATORS)):
            value = getattr(self, name)
            if value not in choices:
                raise ConfigError(f"{flag(name)} must be one of {', '.join(choices)} (got {value!r})")
        if self.lr is not None and not (self.lr > 0 and math.isfinite(self.lr)):
            raise ConfigError(f"--lr must be a positive number (got {self.lr})")
        if self.warmup_epochs < 0:
            raise ConfigError(f"--warmup-epochs must be >= 0 (got {self.warmup_epochs})")
        if self.timeout_s <= 0:
            raise ConfigError(f"--timeout-s must be > 0 seconds (got {self.timeout_s})")
        if self.bucket_cap_mb <= 0:
            raise ConfigError(f"--bucket-cap-mb must be > 0 (got {self.bucket_cap_mb})")
        if self.num_workers is not None and self.num_workers < 0:
            raise ConfigError(f"--num-workers must be >= 0 (got {self.num_workers})")
        if self.compile:
            from torch._dynamo import list_backends

            known = list_backends(exclude_tags=())
            if self.compile_backend not in known:
                raise ConfigError(f"--compile-backend must be one of {', '.join(sorted(known))} "
                                  f"(got {self.compile_backend!r})")
        if self.checkpoint_every_n_steps < 0:
            raise ConfigError(f"--checkpoint-every-n-steps must be >= 0 (got {self.checkpoint_every_n_steps})")
        resolve_world(self.devices, self.num_nodes)  # torchrun agreement, with the flag named
        # Resolve the batch arithmetic now, so that a bad combination fails before any process starts.
        self.batch_plan()

    def _check_positive(self, *names: str) -> None:
        for name in names:
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{flag(name)} must be >= 1 (got {value})")

    # ---- resolved values ------------------------------------------------------------------------------

    @property
    def resolved_devices(self) -> int:
        return resolve_world(self.devices, self.num_nodes)[0]

    @property
    def resolved_num_nodes(self) -> int:
        return resolve_world(self.devices, self.num_nodes)[1]

    @property
    def world_size(self) -> int:
        return self.resolved_devices * self.resolved_num_nodes

    def batch_plan(self) -> tuple[int, int, int]:
        """(per-device batch, accumulation, global batch), from whichever of the three flags were given."""
        world = self.world_size
        per_device, accum, global_batch = self.batch_size, self.accumulate_grad_batches, self.global_batch_size
        if global_batch is None:
            per_device = per_device or self.DEFAULT_BATCH_SIZE
            accum = accum or 1
            return per_device, accum, per_device * world * accum
        if per_device is None:
            accum = accum or 1
            if global_batch % (world * accum):
                raise ConfigError(
                    f"--global-batch-size {global_batch} is not divisible by world size x accumulation = "
                    f"{world} x {accum}; pick a multiple of {world * accum} or change --accumulate-grad-batches"
                )
            return global_batch // (world * accum), accum, global_batch
        derived, rest = divmod(global_batch, per_device * world)
        if rest or derived < 1:
            raise ConfigError(
                f"--global-batch-size {global_batch} is not a multiple of --batch-size x world size = "
                f"{per_device} x {world}; pick a multiple of {per_device * world}"
            )
        if accum is not None and accum != derived:
            raise ConfigError(
                f"--accumulate-grad-batches {accum} contradicts --global-batch-size {global_batch} = "
                f"{per_device} x {world} devices x {derived}; give two of the three, not all three"
            )
        return per_device, derived, global_batch

    @property
    def per_device_batch_size(self) -> int:
        return self.batch_plan()[0]

    @property
    def accumulation(self) -> int:
        return self.batch_plan()[1]

    @property
    def resolved_global_batch_size(self) -> int:
        return self.batch_plan()[2]

    @property
    def base_lr(self) -> float:
        return self.lr if self.lr is not None else self.DEFAULT_LR

    @property
    def reference_batch(self) -> int:
        return self.lr_reference_batch or self.DEFAULT_REFERENCE_BATCH

    @property
    def resolved_max_epochs(self) -> int | None:
        """Epoch limit: the flag, else the recipe default unless only --max-steps was given."""
        if self.max_epochs is not None:
            return self.max_epochs
        return None if self.max_steps > 0 else self.DEFAULT_MAX_EPOCHS

    def trainer_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of :func:`ddp_recipes.build_trainer` that this config decides."""
        return dict(
            devices=self.resolved_devices,
            num_nodes=self.resolved_num_nodes,
            accelerator=self.accelerator,
            precision=self.precision,
            sync_batchnorm=self.sync_batchnorm,
            find_unused_parameters=self.find_unused_parameters,
            static_graph=self.static_graph,
            comm_hook=self.comm_hook,
            bucket_cap_mb=self.bucket_cap_mb,
            seed=self.seed,
            accumulate_grad_batches=self.accumulation,
            max_epochs=self.resolved_max_epochs if self.resolved_max_epochs is not None else -1,
            max_steps=self.max_steps,
            timeout_s=self.timeout_s,
            diagnostics=self.diagnostics,
            lr_scaling=self.lr_scaling,
            warmup_epochs=self.warmup_epochs,
            reference_batch=self.reference_batch,
            global_batch=self.resolved_global_batch_size,
            tf32=self.tf32,
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ---- CLI generation ------------------------------------------------------------------------------------

C = TypeVar("C", bound=RunConfig)


def _base_type(annotation: Any) -> tuple[type, bool]:
    """(scalar type, optional?) of a field annotation such as ``int | None``."""
    args = [a for a in get_args(annotation) if a is not type(None)]
    if get_origin(annotation) is Literal:
        return type(get_args(annotation)[0]), False
    if args:
        return args[0], len(args) < len(get_args(annotation))
    return annotation, False


def _bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def build_parser(cls: type[RunConfig], prog: str | None = None, description: str | None = None) -> argparse.ArgumentParser:
    """An argparse parser with one flat kebab-case flag per field of the config dataclass."""
    parser = argparse.ArgumentParser(prog=prog, description=description,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init or f.name.startswith("_"):
            continue
        kind, _ = _base_type(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        help_text = f.metadata.get("help", "")
        if kind is bool:
            # --sync-batchnorm turns it on, --no-sync-batchnorm off: no value needed.
            parser.add_argument(flag(f.name), dest=f.name, action=argparse.BooleanOptionalAction,
                                default=default, help=help_text)
            continue
        kwargs: dict[str, Any] = {"dest": f.name, "default": default, "help": help_text, "type": kind}
        if "choices" in f.metadata:
            kwargs["choices"] = f.metadata["choices"]
            kwargs["metavar"] = "{" + ",".join(f.metadata["choices"]) + "}"
        parser.add_argument(flag(f.name), **kwargs)
    return parser


def writable_dir(path: str, flag_name: str) -> Path:
    """Create ``path`` if needed (rank-safe) and prove it is writable, or raise naming ``flag_name``."""
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".write-test-"):
            pass
    except OSError as err:
        raise ConfigError(f"{flag_name} {path} is not writable ({err.strerror}); pass a writable {flag_name}") from None
    return out


def fail(message: str, prog: str) -> typing.NoReturn:
    """Print a one-line error naming the flag and exit 2, argparse's convention for bad usage."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def parse_config(cls: type[C], argv: list[str] | None = None, prog: str | None = None,
                 description: str | None = None) -> C:
    """Parse ``argv`` into ``cls``; a bad value exits 2 with a one-line message naming the flag."""
    parser = build_parser(cls, prog=prog, description=description)
    namespace = parser.parse_args(argv)
    try:
        return cls(**vars(namespace))
    except ConfigError as err:
        fail(str(err), parser.prog)
