"""Learning-rate rules for data-parallel training: scale with the global batch, warm up, then cosine.

Going from 1 to N devices multiplies the global batch by N. The write-up's advice: scale the LR with it
(linear, Goyal et al. 2017; or sqrt, the gentler rule for adaptive optimizers) from the batch the LR was
tuned for, and warm up for a few epochs so the large early steps do not blow up training.
"""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from ddp_recipes.choices import LR_SCALING_RULES
from ddp_recipes.errors import ConfigError

SCALING_RULES = LR_SCALING_RULES  # 0.1's name


def scale_lr(base_lr: float, global_batch: int, reference_batch: int, rule: str = "none") -> float:
    """The LR for ``global_batch`` given ``base_lr`` tuned at ``reference_batch``."""
    if rule not in SCALING_RULES:
        raise ConfigError(f"{{lr_scaling}} must be one of {', '.join(SCALING_RULES)} (got {rule!r})")
    if global_batch < 1 or reference_batch < 1:
        raise ConfigError(f"batch sizes must be >= 1 (global {global_batch}, reference {reference_batch})")
    ratio = global_batch / reference_batch
    if rule == "linear":
        return base_lr * ratio
    if rule == "sqrt":
        return base_lr * math.sqrt(ratio)
    return base_lr


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
