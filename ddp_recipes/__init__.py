"""ddp-recipes: a PyTorch Lightning DDP strategy and recipe pack.

Components only; the runnable recipes live in the top-level ``recipes`` package. Exports resolve lazily,
so ``python -m ddp_recipes.doctor`` and the benchmark's worker processes do not pay for importing
Lightning unless they use it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:  # what an editor or type checker follows; at run time each name resolves lazily (below)
    from ddp_recipes.checkpointing.exact_continuation import ResumeState
    from ddp_recipes.checkpointing.last import LastCheckpoint
    from ddp_recipes.config.cli import parse_config
    from ddp_recipes.config.plan import DDPOptions, RunPlan, scale_lr
    from ddp_recipes.config.run_config import RunConfig
    from ddp_recipes.data.mnist import MNISTDataModule
    from ddp_recipes.ddp.strategy import TunedDDPStrategy
    from ddp_recipes.ddp.syncbn import (
        CPUSyncBatchNorm,
        SyncBatchNormPlugin,
        convert_sync_batchnorm,
        revert_sync_batchnorm,
    )
    from ddp_recipes.errors import CheckpointError, ConfigError, DataError
    from ddp_recipes.modules.classifier import ImageClassifier
    from ddp_recipes.modules.mnist import MNISTClassifier
    from ddp_recipes.modules.resnet import ResNetClassifier
    from ddp_recipes.optim.schedules import warmup_cosine
    from ddp_recipes.train.trainer import build_trainer

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

__all__ = [  # the names above; tests/cross_cutting/test_layering.py checks the three lists agree
    "CPUSyncBatchNorm", "CheckpointError", "ConfigError", "DDPOptions", "DataError", "ImageClassifier",
    "LastCheckpoint", "MNISTClassifier", "MNISTDataModule", "ResNetClassifier", "ResumeState", "RunConfig",
    "RunPlan", "SyncBatchNormPlugin", "TunedDDPStrategy", "build_trainer", "convert_sync_batchnorm", "parse_config",
    "revert_sync_batchnorm", "scale_lr", "warmup_cosine",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'ddp_recipes' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
