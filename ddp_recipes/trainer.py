"""build_trainer: one call from a single-device script to a correct multi-device Lightning Trainer."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import lightning as L
import torch
from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from ddp_recipes.checkpoint import AtomicCheckpointIO
from ddp_recipes.config import ConfigError, launched_by_torchrun, resolve_world
from ddp_recipes.diagnostics import DDPDiagnostics
from ddp_recipes.perf import InputWaitProfiler, TF32Setting, configure_tf32
from ddp_recipes.resume import ResumeState
from ddp_recipes.strategy import TunedDDPStrategy

PRECISIONS = ("32-true", "16-mixed", "bf16-mixed")
# Launchers that give every process node 0's address and its own ranks (SLURM, LSF, MPI).
SCHEDULER_VARS = ("SLURM_NTASKS", "LSB_JOBID", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")


def resolve_accelerator(accelerator: str = "auto") -> str:
    """'cpu' or 'cuda'. 'gpu' means CUDA; 'auto' picks CUDA when a device is visible."""
    accelerator = accelerator.lower()
    if accelerator == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if accelerator in ("gpu", "cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(f"--accelerator {accelerator} but no CUDA device is visible; use --accelerator cpu")
        return "cuda"
    if accelerator == "cpu":
        return "cpu"
    raise ConfigError(f"--accelerator must be one of auto, cpu, gpu, cuda (got {accelerator!r})")


def resolve_precision(precision: str, accelerator: str) -> str:
    """The precision Lightning will run, with the switch made explicit.

    16-mixed needs CUDA's fp16 kernels and a GradScaler; on CPU we switch to bf16-mixed (same memory and
    speed intent, no loss scaling needed) and say so once. bf16-mixed on a GPU without bf16 is an error.
    """
    if precision not in PRECISIONS:
        raise ConfigError(f"--precision must be one of {', '.join(PRECISIONS)} (got {precision!r})")
    if precision == "16-mixed" and accelerator == "cpu":
        rank_zero_info("--precision 16-mixed needs CUDA (fp16 AMP + GradScaler); using bf16-mixed on CPU instead.")
        return "bf16-mixed"
    if precision == "bf16-mixed" and accelerator == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError("--precision bf16-mixed is not supported by this GPU (pre-Ampere); use --precision 16-mixed")
    return precision


def check_node_env(num_nodes: int) -> None:
    """Several nodes, each started by hand: every node must know node 0's address and its own rank.

    Without MASTER_ADDR Lightning uses 127.0.0.1, which no other node can reach, and node 0 waits the
    whole --timeout-s (30 minutes by default) for nodes that never arrive; fail now instead.
    """
    if num_nodes == 1 or launched_by_torchrun() or any(name in os.environ for name in SCHEDULER_VARS):
        return
    if "MASTER_ADDR" not in os.environ:
        raise ConfigError(f"--num-nodes {num_nodes} needs MASTER_ADDR (node 0's address), MASTER_PORT and NODE_RANK "
                          f"(0..{num_nodes - 1}) set on every node; or launch with torchrun --nnodes or srun")
    node_rank = os.environ.get("NODE_RANK", os.environ.get("GROUP_RANK", "0"))
    if not node_rank.isdigit() or int(node_rank) >= num_nodes:
        raise ConfigError(f"NODE_RANK={node_rank} does not fit --num-nodes {num_nodes}; "
                          f"set NODE_RANK to 0..{num_nodes - 1}, a different one on each node")


def build_trainer(
    *,
    devices: int | None = None,
    num_nodes: int | None = None,
    accelerator: str = "auto",
    precision: str = "32-true",
    sync_batchnorm: bool = False,
    find_unused_parameters: bool = False,
    static_graph: bool = False,
    comm_hook: str = "none",
    bucket_cap_mb: float | None = None,
    seed: int | None = None,
    accumulate_grad_batches: int = 1,
    max_epochs: int | None = None,
    max_steps: int = -1,
    timeout_s: float | None = None,
    diagnostics: bool = True,
    lr_scaling: str | None = None,
    warmup_epochs: float | None = None,
    reference_batch: int | None = None,
    global_batch: int | None = None,
    tf32: bool = True,
    strategy_kwargs: dict[str, Any] | None = None,
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
    GPUs (no effect on CPU). Unless a ``profiler`` is given, :class:`~ddp_recipes.perf.InputWaitProfiler`
    times the loop's wait for each batch. Any other keyword goes to ``lightning.Trainer``;
    ``strategy_kwargs`` to TunedDDPStrategy.
    """
    accel = resolve_accelerator(accelerator)
    devices, num_nodes = resolve_world(devices, num_nodes)
    check_node_env(num_nodes)
    if accel == "cuda" and devices > torch.cuda.device_count():
        raise ConfigError(f"--devices {devices} but only {torch.cuda.device_count()} CUDA device(s) are visible; "
                         f"use --devices {torch.cuda.device_count()} or more nodes (--num-nodes)")
    precision = resolve_precision(precision, accel)
    if accumulate_grad_batches < 1:
        raise ConfigError(f"--accumulate-grad-batches must be >= 1 (got {accumulate_grad_batches})")
    configure_tf32(tf32, accel)
    trainer_kwargs.setdefault("profiler", InputWaitProfiler())
    # Again in each rank at set-up: ranks of the spawn launcher do not inherit this process's setting.
    callbacks_tf32 = [TF32Setting(tf32)] if accel == "cuda" else []
    if seed is not None:
        # Same seed on every rank before the model is built: identical initial weights everywhere.
        L.seed_everything(seed, workers=True, verbose=False)

    plugins = list(trainer_kwargs.pop("plugins", None) or [])
    if not any(isinstance(p, CheckpointIO) for p in plugins):
        plugins.append(AtomicCheckpointIO())  # a kill mid-save keeps the previous checkpoint intact
    callbacks = [*(trainer_kwargs.pop("callbacks", None) or []), *callbacks_tf32]
    if not any(isinstance(c, ResumeState) for c in callbacks):
        # Per-rank streams from seed + rank once training starts; a resumed run gets the checkpoint's
        # streams, loader position and comm-hook state back instead (and this run's LRs).
        callbacks.append(ResumeState(seed=seed))
    if diagnostics and not any(isinstance(c, DDPDiagnostics) for c in callbacks):
        callbacks.append(DDPDiagnostics(lr_scaling=lr_scaling, warmup_epochs=warmup_epochs,
                                        reference_batch=reference_batch, global_batch=global_batch))
    distributed = devices * num_nodes > 1
    if "strategy" not in trainer_kwargs:
        if distributed:
            trainer_kwargs["strategy"] = TunedDDPStrategy(
                find_unused_parameters=find_unused_parameters,
                static_graph=static_graph,
                bucket_cap_mb=bucket_cap_mb,
                comm_hook=comm_hook,
                seed=seed,
                timeout=timedelta(seconds=timeout_s) if timeout_s else None,
                **(strategy_kwargs or {}),
            )
        else:
            if comm_hook != "none" or find_unused_parameters or sync_batchnorm:
                rank_zero_info("1 device: no DDP wrap, so --comm-hook, --find-unused-parameters and "
                               "--sync-batchnorm have nothing to do.")
            trainer_kwargs["strategy"] = "auto"
    return L.Trainer(
        accelerator="gpu" if accel == "cuda" else "cpu",
        devices=devices,
        num_nodes=num_nodes,
        precision=precision,
        sync_batchnorm=sync_batchnorm and distributed,
        accumulate_grad_batches=accumulate_grad_batches,
        max_epochs=max_epochs,
        max_steps=max_steps,
        plugins=plugins,
        callbacks=callbacks,
        **trainer_kwargs,
    )
