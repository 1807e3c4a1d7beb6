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
from typing import TYPE_CHECKING, Any

# Only the flags' modules at import: --help and a bad flag are answered before torch and Lightning load.
from ddp_recipes.config.cli import parse_config
from ddp_recipes.config.run_config import changed_fields
from recipes.config import MNISTConfig

if TYPE_CHECKING:
    import lightning as L
    from lightning.pytorch.callbacks import Callback

    from ddp_recipes.modules.mnist import MNISTClassifier

PROG = "python -m recipes.mnist"


def build_datamodule(cfg: MNISTConfig, cls: type[L.LightningDataModule] | None = None) -> L.LightningDataModule:
    """The recipe's MNIST, or a user's DataModule class given the values of the flags it declares."""
    from ddp_recipes.data.mnist import MNISTDataModule
    from ddp_recipes.train.userclass import construct_datamodule

    offered = dict(data_dir=cfg.data_dir, batch_size=cfg.plan.batch.per_device, val_size=cfg.val_size,
                   seed=cfg.seed, num_workers=cfg.plan.num_workers, download=cfg.download)
    if cls is None:
        return MNISTDataModule(**offered)
    return construct_datamodule(cls, offered, changed_fields(cfg, "data_dir", "val_size", "download"))


def model_args(cfg: MNISTConfig) -> dict:
    """What the recipe passes the module (a user's subclass keeps its extra arguments' defaults); the LR is
    the plan's, scaled to the global batch."""
    return dict(arch=cfg.arch, lr=cfg.plan.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay,
                warmup_epochs=cfg.warmup_epochs, cosine=cfg.cosine)


def build_model(cfg: MNISTConfig, cls: type[MNISTClassifier] | None = None) -> MNISTClassifier:
    """The module of ``cfg`` (``cls``: the recipe's or a user's subclass)."""
    from ddp_recipes.modules.mnist import MNISTClassifier
    from ddp_recipes.train.userclass import model_kwargs

    cls = cls or MNISTClassifier
    return cls(**model_kwargs(cls, model_args(cfg)))


def main(argv: list[str] | None = None, model_cls: type[MNISTClassifier] | None = None,
         datamodule_cls: type[L.LightningDataModule] | None = None, *, callbacks: list[Callback] | None = None,
         logger: Any = None, trainer_kwargs: dict[str, Any] | None = None) -> dict:
    """Parse flags, train, test; returns the summary (also written to <output-dir>/summary.json). The arguments
    are as :func:`recipes.resnet.main`'s."""
    cfg = parse_config(MNISTConfig, argv, prog=PROG, description=__doc__)
    from ddp_recipes.checkpointing.checkpoint import check_compatible
    from ddp_recipes.checkpointing.state_match import check_state_fits, meta_module
    from ddp_recipes.data.base import check_before_launch, known_train_size, pack_built
    from ddp_recipes.modules.mnist import ARCHS, MNISTClassifier
    from ddp_recipes.train.checkpoints import checkpoint_callbacks
    from ddp_recipes.train.run import has_loader, open_run, refused_in_one_line, run_fit_test
    from ddp_recipes.train.surface import without_validation
    from ddp_recipes.train.userclass import model_kwargs

    with refused_in_one_line(PROG, cfg.data_dir):
        run = open_run(cfg, MNISTClassifier, model_cls, datamodule_cls, callbacks, logger, trainer_kwargs)
        classes = run.classes
        if run.resume:
            check_compatible(run.checkpoint, run.resume, {"arch": cfg.arch}, accepted={"arch": ARCHS})
            module = meta_module(lambda: build_model(cfg, classes.model_class))
            if module is not None:  # names and shapes, before any process starts
                check_state_fits(run.checkpoint, run.resume, module, MNISTClassifier, "{arch}")
        model_kwargs(classes.model_class, model_args(cfg))  # before any process starts: one line if not
        datamodule = build_datamodule(cfg, classes.datamodule)
        own_data = classes.datamodule is None
        if own_data:  # before any process starts (downloading first when the files are missing)
            datamodule.check_split(cfg.plan.world_size)
        check_before_launch(datamodule, cfg.plan.world_size)  # the evaluation sets against the ranks
        if pack_built(datamodule):  # any other DataModule of yours is checked in the ranks
            cfg.check_batch_fits(known_train_size(datamodule))
        has_val = cfg.val_size > 0 if own_data else has_loader(datamodule, "val")
        how = "hold some out with {val_size} N" if own_data else f"give {type(datamodule).__name__} a val_dataloader"
        trainer_kwargs = without_validation(run.user.trainer_kwargs, has_val, how)
        return run_fit_test(cfg, lambda: build_model(cfg, classes.model_class), datamodule,
                            callbacks=[*checkpoint_callbacks(cfg, has_val, classes.model_class), *run.user.callbacks],
                            ckpt_path=run.resume, checkpoint=run.checkpoint,
                            test=own_data or has_loader(datamodule, "test"), classes=classes,
                            extra={"arch": cfg.arch, "resumed_from": run.resume}, **trainer_kwargs)


if __name__ == "__main__":
    main(sys.argv[1:])
