"""ddp-recipes: a PyTorch Lightning DDP strategy and recipe pack.

Components only; the runnable recipes live in the top-level ``recipes`` package. Exports resolve lazily,
so ``python -m ddp_recipes.doctor`` and the benchmark's worker processes do not pay for importing
Lightning unless they use it.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "ConfigError": "ddp_recipes.errors",
    "DataError": "ddp_recipes.errors",
    "CheckpointError": "ddp_recipes.errors",
    "RunPlan": "ddp_recipes.config.plan",
    "DDPOptions": "ddp_recipes.config.plan",
    "RunConfig": "ddp_recipes.config.run_config",
    "parse_config": "ddp_recipes.config.cli",
    "scale_lr": "ddp_recipes.config.plan",
    "warmup_cosine": "ddp_recipes.optim.schedules",
    "TunedDDPStrategy": "ddp_recipes.ddp.strategy",
    "CPUSyncBatchNorm": "ddp_recipes.ddp.syncbn",
    "SyncBatchNormPlugin": "ddp_recipes.ddp.syncbn",
    "convert_sync_batchnorm": "ddp_recipes.ddp.syncbn",
    "revert_sync_batchnorm": "ddp_recipes.ddp.syncbn",
    "build_trainer": "ddp_recipes.train.trainer",
    # The two callbacks a plain L.Trainer (or LightningCLI) adds for last.ckpt and an exact resume: named from
    # the package, so a user's import does not follow the folders they live in.
    "LastCheckpoint": "ddp_recipes.checkpointing.last",
    "ResumeState": "ddp_recipes.checkpointing.exact_continuation",
    "ImageClassifier": "ddp_recipes.modules.classifier",
    "MNISTClassifier": "ddp_recipes.modules.mnist",
    "MNISTDataModule": "ddp_recipes.data.mnist",
    "ResNetClassifier": "ddp_recipes.modules.resnet",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'ddp_recipes' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
