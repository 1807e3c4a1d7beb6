"""Learning-rate schedules for data-parallel training: warm up, then cosine (or the torchvision reference's
schedules), stepped per optimizer step.

Going from 1 to N devices multiplies the global batch by N. The write-up's advice: scale the LR with it
(linear, Goyal et al. 2017; or sqrt, the gentler rule for adaptive optimizers) from the batch the LR was
tuned for, which :func:`ddp_recipes.config.plan.scale_lr` does once into the run's plan, and warm up for a
few epochs (here) so the large early steps do not blow up training.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR

from ddp_recipes.config.schedule import ReferenceSchedule
from ddp_recipes.config.schedule import ScheduleArgs as ScheduleArgs
from ddp_recipes.errors import ConfigError


def warmup_cosine_factor(step: int, warmup_steps: int, total_steps: int, min_factor: float = 0.0) -> float:
    """Multiplier of the peak LR at optimizer step ``step`` (0-based).

    Linear warm-up from 1/warmup_steps to 1 over ``warmup_steps`` steps, then a half cosine down to
    ``min_factor`` at ``total_steps``. With no warm-up and no known total, the LR is constant.
    """
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if total_steps <= 0 or total_steps <= warmup_steps:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
    return min_factor + (1.0 - min_factor) * 0.5 * (1.0 + math.cos(math.pi * progress))


class RunSizedLR(LambdaLR):
    """A per-step LambdaLR with the run length its curve was sized for: ``run_steps`` (None where the curve does
    not depend on it). :class:`~ddp_recipes.checkpointing.exact_continuation.ResumeState` saves it and warns
    when a continued run re-sizes the curve; LambdaLR's state dict carries it too."""

    def __init__(self, optimizer: torch.optim.Optimizer, lr_lambda: Any, run_steps: int | None) -> None:
        super().__init__(optimizer, lr_lambda)
        self.run_steps = run_steps or None


def schedule_length(scheduler: Any) -> int | None:
    """The run length ``scheduler``'s curve was sized for (:class:`RunSizedLR`), None for any other."""
    return scheduler.run_steps if isinstance(scheduler, RunSizedLR) else None


def warmup_cosine(optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int,
                  min_factor: float = 0.0) -> RunSizedLR:
    """A LambdaLR to be stepped once per optimizer step (Lightning: ``interval="step"``), sized for
    ``total_steps`` (0: no decay)."""
    if warmup_steps < 0:
        raise ConfigError(f"warm-up steps must be >= 0 (got {warmup_steps})")
    return RunSizedLR(optimizer, lambda step: warmup_cosine_factor(step, warmup_steps, total_steps, min_factor),
                      total_steps)


def lightning_scheduler(optimizer: torch.optim.Optimizer, trainer, warmup_epochs: float, cosine: bool = True,
                        min_factor: float = 0.0) -> dict | None:
    """The ``lr_scheduler`` entry for ``configure_optimizers``: warm-up + cosine over the whole fit, per step.

    The step counts come from the trainer, so they are right for any world size, accumulation and
    ``--max-steps``/``--max-epochs``. Returns None when there is nothing to schedule (no warm-up, no cosine).
    """
    estimate = trainer.estimated_stepping_batches if trainer is not None else 0
    # inf when neither max_steps nor max_epochs bounds the fit (max_epochs=-1): nothing to decay over.
    total = int(estimate) if math.isfinite(estimate) and 0 < estimate < 2**62 else 0
    per_epoch = steps_per_epoch(trainer)
    warmup_steps = int(round(warmup_epochs * per_epoch)) if warmup_epochs > 0 else 0
    if warmup_steps == 0 and not (cosine and total):
        return None
    scheduler = warmup_cosine(optimizer, warmup_steps, total if cosine else 0, min_factor)
    return {"scheduler": scheduler, "interval": "step", "frequency": 1}


def steps_per_epoch(trainer, size_loader: bool = True) -> int:
    """Optimizer steps in one epoch on this rank (the dataloader is already sharded when this runs); 0 when
    unknown. ``size_loader``: size a training loader not sized yet through the fit loop (``configure_optimizers``
    runs before Lightning sizes it); False: 0 then (a checkpoint's state, which must not set up data)."""
    if trainer is None:
        return 0
    batches = trainer.num_training_batches
    if size_loader and (not isinstance(batches, int) or batches <= 0):
        trainer.fit_loop.setup_data()
        batches = trainer.num_training_batches
    if not isinstance(batches, int | float) or not math.isfinite(batches) or batches <= 0:
        return 0
    return max(1, math.ceil(int(batches) / max(1, trainer.accumulate_grad_batches)))


# ---- torchvision's classification reference: --lr-scheduler, --lr-warmup-*, per optimizer step ---------

# ReferenceSchedule and ScheduleArgs live in ddp_recipes.config.schedule, torch-free: a recipe checks its flags
# before torch loads.

def reference_factor(step: int, schedule: ReferenceSchedule, steps_per_epoch: int, total_steps: int,
                     warmup_steps: int = 0, min_factor: float = 0.0) -> float:
    """Multiplier of the base LR at optimizer step ``step`` (0-based) under the reference's ``schedule``.

    Warm-up, the first ``warmup_steps`` steps: ``linear`` ramps per step from ``lr_warmup_decay`` towards 1
    (the reference's per-epoch ``LinearLR``, met exactly at every epoch boundary); ``constant`` holds
    ``lr_warmup_decay``. Then the main schedule, started afresh at the warm-up's end as the reference's
    ``SequentialLR`` does:

    * ``steplr``: ``lr_gamma ** (e // lr_step_size)``, ``e`` the epochs since the warm-up, counted at epoch
      boundaries (``step // steps_per_epoch - warmup_steps // steps_per_epoch``);
    * ``exponentiallr``: ``lr_gamma ** e``, same ``e``;
    * ``cosineannealinglr``: per step, a half cosine from 1 down to ``min_factor`` over the steps from the
      warm-up's end to ``total_steps`` (held there after it, where the reference's would rise again).
    """
    if step < warmup_steps:
        if schedule.lr_warmup_method == "linear":
            return schedule.lr_warmup_decay + (1.0 - schedule.lr_warmup_decay) * step / warmup_steps
        return schedule.lr_warmup_decay
    if schedule.lr_scheduler == "cosineannealinglr":
        span = total_steps - warmup_steps
        if span <= 0:
            return 1.0
        progress = min(1.0, (step - warmup_steps) / span)
        return min_factor + (1.0 - min_factor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    epochs = step // steps_per_epoch - warmup_steps // steps_per_epoch
    if schedule.lr_scheduler == "steplr":
        return schedule.lr_gamma ** (epochs // schedule.lr_step_size)
    return schedule.lr_gamma ** epochs  # exponentiallr


def reference_scheduler(optimizer: torch.optim.Optimizer, steps_per_epoch: int, total_steps: int,
                        schedule: ReferenceSchedule) -> RunSizedLR:
    """The reference's ``--lr-scheduler`` (with its ``SequentialLR`` warm-up) as one LambdaLR to be stepped
    once per optimizer step (Lightning: ``interval="step"``).

    Epochs become optimizer steps with ``steps_per_epoch`` (``lr_warmup_epochs`` may be fractional:
    ``round(lr_warmup_epochs * steps_per_epoch)`` steps); ``total_steps`` is the whole run's (cosine decays
    over it). ``lr_min`` is an absolute LR, as the reference's ``eta_min``: each parameter group gets its own
    floor factor from its initial LR. The factors are pure functions of the step, so a resumed run continues
    exactly from the scheduler's saved step count.
    """
    name, warmup_epochs = schedule.lr_scheduler, schedule.lr_warmup_epochs
    unknown = "but the training loader's length is unknown (an iterable dataset?)"
    if steps_per_epoch < 1 and name != "cosineannealinglr":
        raise ConfigError(f"{{lr_scheduler}} {name} counts epochs, {unknown}: use cosineannealinglr")
    if steps_per_epoch < 1 and warmup_epochs > 0:
        raise ConfigError(f"{{lr_warmup_epochs}} counts epochs, {unknown}")
    if name == "cosineannealinglr" and total_steps < 1:
        raise ConfigError("{lr_scheduler} cosineannealinglr decays over the whole run, which has no end here: "
                          "bound it with {max_epochs} or {max_steps}")
    warmup_steps = int(round(warmup_epochs * steps_per_epoch)) if warmup_epochs > 0 else 0

    def factor_fn(base_lr: float):
        # A plain closure: LambdaLR saves no state for functions, so a resume rebuilds it from this run's LR.
        min_factor = schedule.lr_min / base_lr if base_lr > 0 else 0.0
        return lambda step: reference_factor(step, schedule, steps_per_epoch, total_steps, warmup_steps, min_factor)

    bases = [group.get("initial_lr", group["lr"]) for group in optimizer.param_groups]
    return RunSizedLR(optimizer, [factor_fn(base) for base in bases],
                      total_steps if name == "cosineannealinglr" else None)


def lightning_reference_scheduler(optimizer: torch.optim.Optimizer, trainer, schedule: ReferenceSchedule) -> dict:
    """The ``lr_scheduler`` entry for ``configure_optimizers``: :func:`reference_scheduler` per optimizer step,
    with the epoch length and the run's length from the trainer (any world size, accumulation,
    ``--max-steps``/``--max-epochs``)."""
    estimate = trainer.estimated_stepping_batches if trainer is not None else 0
    total = int(estimate) if math.isfinite(estimate) and 0 < estimate < 2**62 else 0
    scheduler = reference_scheduler(optimizer, steps_per_epoch(trainer), total, schedule)
    return {"scheduler": scheduler, "interval": "step", "frequency": 1}
