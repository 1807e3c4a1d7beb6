"""MNIST, the write-up's example done right: ``python -m recipes.mnist``.

    python -m recipes.mnist --devices 1                        # one process
    python -m recipes.mnist --devices 2 --accelerator cpu      # Lightning launches 2 gloo processes
    torchrun --nproc-per-node 2 -m recipes.mnist               # torchrun launches them
    python -m recipes.mnist --devices 4 --lr-scaling linear --warmup-epochs 1

Defaults are the write-up's: MLP 784-128-10, SGD lr 0.01 momentum 0.9, per-device batch 64, 5 epochs.
``<output-dir>/checkpoints/last.ckpt`` is saved at every epoch end (and on SIGTERM); ``--resume auto``
continues from the newest checkpoint exactly.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from ddp_recipes.config import ConfigError, RunConfig, fail, opt, parse_config
from ddp_recipes.data.mnist import MNISTDataModule
from ddp_recipes.modules.mnist import ARCHS, MNISTClassifier
from ddp_recipes.runner import checkpoint_callbacks, resume_checkpoint, run_fit_test, scaled_lr

PROG = "python -m recipes.mnist"


@dataclass
class MNISTConfig(RunConfig):
    """Run config plus the MNIST recipe's own flags."""

    arch: str = opt("mlp", "network: mlp (the write-up's 784-128-10) or cnn", choices=ARCHS)
    data_dir: str = opt("data", "folder holding MNIST/raw/ (downloaded there on rank 0 when missing and online)")
    download: bool = opt(True, "download MNIST into --data-dir when it is missing")
    val_size: int = opt(0, "images held out of the train split for validation (fixed seed)")
    momentum: float = opt(0.9, "SGD momentum")
    weight_decay: float = opt(0.0, "SGD weight decay")
    cosine: bool = opt(False, "cosine LR decay over the run after the warm-up")
    output_dir: str = opt("runs/mnist", "where logs and summary.json go")

    DEFAULT_BATCH_SIZE = 64
    DEFAULT_LR = 0.01
    DEFAULT_REFERENCE_BATCH = 64
    DEFAULT_MAX_EPOCHS = 5

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.arch not in ARCHS:
            raise ConfigError(f"--arch must be one of {', '.join(ARCHS)} (got {self.arch!r})")
        if self.val_size < 0:
            raise ConfigError(f"--val-size must be >= 0 (got {self.val_size})")
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"--momentum must be in [0, 1) (got {self.momentum})")


def build_datamodule(cfg: MNISTConfig) -> MNISTDataModule:
    return MNISTDataModule(data_dir=cfg.data_dir, batch_size=cfg.per_device_batch_size, val_size=cfg.val_size,
                           seed=cfg.seed, num_workers=cfg.num_workers or 0, download=cfg.download)


def build_model(cfg: MNISTConfig, lr: float) -> MNISTClassifier:
    return MNISTClassifier(arch=cfg.arch, lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay,
                           warmup_epochs=cfg.warmup_epochs, cosine=cfg.cosine)


def main(argv: list[str] | None = None) -> dict:
    """Parse flags, train, test; returns the summary (also written to <output-dir>/summary.json)."""
    cfg = parse_config(MNISTConfig, argv, prog=PROG, description=__doc__)
    try:
        lr = scaled_lr(cfg)
        resume = resume_checkpoint(cfg, {"arch": cfg.arch}, accepted={"arch": ARCHS})
        return run_fit_test(cfg, lambda: build_model(cfg, lr), build_datamodule(cfg), lr,
                            callbacks=checkpoint_callbacks(cfg, has_val=cfg.val_size > 0), ckpt_path=resume,
                            extra={"arch": cfg.arch, "resumed_from": resume})
    except (FileNotFoundError, ValueError) as err:  # ConfigError is a ValueError
        if not isinstance(err, FileNotFoundError) and "--" not in str(err):
            raise  # a ValueError that names no flag is a bug, not bad input: keep its traceback
        fail(str(err).splitlines()[0], PROG)


if __name__ == "__main__":
    main(sys.argv[1:])
