"""build_trainer: one call from a single-device script to a correct multi-device Lightning Trainer."""

from __future__ import annotations

import inspect
from typing import Any

import lightning as L
from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from ddp_recipes.checkpointing.checkpoint import AtomicCheckpointIO
from ddp_recipes.checkpointing.resume import ResumeState
from ddp_recipes.config.plan import DDPOptions, RunPlan
from ddp_recipes.config.world import (
    check_node_env,
)
from ddp_recipes.ddp.strategy import TunedDDPStrategy
from ddp_recipes.errors import ConfigError
from ddp_recipes.train.diagnostics import DDPDiagnostics
from ddp_recipes.train.perf import InputWaitProfiler, TF32Setting, configure_tf32


def build_trainer(
    *,
    plan: RunPlan | None = None,
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
    ddp: DDPOptions | None = None,
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
    GPUs (no effect on CPU). Unless a ``profiler`` is given, :class:`~ddp_recipes.train.perf.InputWaitProfiler`
    times the loop's wait for each batch. Any other keyword goes to ``lightning.Trainer``;
    ``strategy_kwargs`` to TunedDDPStrategy.

    The DDP knobs may come as one :class:`~ddp_recipes.config.plan.DDPOptions` (``ddp=``) instead of the flat
    keywords, and everything a recipe resolved as one :class:`~ddp_recipes.config.plan.RunPlan` (``plan=``, what
    ``RunConfig.plan`` gives); then the run keywords above must stay unset.
    """
    if plan is None:
        flat_ddp = DDPOptions(find_unused_parameters=find_unused_parameters, static_graph=static_graph,
                              comm_hook=comm_hook, bucket_cap_mb=bucket_cap_mb, sync_batchnorm=sync_batchnorm,
                              timeout_s=timeout_s)
        if ddp is not None and flat_ddp != DDPOptions():
            raise ConfigError("pass the DDP options either as {ddp} or as keywords (find_unused_parameters, "
                              "comm_hook, ...), not both")
        plan = RunPlan.resolve(devices=devices, num_nodes=num_nodes, accelerator=accelerator, precision=precision,
                               ddp=ddp or flat_ddp, accumulate_grad_batches=accumulate_grad_batches,
                               lr_scaling=lr_scaling, max_epochs=max_epochs, max_steps=max_steps, seed=seed,
                               tf32=tf32, diagnostics=diagnostics, warmup_epochs=warmup_epochs,
                               reference_batch=reference_batch)
    else:
        given = {name: value for name, value in locals().items() if name in _RUN_DEFAULTS}
        decided = sorted(name for name, value in given.items() if value != _RUN_DEFAULTS[name])
        if decided:
            raise ConfigError(f"{{plan}} already decides {', '.join(decided)}; pass the plan alone, or "
                              "plan.replace(...) to change it")
        global_batch = plan.batch.global_batch if plan.batch else None
    return _trainer_for(plan, global_batch, strategy_kwargs, trainer_kwargs)


# build_trainer's run keywords and their defaults: with a plan, each must stay at its default.
_RUN_DEFAULTS = {name: p.default for name, p in inspect.signature(build_trainer).parameters.items()
                 if p.kind is p.KEYWORD_ONLY and name not in ("plan", "strategy_kwargs")}


def _trainer_for(plan: RunPlan, global_batch: int | None, strategy_kwargs: dict[str, Any] | None,
                 trainer_kwargs: dict[str, Any]) -> L.Trainer:
    check_node_env(plan.num_nodes)  # here, not in the plan: a config may be made on any machine
    configure_tf32(plan.tf32, plan.accelerator)
    trainer_kwargs.setdefault("profiler", InputWaitProfiler())
    if plan.seed is not None:
        # Same seed on every rank before the model is built: identical initial weights everywhere.
        L.seed_everything(plan.seed, workers=True, verbose=False)

    plugins = list(trainer_kwargs.pop("plugins", None) or [])
    if not any(isinstance(p, CheckpointIO) for p in plugins):
        plugins.append(AtomicCheckpointIO())  # a kill mid-save keeps the previous checkpoint intact
    callbacks = list(trainer_kwargs.pop("callbacks", None) or [])
    if plan.accelerator == "cuda":
        callbacks.append(TF32Setting(plan.tf32))  # again in each rank: spawned ranks do not inherit it
    if not any(isinstance(c, ResumeState) for c in callbacks):
        # Per-rank streams from seed + rank once training starts; a resumed run gets the checkpoint's
        # streams, loader position and comm-hook state back instead (and this run's LRs).
        callbacks.append(ResumeState(seed=plan.seed))
    if plan.diagnostics and not any(isinstance(c, DDPDiagnostics) for c in callbacks):
        callbacks.append(DDPDiagnostics(lr_scaling=plan.lr_scaling, warmup_epochs=plan.warmup_epochs,
                                        reference_batch=plan.reference_batch, global_batch=global_batch))
    ddp = plan.ddp
    if "strategy" not in trainer_kwargs:
        if plan.distributed:
            trainer_kwargs["strategy"] = TunedDDPStrategy.from_options(ddp, seed=plan.seed, **(strategy_kwargs or {}))
        else:
            if ddp.comm_hook != "none" or ddp.find_unused_parameters or ddp.sync_batchnorm:
                rank_zero_info("1 device: no DDP wrap, so --comm-hook, --find-unused-parameters and "
                               "--sync-batchnorm have nothing to do.")
            trainer_kwargs["strategy"] = "auto"
    return L.Trainer(
        accelerator="gpu" if plan.accelerator == "cuda" else "cpu",
        devices=plan.devices,
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
