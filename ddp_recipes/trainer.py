"""build_trainer: one call from a single-device script to a correct multi-device Lightning Trainer."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import lightning as L
from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from ddp_recipes.checkpoint import AtomicCheckpointIO
from ddp_recipes.diagnostics import DDPDiagnostics
from ddp_recipes.errors import ConfigError
from ddp_recipes.perf import InputWaitProfiler, TF32Setting, configure_tf32
from ddp_recipes.resume import ResumeState
from ddp_recipes.strategy import TunedDDPStrategy
from ddp_recipes.world import (
    check_devices,
    check_node_env,
    resolve_accelerator,
    resolve_precision,
    resolve_world,
)


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
    check_devices(devices, accel)
    precision = resolve_precision(precision, accel)
    if accumulate_grad_batches < 1:
        raise ConfigError(f"{{accumulate_grad_batches}} must be >= 1 (got {accumulate_grad_batches})")
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
