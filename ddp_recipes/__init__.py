"""ddp-recipes: a PyTorch Lightning DDP strategy and recipe pack.

Components only; the runnable recipes live in the top-level ``recipes`` package.
"""

from ddp_recipes.config import ConfigError, RunConfig, parse_config
from ddp_recipes.schedules import scale_lr, warmup_cosine
from ddp_recipes.strategy import TunedDDPStrategy
from ddp_recipes.syncbn import CPUSyncBatchNorm, SyncBatchNormPlugin, convert_sync_batchnorm, revert_sync_batchnorm
from ddp_recipes.trainer import build_trainer

__version__ = "0.1.0"

__all__ = [
    "CPUSyncBatchNorm",
    "ConfigError",
    "RunConfig",
    "SyncBatchNormPlugin",
    "TunedDDPStrategy",
    "build_trainer",
    "convert_sync_batchnorm",
    "parse_config",
    "revert_sync_batchnorm",
    "scale_lr",
    "warmup_cosine",
]
