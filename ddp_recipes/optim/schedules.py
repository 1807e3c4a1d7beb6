"""Learning-rate rules for data-parallel training: scale with the global batch, warm up, then cosine.

Going from 1 to N devices multiplies the global batch by N. The write-up's advice: scale the LR with it
(linear, Goyal et al. 2017; or sqrt, the gentler rule for adaptive optimizers) from the batch the LR was
tuned for, and warm up for a few epochs so the large early steps do not blow up training.
"""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from ddp_recipes.config.choices import LR_SCHEDULERS, WARMUP_METHODS, check_choice
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


def warmup_cosine(optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int,
                  min_factor: float = 0.0) -> LambdaLR:
    """A LambdaLR to be stepped once per optimizer step (Lightning: ``interval="step"``)."""
    if warmup_steps < 0:
        raise ConfigError(f"warm-up steps must be >= 0 (got {warmup_steps})")
    return LambdaLR(optimizer, lambda step: warmup_cosine_factor(step, warmup_steps, total_steps, min_factor))


def lightning_scheduler(optimizer: torch.optim.Optimizer, trainer, warmup_epochs: float, cosine: bool = True,
                        min_factor: float = 0.0) -> dict | None:
    """The ``lr_scheduler`` entry for ``configure_optimizers``: warm-up + cosine over the whole fit, per step.

    The step counts come from the trainer, so they are right for any world size, accumulation and
    ``--max-steps``/``--max-epochs``. Returns None when there is nothing to schedule (no warm-up, no cosine).
    """
    estimate = trainer.estimated_stepping_batches if trainer is not None else 0
    # inf when neither max_steps nor max_epochs bounds the fit (max_epochs=-1): nothing to decay over.
    total = int(estimate) if math.isfinite(estimate) and 0 < estimate < 2**62 else 0
    steps_per_epoch = _steps_per_epoch(trainer)
    warmup_steps = int(round(warmup_epochs * steps_per_epoch)) if warmup_epochs > 0 else 0
    if warmup_steps == 0 and not (cosine and total):
        return None
    scheduler = warmup_cosine(optimizer, warmup_steps, total if cosine else 0, min_factor)
    return {"scheduler": scheduler, "interval": "step", "frequency": 1}


def _steps_per_epoch(trainer) -> int:
    """Optimizer steps in one epoch on this rank (the dataloader is already sharded when this runs)."""
    if trainer is None:
        return 0
    batches = trainer.num_training_batches
    if not isinstance(batches, int) or batches <= 0:
        # configure_optimizers runs before the train dataloader is sized; size it through the fit loop.
        trainer.fit_loop.setup_data()
        batches = trainer.num_training_batches
    if not isinstance(batches, int | float) or not math.isfinite(batches) or batches <= 0:
        return 0
    return max(1, math.ceil(int(batches) / max(1, trainer.accumulate_grad_batches)))


# ---- torchvision's classification reference: --lr-scheduler, --lr-warmup-*, per optimizer step ---------

def check_reference_schedule(lr_scheduler: str = "steplr", lr_step_size: int = 30, lr_gamma: float = 0.1,
                             lr_min: float = 0.0, lr_warmup_epochs: float = 0.0, lr_warmup_method: str = "constant",
                             lr_warmup_decay: float = 0.01) -> None:
    """A :class:`~ddp_recipes.errors.ConfigError` naming the parameter unless the reference schedule's
    settings make sense (needs no trainer: call it where the config is validated)."""
    check_choice("lr_scheduler", lr_scheduler, LR_SCHEDULERS)
    check_choice("lr_warmup_method", lr_warmup_method, WARMUP_METHODS)
    if isinstance(lr_step_size, bool) or not isinstance(lr_step_size, int) or lr_step_size < 1:
        raise ConfigError(f"{{lr_step_size}} must be a whole number of epochs >= 1 (got {lr_step_size!r})")
    if not 0 < lr_gamma <= 1:
        raise ConfigError(f"{{lr_gamma}} must be in (0, 1] (got {lr_gamma})")
    if not (math.isfinite(lr_min) and lr_min >= 0):
        raise ConfigError(f"{{lr_min}} must be >= 0 (got {lr_min})")
    if not (math.isfinite(lr_warmup_epochs) and lr_warmup_epochs >= 0):
        raise ConfigError(f"{{lr_warmup_epochs}} must be >= 0 (got {lr_warmup_epochs})")
    if not 0 < lr_warmup_decay <= 1:
        raise ConfigError(f"{{lr_warmup_decay}} must be in (0, 1] (got {lr_warmup_decay})")


def reference_factor(step: int, lr_scheduler: str, steps_per_epoch: int, total_steps: int, warmup_steps: int = 0,
                     lr_step_size: int = 30, lr_gamma: float = 0.1, min_factor: float = 0.0,
                     lr_warmup_method: str = "constant", lr_warmup_decay: float = 0.01) -> float:
    """Multiplier of the base LR at optimizer step ``step`` (0-based) under the reference's schedule.

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
        if lr_warmup_method == "linear":
            return lr_warmup_decay + (1.0 - lr_warmup_decay) * step / warmup_steps
        return lr_warmup_decay
    if lr_scheduler == "cosineannealinglr":
        span = total_steps - warmup_steps
        if span <= 0:
            return 1.0
        progress = min(1.0, (step - warmup_steps) / span)
        return min_factor + (1.0 - min_factor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    epochs = step // steps_per_epoch - warmup_steps // steps_per_epoch
    if lr_scheduler == "steplr":
        return lr_gamma ** (epochs // lr_step_size)
    return lr_gamma ** epochs  # exponentiallr


def reference_scheduler(optimizer: torch.optim.Optimizer, steps_per_epoch: int, total_steps: int,
                        lr_scheduler: str = "steplr", lr_step_size: int = 30, lr_gamma: float = 0.1,
                        lr_min: float = 0.0, lr_warmup_epochs: float = 0.0, lr_warmup_method: str = "constant",
                        lr_warmup_decay: float = 0.01) -> LambdaLR:
    """The reference's ``--lr-scheduler`` (with its ``SequentialLR`` warm-up) as one LambdaLR to be stepped
    once per optimizer step (Lightning: ``interval="step"``). Defaults are the reference's.

    Epochs become optimizer steps with ``steps_per_epoch`` (``lr_warmup_epochs`` may be fractional:
    ``round(lr_warmup_epochs * steps_per_epoch)`` steps); ``total_steps`` is the whole run's (cosine decays
    over it). ``lr_min`` is an absolute LR, as the reference's ``eta_min``: each parameter group gets its own
    floor factor from its initial LR. The factors are pure functions of the step, so a resumed run continues
    exactly from the scheduler's saved step count.
    """
    check_reference_schedule(lr_scheduler, lr_step_size, lr_gamma, lr_min, lr_warmup_epochs, lr_warmup_method,
                             lr_warmup_decay)
    unknown = "but the training loader's length is unknown (an iterable dataset?)"
    if steps_per_epoch < 1 and lr_scheduler != "cosineannealinglr":
        raise ConfigError(f"{{lr_scheduler}} {lr_scheduler} counts epochs, {unknown}: use cosineannealinglr")
    if steps_per_epoch < 1 and lr_warmup_epochs > 0:
        raise ConfigError(f"{{lr_warmup_epochs}} counts epochs, {unknown}")
    if lr_scheduler == "cosineannealinglr" and total_steps < 1:
        raise ConfigError("{lr_scheduler} cosineannealinglr decays over the whole run, which has no end here: "
                          "bound it with {max_epochs} or {max_steps}")
    warmup_steps = int(round(lr_warmup_epochs * steps_per_epoch)) if lr_warmup_epochs > 0 else 0
    settings = dict(lr_scheduler=lr_scheduler, steps_per_epoch=steps_per_epoch, total_steps=total_steps,
                    warmup_steps=warmup_steps, lr_step_size=lr_step_size, lr_gamma=lr_gamma,
                    lr_warmup_method=lr_warmup_method, lr_warmup_decay=lr_warmup_decay)

    def factor_fn(base_lr: float):
        # A plain closure: LambdaLR saves no state for functions, so a resume rebuilds it from this run's LR.
        min_factor = lr_min / base_lr if base_lr > 0 else 0.0
        return lambda step: reference_factor(step, min_factor=min_factor, **settings)

    bases = [group.get("initial_lr", group["lr"]) for group in optimizer.param_groups]
    return LambdaLR(optimizer, [factor_fn(base) for base in bases])


def lightning_reference_scheduler(optimizer: torch.optim.Optimizer, trainer, lr_scheduler: str = "steplr",
                                  lr_step_size: int = 30, lr_gamma: float = 0.1, lr_min: float = 0.0,
                                  lr_warmup_epochs: float = 0.0, lr_warmup_method: str = "constant",
                                  lr_warmup_decay: float = 0.01) -> dict:
    """The ``lr_scheduler`` entry for ``configure_optimizers``: :func:`reference_scheduler` per optimizer step,
    with the epoch length and the run's length from the trainer (any world size, accumulation,
    ``--max-steps``/``--max-epochs``)."""
    estimate = trainer.estimated_stepping_batches if trainer is not None else 0
    total = int(estimate) if math.isfinite(estimate) and 0 < estimate < 2**62 else 0
    scheduler = reference_scheduler(optimizer, _steps_per_epoch(trainer), total, lr_scheduler, lr_step_size,
                                    lr_gamma, lr_min, lr_warmup_epochs, lr_warmup_method, lr_warmup_decay)
    return {"scheduler": scheduler, "interval": "step", "frequency": 1}
