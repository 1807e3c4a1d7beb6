"""Training and evaluation transforms, and batch mixing, for the image recipes.

The options are those of torchvision's classification reference (``references/classification/train.py``), so a
recipe known from there repeats here flag for flag. Per-image transforms run in loader workers and draw from torch's
global RNG, which the resumable sampler seeds per sample; batch mixing runs in the training process.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torchvision.transforms import v2

from ddp_recipes.config.augment import AugmentArgs as AugmentArgs  # torch-free there: checked before torch loads
from ddp_recipes.config.choices import AUTO_AUGMENTS, INTERPOLATIONS, AutoAugment, Interpolation, check_choice
from ddp_recipes.errors import ConfigError

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
# The standard ImageNet evaluation resizes to 256 and center-crops 224; other crop sizes keep the ratio.
EVAL_RESIZE_RATIO = 256 / 224
# RandAugment's 31 magnitude bins are indexed 0..30; AugMix's severity is 1..10 (torchvision's bounds,
# checked here so that the message names the parameter instead of failing inside a loader worker).
RA_MAX_MAGNITUDE = 30
AUGMIX_MAX_SEVERITY = 10
# The CIFAR random crop: pad 4 px on each side, crop back to the original size (He et al. 2016).
SMALL_IMAGE_PADDING = 4

Mixer = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def _check_int(param: str, value: object, low: int, high: int | None = None) -> None:
    bounds = f"in [{low}, {high}]" if high is not None else f">= {low}"
    out_of_range = not isinstance(value, int) or value < low or (high is not None and value > high)
    if isinstance(value, bool) or out_of_range:
        raise ConfigError(f"{{{param}}} must be an integer {bounds} (got {value!r})", param)


def _check_probability(param: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ConfigError(f"{{{param}}} must be in [0, 1] (got {value})", param)


def _check_alpha(param: str, value: float) -> None:
    if not value >= 0.0:  # also rejects NaN
        raise ConfigError(f"{{{param}}} must be >= 0 (0 disables it; got {value})", param)


def _interpolation_mode(interpolation: str) -> v2.InterpolationMode:
    """The checked ``interpolation`` as torchvision's enum: every transform gets the enum, never the string
    (torchvision 0.26 raises ``ValueError`` on ``"bilinear"``; later versions accept both)."""
    check_choice("interpolation", interpolation, INTERPOLATIONS)
    return v2.InterpolationMode(interpolation)


def auto_augment_policy(name: AutoAugment, *, interpolation: Interpolation = "bilinear",
                        ra_magnitude: int = 9, augmix_severity: int = 3) -> v2.Transform:
    """The automatic augmentation ``name`` (one of :data:`~ddp_recipes.config.choices.AUTO_AUGMENTS`).

    ``imagenet`` is AutoAugment's ImageNet policy whatever the images, as in the reference. torchvision
    resamples *tensors* with ``nearest`` or ``bilinear`` only and raises on ``bicubic`` when such an operation
    is drawn, mid-epoch in a loader worker; AugMix turns every image into a tensor, so ``augmix`` with
    ``bicubic`` is refused here.
    """
    check_choice("auto_augment", name, AUTO_AUGMENTS)
    mode = _interpolation_mode(interpolation)
    _check_int("ra_magnitude", ra_magnitude, 0, RA_MAX_MAGNITUDE)
    _check_int("augmix_severity", augmix_severity, 1, AUGMIX_MAX_SEVERITY)
    if name == "augmix" and interpolation == "bicubic":
        raise ConfigError("{interpolation} bicubic does not work with {auto_augment} augmix (it resamples "
                          "tensors, which take nearest or bilinear only); pick bilinear")
    if name == "ra":
        return v2.RandAugment(interpolation=mode, magnitude=ra_magnitude)
    if name == "ta_wide":
        return v2.TrivialAugmentWide(interpolation=mode)
    if name == "augmix":
        return v2.AugMix(interpolation=mode, severity=augmix_severity)
    return v2.AutoAugment(v2.AutoAugmentPolicy.IMAGENET, interpolation=mode)


def normalize_transform(mean: Sequence[float] = IMAGENET_MEAN,
                        std: Sequence[float] = IMAGENET_STD) -> v2.Compose:
    """PIL image or uint8 tensor -> float32 image in [0, 1] -> normalized per channel. On its own, the CIFAR
    evaluation pipeline (its images are used at their size, uncropped)."""
    return v2.Compose(_to_normalized(mean, std))


def _to_normalized(mean: Sequence[float], std: Sequence[float]) -> list[v2.Transform]:
    return [v2.ToImage(), v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean, std)]


def train_transform(crop_size: int, *, interpolation: Interpolation = "bilinear", hflip_prob: float = 0.5,
                    auto_augment: AutoAugment | None = None, ra_magnitude: int = 9, augmix_severity: int = 3,
                    random_erase: float = 0.0, min_crop_scale: float = 0.08,
                    mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD,
                    small_image: bool = False) -> v2.Compose:
    """The training pipeline: crop, flip, optional auto-augmentation, float + normalize, optional erasing.

    ``small_image`` is the CIFAR style: a pad-4 ``RandomCrop``, which keeps the small object in view. The
    auto-augmentation runs before conversion (its operations expect 0..255 pixels); random erasing runs after
    normalizing, as in the reference, so erased pixels are the dataset mean, not black.
    """
    _check_int("train_crop_size", crop_size, 1)
    mode = _interpolation_mode(interpolation)
    _check_probability("hflip_prob", hflip_prob)
    _check_probability("random_erase", random_erase)
    if not 0 < min_crop_scale <= 1:
        raise ConfigError(f"{{min_crop_scale}} must be in (0, 1] (got {min_crop_scale})")
    policy = None
    if auto_augment is not None:
        policy = auto_augment_policy(auto_augment, interpolation=interpolation, ra_magnitude=ra_magnitude,
                                     augmix_severity=augmix_severity)
    else:  # checked even when unused: a bad value is a typo whichever policy runs
        _check_int("ra_magnitude", ra_magnitude, 0, RA_MAX_MAGNITUDE)
        _check_int("augmix_severity", augmix_severity, 1, AUGMIX_MAX_SEVERITY)

    if small_image:
        steps: list[v2.Transform] = [v2.RandomCrop(crop_size, padding=SMALL_IMAGE_PADDING)]
    else:
        steps = [v2.RandomResizedCrop(crop_size, scale=(min_crop_scale, 1.0), interpolation=mode,
                                      antialias=True)]
    if hflip_prob > 0:
        steps.append(v2.RandomHorizontalFlip(hflip_prob))
    if policy is not None:
        steps.append(policy)
    steps += _to_normalized(mean, std)
    if random_erase > 0:
        steps.append(v2.RandomErasing(p=random_erase))
    return v2.Compose(steps)


def default_resize_size(crop_size: int) -> int:
    """The evaluation resize for a crop: 256 for 224 (the reference's defaults), same ratio otherwise."""
    return int(crop_size * EVAL_RESIZE_RATIO)


def eval_transform(crop_size: int, *, resize_size: int | None = None,
                   interpolation: Interpolation = "bilinear",
                   mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD) -> v2.Compose:
    """The evaluation pipeline: resize the short side to ``resize_size``, center-crop ``crop_size``, float +
    normalize. A crop larger than the resize is refused: it would pad black borders training never saw."""
    _check_int("val_crop_size", crop_size, 1)
    resize = default_resize_size(crop_size) if resize_size is None else resize_size
    _check_int("val_resize_size", resize, 1)
    if crop_size > resize:
        raise ConfigError(f"{{val_crop_size}} {crop_size} must be <= {{val_resize_size}} {resize}")
    mode = _interpolation_mode(interpolation)
    return v2.Compose([v2.Resize(resize, interpolation=mode, antialias=True), v2.CenterCrop(crop_size),
                       *_to_normalized(mean, std)])


def batch_mixer(num_classes: int, mixup_alpha: float = 0.0, cutmix_alpha: float = 0.0) -> Mixer | None:
    """MixUp and/or CutMix on a whole batch: ``images, targets = mixer(images, labels)``; None when both
    alphas are 0. With both > 0, each batch gets one of the two at random, as in the reference.

    Each image is mixed with its neighbour, so the batch must be shuffled and ``images`` float. Apply it in the
    training step, on each rank's own batch: the draws come from torch's global CPU RNG, which the pack seeds with
    ``seed + rank`` (and checkpoints), so ranks mix differently and reproducibly. ``F.cross_entropy`` takes the
    soft ``targets`` as they are, label smoothing included.
    """
    _check_alpha("mixup_alpha", mixup_alpha)
    _check_alpha("cutmix_alpha", cutmix_alpha)
    if not (isinstance(num_classes, int) and num_classes >= 2):
        raise ConfigError(f"{{num_classes}} must be >= 2 to mix labels (got {num_classes!r})", "num_classes")
    mixers: list[v2.Transform] = []
    if mixup_alpha > 0:
        mixers.append(v2.MixUp(alpha=mixup_alpha, num_classes=num_classes))
    if cutmix_alpha > 0:
        mixers.append(v2.CutMix(alpha=cutmix_alpha, num_classes=num_classes))
    if not mixers:
        return None
    return mixers[0] if len(mixers) == 1 else v2.RandomChoice(mixers)
