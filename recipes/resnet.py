"""ResNet on CIFAR-10, an ImageFolder tree (or its converted stream) or synthetic data: ``python -m recipes.resnet``.

    python -m recipes.resnet --devices 1 --data synthetic --max-steps 20
    python -m recipes.resnet --devices 4 --data cifar10 --max-epochs 30 --lr-scaling linear --warmup-epochs 2
    python -m recipes.resnet --devices 4 --data imagefolder --data-dir /data/imagenet --arch resnet50 \\
        --image-size 224 --precision bf16-mixed --channels-last --sync-batchnorm --resume auto
    torchrun --nproc-per-node 4 -m recipes.resnet --data cifar10
    python -m recipes.resnet --devices 4 --data stream --data-dir s3://bucket/imagenet --arch resnet50 --resume auto
    python -m recipes.resnet --devices 4 --data imagefolder --data-dir /data/pets --weights IMAGENET1K_V1 \\
        --freeze-backbone --unfreeze-at-epoch 2 --backbone-lr-mult 0.1 --lr 0.01 --max-epochs 10

Checkpoints: ``<output-dir>/checkpoints/last.ckpt`` at every epoch end, every ``--checkpoint-every-n-steps``
and on SIGTERM (or SLURM's requeue signal), and ``best.ckpt`` by val_acc when there is a validation set,
saved atomically on rank 0; ``--resume auto`` continues exactly from the newest complete one.
"""

from __future__ import annotations

import functools
import sys
from typing import TYPE_CHECKING, Any

# Only the flags' modules at import: --help and a bad flag are answered before torch and Lightning load.
from ddp_recipes.config.cli import parse_config
from ddp_recipes.config.run_config import changed_fields
from ddp_recipes.errors import ConfigError, lit
from recipes.config import ResNetConfig

if TYPE_CHECKING:
    import lightning as L
    from lightning.pytorch.callbacks import Callback

    from ddp_recipes.modules.resnet import ResNetClassifier
    from ddp_recipes.optim.ema import ModelEMA
    from ddp_recipes.train.run import RunStart

PROG = "python -m recipes.resnet"
# The module's arguments the recipe always passes (besides num_classes and lr), and those it passes when set.
MODULE_ARGS = ("arch", "cifar_stem", "momentum", "nesterov", "weight_decay", "label_smoothing", "warmup_epochs",
               "cosine", "channels_last", "grad_checkpointing", "dropout")
REFERENCE_ARGS = ("optimizer", "norm_weight_decay", "bias_weight_decay", "lr_scheduler", "lr_step_size", "lr_gamma",
                  "lr_min", "lr_warmup_method", "lr_warmup_decay", "mixup_alpha", "cutmix_alpha", "weights",
                  "freeze_backbone", "backbone_lr_mult", "unfreeze_at_epoch")
def build_datamodule(cfg: ResNetConfig, cls: type[L.LightningDataModule] | None = None) -> L.LightningDataModule:
    """The recipe's data (--data), or a user's DataModule class given the values of the flags it declares."""
    from ddp_recipes.data.images import CIFAR10DataModule, ImageFolderDataModule, SyntheticImageDataModule
    from ddp_recipes.train.userclass import construct_datamodule

    batch, workers = cfg.plan.batch.per_device, cfg.plan.num_workers
    augment, crops = cfg.augment.policy(), cfg.augment.crops()
    preset = cfg.pretrained.eval_preset() if cfg.pretrained is not None else None
    weights_eval: dict = {}
    if preset is not None:
        # The transforms the weights were evaluated with are the defaults; each flag given still wins.
        weights_eval = dict(mean=preset.mean, std=preset.std)
        if not changed_fields(cfg, "interpolation"):
            weights_eval["val_interpolation"] = preset.interpolation
        if cfg.val_resize_size is None:
            crops["val_resize_size"] = preset.resize_for(cfg.val_crop_size or cfg.image_size)
    if cls is not None:
        offered = dict(data_dir=cfg.data_dir, batch_size=batch, seed=cfg.seed, num_workers=workers,
                       image_size=cfg.image_size, min_crop_scale=cfg.min_crop_scale, **augment, **crops,
                       **weights_eval)
        if cfg.num_classes is not None:
            offered["num_classes"] = cfg.num_classes
        if cfg.decode != "cpu":
            # Only a DataModule that takes decode (e.g. a subclass of ImageFolderDataModule) can decode on the
            # device; any other is refused in one line: its loaders would hand the model undecoded files.
            offered.update(decode=cfg.decode, channels_last=cfg.channels_last)
        given = changed_fields(cfg, "data_dir", "min_crop_scale", "decode", *augment, *crops)
        return construct_datamodule(cls, offered, given)
    cfg.augment.check_data(cfg.data)
    if cfg.data == "synthetic":
        return SyntheticImageDataModule(num_samples=cfg.synthetic_samples, image_size=cfg.image_size,
                                        num_classes=cfg.num_classes or 10, batch_size=batch, seed=cfg.seed,
                                        num_workers=workers, val_samples=cfg.synthetic_val_samples)
    if cfg.data == "cifar10":
        return CIFAR10DataModule(data_dir=cfg.data_dir, batch_size=batch, num_workers=workers, seed=cfg.seed, **augment)
    files = ImageFolderDataModule
    if cfg.data == "stream":  # the converter's ImageFolder in a folder or bucket: same pipelines, same order
        from ddp_recipes.data.stream import StreamImageDataModule as files
    dm = files(data_dir=cfg.data_dir, batch_size=batch, image_size=cfg.image_size, num_workers=workers,
               min_crop_scale=cfg.min_crop_scale, seed=cfg.seed, **augment, **crops, **weights_eval,
               decode=cfg.decode, channels_last=cfg.channels_last)
    dm.check_layout()  # before any process starts: a wrong --data-dir fails here, in one line
    return dm


def model_args(cfg: ResNetConfig, num_classes: int, resumed: bool = False) -> dict:
    """What the recipe passes the module (a user's subclass keeps its extra arguments' defaults); the LR is the
    plan's, scaled to the global batch. ``resumed``: no ``weights`` (the checkpoint holds the fine-tuned ones;
    the pretrained file is not needed again)."""
    args = {name: getattr(cfg, name) for name in MODULE_ARGS}
    # torchvision's training flags reach the module only when set: a subclass that takes none of them (no
    # **kwargs) works until it is given one.
    reference = {name: getattr(cfg, name) for name in changed_fields(cfg, *REFERENCE_ARGS)}
    if resumed and "weights" in reference:
        reference["weights"] = None
    return {**args, "num_classes": num_classes, "lr": cfg.plan.lr, **reference}


def build_model(cfg: ResNetConfig, num_classes: int, cls: type[ResNetClassifier] | None = None,
                resumed: bool = False) -> ResNetClassifier:
    """The module of ``cfg`` (``cls``: the recipe's or a user's subclass; None: :class:`ResNetClassifier`)."""
    from ddp_recipes.modules.resnet import ResNetClassifier
    from ddp_recipes.train.userclass import model_kwargs

    cls = cls or ResNetClassifier
    return cls(**model_kwargs(cls, model_args(cfg, num_classes, resumed)))


def ema_callback(cfg: ResNetConfig) -> ModelEMA:
    """``--model-ema``: the decay adjusted as torchvision's reference does (:func:`ema_for_run`)."""
    from ddp_recipes.optim.ema import ema_for_run

    plan = cfg.plan
    step_batch = plan.batch.per_device * plan.batch.accumulation
    return ema_for_run(cfg.ema, plan.world_size, step_batch, plan.max_epochs)


def data_classes(cfg: ResNetConfig, datamodule: L.LightningDataModule) -> int:
    """The class count: --num-classes, else the DataModule's ``num_classes``."""
    if cfg.num_classes is not None:
        return cfg.num_classes
    found = getattr(datamodule, "num_classes", None)
    if not isinstance(found, int) or found < 1:
        raise ConfigError(f"{{num_classes}} is needed: {type(datamodule).__name__} has no num_classes attribute "
                          "(set it in __init__, or pass {num_classes})")
    return found


def eval_sets(cfg: ResNetConfig, run: RunStart, datamodule: L.LightningDataModule) -> tuple[bool, bool]:
    """Whether the data has a validation set and a test set (the recipe's own data: the same one)."""
    from ddp_recipes.train.run import has_loader

    if run.classes.datamodule is None:
        has_val = cfg.data != "synthetic" or cfg.synthetic_val_samples > 0
        if cfg.data == "stream":
            has_val = datamodule.has_split("val")  # the converter writes val/ when the folder had one
        return has_val, has_val
    return has_loader(datamodule, "val"), has_loader(datamodule, "test")


def refuse_before_launch(cfg: ResNetConfig, run: RunStart, datamodule: L.LightningDataModule, num_classes: int,
                         has_test: bool) -> None:
    """Refuse, before any process starts, a run that cannot fit: the data against the ranks, the classifier and
    ``--image-size``, the network against its input, checkpoint and weights, the module's arguments, the flags a
    subclass ignores, and what ``--test-only`` needs."""
    from ddp_recipes.data.base import check_before_launch, known_train_size, pack_built
    from ddp_recipes.modules import preflight
    from ddp_recipes.optim.ema import ema_state_dict
    from ddp_recipes.train.userclass import model_kwargs

    model_class, resume, checkpoint = run.classes.model_class, run.resume, run.checkpoint
    try:  # the folders and the evaluation sets against the ranks
        check_before_launch(datamodule, cfg.plan.world_size)
    except ConfigError as err:  # the synthetic data's validation samples are --synthetic-val-samples here
        raise err.renamed(val_samples="synthetic_val_samples") from None
    preflight.check_class_count(model_class, num_classes, datamodule, cfg.num_classes is not None)
    if not cfg.test_only and pack_built(datamodule):  # any other DataModule of yours: checked in the ranks
        cfg.check_batch_fits(known_train_size(datamodule))
    data_size = getattr(datamodule, "image_size", cfg.image_size)
    if isinstance(data_size, int) and data_size != cfg.image_size:
        # The stem (--cifar-stem's default) and the input check follow --image-size: it must be the data's.
        raise ConfigError(f"{{image_size}} {cfg.image_size} but {type(datamodule).__name__}.image_size is "
                          f"{data_size}; pass {{image_size}} {data_size}")
    preflight.check_network_fits(model_class, cfg.arch, num_classes, {cfg.image_size, *cfg.eval_sizes}, cfg.cifar_stem,
                       cfg.dropout, None if resume else cfg.pretrained)
    if resume:
        preflight.check_resumed_network(checkpoint, resume, cfg.arch, num_classes, cfg.cifar_stem, cfg.dropout)
        preflight.check_resumed_state(checkpoint, resume, lambda: build_model(cfg, num_classes, model_class, True))
    model_kwargs(model_class, model_args(cfg, num_classes, bool(resume)))
    mixing = [name for name in ("mixup_alpha", "cutmix_alpha") if getattr(cfg, name) > 0]
    preflight.check_overrides(model_class, cfg.optimizer, mixing, num_classes)
    if cfg.test_only:
        if not resume:
            raise ConfigError("{test_only} needs {resume} PATH (or auto with a checkpoint in {output_dir}): the "
                              "checkpoint to evaluate")
        if not has_test:
            raise ConfigError("{test_only}: the data has no test set ({data} synthetic with "
                              "{synthetic_val_samples} 0, {data} stream converted without a val/ split, or a "
                              "DataModule without test_dataloader)")
        if cfg.model_ema and ema_state_dict(checkpoint) is None:
            raise ConfigError(f"{{model_ema}}: {{resume}} {lit(resume)} holds no EMA weights (trained without "
                              "{model_ema}); drop {model_ema} to evaluate its weights")
    elif resume:
        preflight.check_optimizer_state(checkpoint, resume, vars(cfg))


def train_and_test(cfg: ResNetConfig, run: RunStart, model: Any, datamodule: L.LightningDataModule,
                   has_val: bool, has_test: bool) -> dict:
    """Fit with the recipe's callbacks (checkpoints, ``--model-ema``, the fine-tuning record), then test."""
    from ddp_recipes.modules.pretrained import FineTuningRecord
    from ddp_recipes.train.checkpoints import checkpoint_callbacks
    from ddp_recipes.train.run import run_fit_test
    from ddp_recipes.train.summary import RankCounts
    from ddp_recipes.train.surface import without_validation

    own_data = run.classes.datamodule is None
    how = ("give it some with {synthetic_val_samples} N" if own_data
           else f"give {type(datamodule).__name__} a val_dataloader")
    trainer_kwargs = without_validation(run.user.trainer_kwargs, has_val, how)
    callbacks = checkpoint_callbacks(cfg, has_val, run.classes.model_class)
    if cfg.model_ema:
        callbacks.append(ema_callback(cfg))
    extra = {"arch": cfg.arch, "data": cfg.data if own_data else None, "resumed_from": run.resume}
    if cfg.decode == "gpu" and isinstance(getattr(datamodule, "decode_record", None), dict):
        extra["decode"] = RankCounts(datamodule.decode_record)  # filled during the run, summed over ranks
    if cfg.fine_tuning.fine_tunes:
        record = FineTuningRecord()  # fills its dict during the fit; summary.json is written after it
        callbacks.append(record)
        extra["fine_tuning"] = record.summary
    clip = dict(gradient_clip_val=cfg.clip_grad_norm, gradient_clip_algorithm="norm") if cfg.clip_grad_norm else {}
    return run_fit_test(cfg, model, datamodule, callbacks=[*callbacks, *run.user.callbacks], ckpt_path=run.resume,
                        checkpoint=run.checkpoint, test=has_test, save_final=False, classes=run.classes, extra=extra,
                        **clip, **trainer_kwargs)


def main(argv: list[str] | None = None, model_cls: type[ResNetClassifier] | None = None,
         datamodule_cls: type[L.LightningDataModule] | None = None, *, callbacks: list[Callback] | None = None,
         logger: Any = None, trainer_kwargs: dict[str, Any] | None = None) -> dict:
    """Parse flags, train (or resume), test; returns the summary written to <output-dir>/summary.json.

    ``model_cls`` and ``datamodule_cls`` are ``--model-class`` and ``--datamodule-class``; ``callbacks`` run after
    the recipe's, ``logger`` replaces the recipe's, ``trainer_kwargs`` are as ``--trainer KEY=VALUE`` (which
    overrides them). Call it under ``if __name__ == "__main__":``: with ``--devices N`` Lightning starts each rank
    by running your script again, so build the arguments in every rank.
    """
    cfg = parse_config(ResNetConfig, argv, prog=PROG, description=__doc__)
    from ddp_recipes.modules.resnet import ResNetClassifier
    from ddp_recipes.train.run import open_run, refused_in_one_line, run_test_only

    with refused_in_one_line(PROG, cfg.data_dir):
        run = open_run(cfg, ResNetClassifier, model_cls, datamodule_cls, callbacks, logger, trainer_kwargs,
                       training=not cfg.test_only)
        datamodule = build_datamodule(cfg, run.classes.datamodule)
        num_classes = data_classes(cfg, datamodule)
        has_val, has_test = eval_sets(cfg, run, datamodule)
        refuse_before_launch(cfg, run, datamodule, num_classes, has_test)
        model = functools.partial(build_model, cfg, num_classes, run.classes.model_class, bool(run.resume))
        if cfg.test_only:
            return run_test_only(cfg, model, datamodule, run.resume, run.checkpoint, classes=run.classes,
                                 user_callbacks=run.user.callbacks, **run.user.trainer_kwargs)
        return train_and_test(cfg, run, model, datamodule, has_val, has_test)


if __name__ == "__main__":
    main(sys.argv[1:])
