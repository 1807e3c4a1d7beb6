"""ResNet on CIFAR-10, an ImageFolder tree or synthetic data: ``python -m recipes.resnet``.

    python -m recipes.resnet --devices 1 --data synthetic --max-steps 20
    python -m recipes.resnet --devices 4 --data cifar10 --max-epochs 30 --lr-scaling linear --warmup-epochs 2
    python -m recipes.resnet --devices 4 --data imagefolder --data-dir /data/imagenet --arch resnet50 \\
        --image-size 224 --precision bf16-mixed --channels-last --sync-batchnorm --resume auto
    torchrun --nproc-per-node 4 -m recipes.resnet --data cifar10
    python -m recipes.resnet --devices 4 --data imagefolder --data-dir /data/pets --weights IMAGENET1K_V1 \
        --freeze-backbone --unfreeze-at-epoch 2 --backbone-lr-mult 0.1 --lr 0.01 --max-epochs 10

Checkpoints: ``<output-dir>/checkpoints/last.ckpt`` at every epoch end, every ``--checkpoint-every-n-steps``
and on SIGTERM (or SLURM's requeue signal), and ``best.ckpt`` by val_acc when there is a validation set,
saved atomically on rank 0; ``--resume auto`` continues exactly from the newest complete one.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

# Only the flags' modules at import: --help and a bad flag are answered before torch, torchvision and Lightning
# load (seconds); the rest is imported where it is used, after the flags are read.
from ddp_recipes.config.augment import AugmentArgs
from ddp_recipes.config.choices import (
    AutoAugment,
    Decode,
    Interpolation,
    LRScheduler,
    Optimizer,
    ResNetData,
    WarmupMethod,
)
from ddp_recipes.config.cli import fail, opt, parse_config
from ddp_recipes.config.ema import EMAArgs
from ddp_recipes.config.finetune import FineTuning
from ddp_recipes.config.hparams import check_training_hparams
from ddp_recipes.config.optim import OptimizerArgs
from ddp_recipes.config.run_config import RunConfig, build_from, changed_fields
from ddp_recipes.config.schedule import ReferenceSchedule, ScheduleArgs
from ddp_recipes.errors import ConfigError, lit

if TYPE_CHECKING:
    import lightning as L
    from lightning.pytorch.callbacks import Callback

    from ddp_recipes.modules.pretrained import PretrainedWeights
    from ddp_recipes.modules.resnet import ResNetClassifier
    from ddp_recipes.optim.ema import ModelEMA
    from ddp_recipes.train.start import RunStart

PROG = "python -m recipes.resnet"
# The module's arguments the recipe always passes (besides num_classes and lr), and those it passes when set.
MODULE_ARGS = ("arch", "cifar_stem", "momentum", "nesterov", "weight_decay", "label_smoothing", "warmup_epochs",
               "cosine", "channels_last", "grad_checkpointing", "dropout")
REFERENCE_ARGS = ("optimizer", "norm_weight_decay", "bias_weight_decay", "lr_scheduler", "lr_step_size", "lr_gamma",
                  "lr_min", "lr_warmup_method", "lr_warmup_decay", "mixup_alpha", "cutmix_alpha", "weights",
                  "freeze_backbone", "backbone_lr_mult", "unfreeze_at_epoch")
# The EMA's settings under the recipe's flag names.
EMA_FLAGS = {"enabled": "model_ema", "decay": "model_ema_decay", "update_every": "model_ema_steps"}


@dataclass
class ResNetConfig(RunConfig):
    """Run config plus the ResNet recipe's own flags."""

    arch: str = opt("resnet18", "any torchvision classification model: the ResNet family (resnet18..resnet152, "
                                "resnext*, wide_resnet*) with every feature; others (efficientnet_b0, vit_b_16, ...) "
                                "without --cifar-stem and --grad-checkpointing")
    data: ResNetData = opt("synthetic", "synthetic (offline, fixed seed), cifar10 or imagefolder "
                                        "(--data-dir/{train,val})")
    data_dir: str = opt("data", "dataset folder (cifar10 downloads there on rank 0; imagefolder reads it)")
    image_size: int | None = opt(None, "input side in pixels (default: 32, or with --weights and --data imagefolder "
                                       "the weights' crop, e.g. 224; cifar10 is always 32)")
    num_classes: int | None = opt(None, "classes (default: from the data; 10 for cifar10 and synthetic)")
    cifar_stem: bool | None = opt(None, "3x3 stem without max-pool for small images (default: on below 64 px for "
                                        "the ResNet family)")
    synthetic_samples: int = opt(1024, "training images of --data synthetic")
    synthetic_val_samples: int = opt(256, "validation images of --data synthetic (0: no validation)")
    momentum: float = opt(0.9, "SGD momentum")
    nesterov: bool = opt(False, "Nesterov momentum")
    weight_decay: float = opt(5e-4, "weight decay (never on BatchNorm parameters and biases)")
    label_smoothing: float = opt(0.0, "label smoothing of the cross-entropy")
    dropout: float = opt(0.0, "dropout before the classifier (0: none; other than ResNets: the model's own dropout "
                              "option, e.g. EfficientNet's head or ViT's blocks; 0 keeps torchvision's default)")
    cosine: bool | None = opt(None, "cosine LR decay to 0 over the run after a linear warm-up from 0 (default: on "
                                    "unless --lr-scheduler is given)")
    channels_last: bool = opt(False, "NHWC memory format (faster convolutions under AMP on tensor cores)")
    grad_checkpointing: bool = opt(False, "recompute the residual stages in backward: less memory, more compute")
    min_crop_scale: float = opt(0.08, "smallest RandomResizedCrop area of --data imagefolder")
    decode: Decode = opt("cpu", "where --data imagefolder's images are decoded and augmented: cpu (PIL in the loader "
                                "workers) or gpu (workers read the bytes and draw the crops; decode_jpeg decodes on "
                                "the training device, nvJPEG on CUDA, and the crops, flips and policy are applied "
                                "there)")
    output_dir: str | None = opt(None, "where logs, checkpoints and summary.json go (a folder, or s3://bucket/prefix), "
                                       "owned by one run (default: runs/resnet/version_N, a new N for each run)")
    # torchvision's classification reference (references/classification/train.py), same flag names.
    auto_augment: AutoAugment | None = opt(None, "training augmentation policy: ra (RandAugment), ta_wide "
                                                 "(TrivialAugmentWide), augmix or imagenet (AutoAugment)")
    ra_magnitude: int = opt(9, "RandAugment magnitude (--auto-augment ra)")
    augmix_severity: int = opt(3, "AugMix severity (--auto-augment augmix)")
    random_erase: float = opt(0.0, "RandomErasing probability on training images (after normalization)")
    train_crop_size: int | None = opt(None, "training RandomResizedCrop size of --data imagefolder (default: "
                                            "--image-size)")
    val_resize_size: int | None = opt(None, "evaluation resize of --data imagefolder (default: val crop x 256/224)")
    val_crop_size: int | None = opt(None, "evaluation center crop of --data imagefolder (default: --image-size)")
    interpolation: Interpolation = opt("bilinear", "resize interpolation of crops, resizes and the policy")
    mixup_alpha: float = opt(0.0, "MixUp's Beta(alpha, alpha) for training batches (0: off)")
    cutmix_alpha: float = opt(0.0, "CutMix's Beta(alpha, alpha) for training batches (0: off; with MixUp: one of "
                                   "the two per batch)")
    model_ema: bool = opt(False, "keep an exponential moving average of the weights; evaluated as val_acc_ema / "
                                 "test_acc_ema and saved in checkpoints")
    model_ema_steps: int = opt(EMAArgs.update_every, "optimizer steps between EMA updates")
    model_ema_decay: float = opt(EMAArgs.decay, "EMA decay per update, adjusted for world size x batch x "
                                                "--model-ema-steps over --max-epochs as torchvision's reference does "
                                                "(unadjusted when only --max-steps is given)")
    clip_grad_norm: float | None = opt(None, "clip the global gradient norm to this (after the all-reduce)")
    optimizer: Optimizer = opt("sgd", "sgd, sgd_nesterov, adamw or rmsprop (torchvision's "
                                      "settings)", aliases=("--opt",))
    norm_weight_decay: float = opt(0.0, "weight decay of normalization layers (torchvision's default: --weight-decay)")
    bias_weight_decay: float = opt(0.0, "weight decay of biases (torchvision's default: --weight-decay)")
    lr_scheduler: LRScheduler | None = opt(None, "torchvision's schedule after the warm-up: cosineannealinglr, steplr "
                                                 "or exponentiallr (default: --cosine)")
    lr_step_size: int = opt(ReferenceSchedule.lr_step_size, "epochs between --lr-scheduler steplr decays")
    lr_gamma: float = opt(ReferenceSchedule.lr_gamma, "decay factor of steplr (per step) and exponentiallr (per epoch)")
    lr_min: float = opt(ReferenceSchedule.lr_min, "cosineannealinglr's final LR")
    lr_warmup_method: WarmupMethod = opt(ReferenceSchedule.lr_warmup_method, "--lr-scheduler warm-up: linear (from "
                                                                             "--lr-warmup-decay x lr) or constant "
                                                                             "(--lr-warmup-decay x lr)")
    lr_warmup_decay: float = opt(ReferenceSchedule.lr_warmup_decay, "--lr-scheduler warm-up's starting factor")
    test_only: bool = opt(False, "evaluate the --resume checkpoint (and its EMA weights) on the test set; no training")
    # Fine-tuning (torchvision's --weights; the freezing and layer-wise LR of timm and Lightning's finetuning).
    weights: str | None = opt(None, "start from pretrained weights: a torchvision weights name of --arch "
                                    "(IMAGENET1K_V2, ResNet50_Weights.IMAGENET1K_V2, DEFAULT; from torch's hub cache, "
                                    "downloaded once per node) or a local state-dict file; their eval transforms "
                                    "become --data imagefolder's defaults")
    freeze_backbone: bool = opt(False, "train only the classifier (the model's last layer): the backbone keeps its "
                                       "weights and its BatchNorm statistics")
    backbone_lr_mult: float = opt(1.0, "the backbone's LR as a multiple of the classifier's (discriminative "
                                       "fine-tuning, e.g. 0.1)")
    unfreeze_at_epoch: int | None = opt(None, "with --freeze-backbone: train the backbone too from this epoch on "
                                              "(0-based; the two-phase schedule)")

    DEFAULT_BATCH_SIZE = 128
    DEFAULT_LR = 0.1
    DEFAULT_REFERENCE_BATCH = 256
    DEFAULT_MAX_EPOCHS = 30
    DEFAULT_EXPERIMENT = "resnet"
    DEFAULT_OUTPUT_ROOT = "runs/resnet"
    DEFAULT_NUM_WORKERS = None  # fitted to the cores per rank (decoding and augmentation)
    TRAINER_OWNED = {**RunConfig.TRAINER_OWNED, "gradient_clip_val": "{clip_grad_norm}",
                     "gradient_clip_algorithm": "{clip_grad_norm} (the global norm)"}

    def default_num_workers(self, devices_per_node: int) -> int:
        # Synthetic data are in-memory tensors: no decode to overlap, so no workers unless asked.
        return 0 if self.data == "synthetic" else super().default_num_workers(devices_per_node)

    def check_values(self) -> None:
        # Each component's settings check themselves (values, and flags that would have no effect), as does the
        # module's own check of its training values; none of them needs torch.
        build_from(ScheduleArgs, self)
        build_from(EMAArgs, self, EMA_FLAGS)
        build_from(OptimizerArgs, self)
        build_from(AugmentArgs, self)
        check_training_hparams(vars(self))
        if self.num_classes is not None and self.num_classes < 1:
            raise ConfigError(f"{{num_classes}} must be >= 1 (got {self.num_classes})")
        if self.synthetic_samples < 1 or self.synthetic_val_samples < 0:
            raise ConfigError("{synthetic_samples} must be >= 1 and {synthetic_val_samples} >= 0")
        if self.clip_grad_norm is not None and not self.clip_grad_norm > 0:
            raise ConfigError(f"{{clip_grad_norm}} must be > 0 (got {self.clip_grad_norm})")

    def __post_init__(self) -> None:
        super().__post_init__()  # the shared flags, this recipe's (check_values), then the plan
        if self.data == "cifar10" or (self.image_size is None and not self.weights):
            self.image_size = 32
        self.cosine = build_from(ScheduleArgs, self).decays_cosine
        build_from(FineTuning, self, max_epochs=self.plan.max_epochs)  # checked against the plan's epochs
        # Last what needs torchvision (seconds to import): the architectures and the weights.
        from ddp_recipes.modules.resnet import RESNET_FAMILY, arch_features

        self._resolve_weights()
        if self.cifar_stem is None:
            # Pretrained weights come with the stem they were trained with.
            self.cifar_stem = self.image_size < 64 and self.arch in RESNET_FAMILY and not self.weights
        arch_features(self.arch, self.cifar_stem, self.dropout, self.grad_checkpointing)

    def _resolve_weights(self) -> None:
        """Resolve ``--weights`` (no file read); on an image folder the weights' crop is the default image size."""
        self.__dict__["_pretrained"] = None
        if self.weights:
            from ddp_recipes.modules.pretrained import resolve_weights
            from ddp_recipes.modules.resnet import arch_features

            arch_features(self.arch, False, 0.0, False)  # a known --arch before its weights are looked up
            self.__dict__["_pretrained"] = resolve_weights(self.arch, self.weights)
            preset = self.pretrained.eval_preset()
            if self.image_size is None:
                self.image_size = preset.crop_size if preset and self.data == "imagefolder" else 32

    @property
    def augment(self) -> AugmentArgs:
        """The augmentation the flags ask of the data."""
        return build_from(AugmentArgs, self)

    @property
    def fine_tuning(self) -> FineTuning:
        """How the run fine-tunes (``--weights``, ``--freeze-backbone``, ...), checked against the run around it."""
        return build_from(FineTuning, self, max_epochs=self.plan.max_epochs)

    @property
    def pretrained(self) -> PretrainedWeights | None:
        """``--weights`` resolved when the config was made (None without it)."""
        return self.__dict__.get("_pretrained")

    @property
    def eval_sizes(self) -> set[int]:
        """The input sides the model meets: training and evaluation crops."""
        if self.data == "cifar10":
            return {32}
        return {self.train_crop_size or self.image_size, self.val_crop_size or self.image_size}


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
    dm = ImageFolderDataModule(data_dir=cfg.data_dir, batch_size=batch, image_size=cfg.image_size,
                               num_workers=workers, min_crop_scale=cfg.min_crop_scale, seed=cfg.seed, **augment,
                               **crops, **weights_eval, decode=cfg.decode, channels_last=cfg.channels_last)
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
    return ema_for_run(build_from(EMAArgs, cfg, EMA_FLAGS), plan.world_size, step_batch, plan.max_epochs)


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
        return has_val, has_val
    return has_loader(datamodule, "val"), has_loader(datamodule, "test")


def refuse_before_launch(cfg: ResNetConfig, run: RunStart, datamodule: L.LightningDataModule, num_classes: int,
                         has_test: bool) -> None:
    """Refuse, before any process starts, a run that cannot fit: the data's image size against
    ``--image-size``, the input the architecture takes, the checkpoint's network and optimizer state against
    this run's, a weights file against the network, the module's arguments, the flags a subclass ignores, and
    what ``--test-only`` needs."""
    from ddp_recipes.data.base import known_train_size
    from ddp_recipes.modules import preflight
    from ddp_recipes.optim.ema import ema_state_dict
    from ddp_recipes.train.userclass import model_kwargs

    model_class, resume, checkpoint = run.classes.model_class, run.resume, run.checkpoint
    if not cfg.test_only and run.classes.datamodule is None:  # a DataModule of yours: checked in the ranks
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
    model_kwargs(model_class, model_args(cfg, num_classes, bool(resume)))
    mixing = [name for name in ("mixup_alpha", "cutmix_alpha") if getattr(cfg, name) > 0]
    preflight.check_overrides(model_class, cfg.optimizer, mixing, num_classes)
    if cfg.test_only:
        if not resume:
            raise ConfigError("{test_only} needs {resume} PATH (or auto with a checkpoint in {output_dir}): the "
                              "checkpoint to evaluate")
        if not has_test:
            raise ConfigError("{test_only}: the data has no test set ({data} synthetic with "
                              "{synthetic_val_samples} 0, or a DataModule without test_dataloader)")
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

    ``model_cls``: your subclass of :class:`ResNetClassifier` (as ``--model-class``); ``datamodule_cls``: your
    LightningDataModule (as ``--datamodule-class``; replaces ``--data``). Call it from your script's
    ``if __name__ == "__main__":`` block with ``sys.argv[1:]``: with ``--devices N`` Lightning starts each
    rank by running your script again.
    ``callbacks`` run after the recipe's (and ``--callbacks``'); ``logger`` (a Lightning logger, a list, or
    False) replaces the recipe's; ``trainer_kwargs`` are ``lightning.Trainer`` settings the recipe does not own,
    as ``--trainer KEY=VALUE`` (which overrides them). Build them in every rank: this runs in each.
    """
    cfg = parse_config(ResNetConfig, argv, prog=PROG, description=__doc__)
    from ddp_recipes.data.unreadable import describe as describe_unreadable
    from ddp_recipes.modules.resnet import ResNetClassifier
    from ddp_recipes.train.checkpoints import discard_unused_output_dirs
    from ddp_recipes.train.run import run_test_only
    from ddp_recipes.train.start import open_run

    try:
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
    except ConfigError as err:  # bad input, with the parameter it is about; anything else is a bug
        discard_unused_output_dirs()  # nothing written: not even the empty version_N of a default output dir
        fail(err, PROG)
    except OSError as err:
        name = describe_unreadable(err)  # "train/c1/x.jpg (why)", from any decoder, in a worker or not
        if name is None:
            raise
        fail(f"--data-dir {cfg.data_dir} holds an image that cannot be decoded: {name}; remove or replace it", PROG)


if __name__ == "__main__":
    main(sys.argv[1:])
