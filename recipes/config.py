"""The recipes' configs: every flag of ``python -m recipes.mnist`` and ``python -m recipes.resnet``, its default
and its check, as one dataclass per recipe on top of :class:`~ddp_recipes.config.run_config.RunConfig`. Torch-free
at import: ``--help`` and every flag error answer before torch loads (``--arch`` and ``--weights`` import it last).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ddp_recipes.config.augment import AugmentArgs
from ddp_recipes.config.choices import (
    AutoAugment,
    Decode,
    Interpolation,
    LRScheduler,
    MNISTArch,
    Optimizer,
    ResNetData,
    WarmupMethod,
)
from ddp_recipes.config.cli import opt
from ddp_recipes.config.ema import EMAArgs
from ddp_recipes.config.finetune import FineTuning
from ddp_recipes.config.hparams import check_training_hparams
from ddp_recipes.config.optim import OptimizerArgs
from ddp_recipes.config.run_config import RunConfig, build_from
from ddp_recipes.config.schedule import ReferenceSchedule, ScheduleArgs
from ddp_recipes.errors import ConfigError

if TYPE_CHECKING:
    from ddp_recipes.modules.pretrained import PretrainedWeights


@dataclass
class MNISTConfig(RunConfig):
    """Run config plus the MNIST recipe's own flags."""

    arch: MNISTArch = opt("mlp", "network: mlp (the write-up's 784-128-10) or cnn")
    data_dir: str = opt("data", "folder holding MNIST/raw/ (downloaded there on rank 0 when missing and online)")
    download: bool = opt(True, "download MNIST into --data-dir when it is missing")
    val_size: int = opt(0, "images held out of the train split for validation (fixed seed)")
    momentum: float = opt(0.9, "SGD momentum")
    weight_decay: float = opt(0.0, "SGD weight decay")
    cosine: bool = opt(False, "cosine LR decay over the run after the warm-up")
    output_dir: str | None = opt(None, "where logs, checkpoints and summary.json go (a folder, or s3://bucket/prefix), "
                                       "owned by one run (default: runs/mnist/version_N, a new N for each run)")

    DEFAULT_BATCH_SIZE = 64
    DEFAULT_LR = 0.01
    DEFAULT_REFERENCE_BATCH = 64
    DEFAULT_MAX_EPOCHS = 5
    DEFAULT_EXPERIMENT = "mnist"
    DEFAULT_OUTPUT_ROOT = "runs/mnist"

    def check_values(self) -> None:
        if self.val_size < 0:
            raise ConfigError(f"{{val_size}} must be >= 0 (got {self.val_size})")
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"{{momentum}} must be in [0, 1) (got {self.momentum})")


# The EMA's settings under the recipe's flag names.
EMA_FLAGS = {"enabled": "model_ema", "decay": "model_ema_decay", "update_every": "model_ema_steps"}


@dataclass
class ResNetConfig(RunConfig):
    """Run config plus the ResNet recipe's own flags."""

    arch: str = opt("resnet18", "any torchvision classification model: the ResNet family (resnet18..resnet152, "
                                "resnext*, wide_resnet*) with every feature; others (efficientnet_b0, vit_b_16, ...) "
                                "without --cifar-stem and --grad-checkpointing")
    data: ResNetData = opt("synthetic", "synthetic (offline, fixed seed), cifar10, imagefolder "
                                        "(--data-dir/{train,val}) or stream (a folder or bucket URL written by "
                                        "python -m ddp_recipes.data.convert)")
    data_dir: str = opt("data", "dataset folder (cifar10 downloads there on rank 0; imagefolder reads it) or, with "
                                "--data stream, the converted dataset's folder or URL (s3://bucket/prefix)")
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
    decode: Decode = opt("cpu", "where --data imagefolder's (and stream's) images are decoded and augmented: cpu "
                                "(PIL in the loader workers) or gpu (workers read the bytes and draw the crops; "
                                "decode_jpeg (TorchCodec's, else torchvision's) decodes on the training device, "
                                "nvJPEG on CUDA, and the crops, flips and "
                                "policy are applied there)")
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
        for settings, renames in ((ScheduleArgs, None), (EMAArgs, EMA_FLAGS), (OptimizerArgs, None),
                                  (AugmentArgs, None)):
            build_from(settings, self, renames)  # checks its values, and refuses a flag it would not read
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
        from ddp_recipes.modules.architectures import RESNET_FAMILY, arch_features

        self._resolve_weights()
        if self.cifar_stem is None:
            # Pretrained weights come with the stem they were trained with.
            self.cifar_stem = self.image_size < 64 and self.arch in RESNET_FAMILY and not self.weights
        arch_features(self.arch, self.cifar_stem, self.dropout, self.grad_checkpointing)

    def _resolve_weights(self) -> None:
        """Resolve ``--weights`` (no file read); on an image folder the weights' crop is the default image size."""
        self.__dict__["_pretrained"] = None
        if self.weights:
            from ddp_recipes.modules.architectures import arch_features
            from ddp_recipes.modules.pretrained import resolve_weights

            arch_features(self.arch, False, 0.0, False)  # a known --arch before its weights are looked up
            self.__dict__["_pretrained"] = resolve_weights(self.arch, self.weights)
            preset = self.pretrained.eval_preset()
            if self.image_size is None:
                files = self.data in ("imagefolder", "stream")
                self.image_size = preset.crop_size if preset and files else 32

    @property
    def ema(self) -> EMAArgs:
        """The EMA's settings under the recipe's flag names (``--model-ema``, ``--model-ema-decay``, ...)."""
        return build_from(EMAArgs, self, EMA_FLAGS)

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
