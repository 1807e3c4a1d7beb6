"""The augmentation a recipe's flags ask of its image data (:class:`AugmentArgs`), torch-free: a recipe checks
its flags with it before torch loads. The transforms themselves are :mod:`ddp_recipes.data.augment`'s."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ddp_recipes.config.run_config import refuse_unused
from ddp_recipes.errors import ConfigError


@dataclass(frozen=True)
class AugmentArgs:
    """The augmentation a recipe's flags ask of its image data (torchvision's reference names and defaults).
    ``__post_init__`` checks the values and refuses a setting the chosen policy does not read;
    :meth:`check_data` refuses those the pack's own data would not read."""

    auto_augment: str | None = None
    """Training policy: ra, ta_wide, augmix or imagenet (None: none)."""
    ra_magnitude: int = 9
    """RandAugment's magnitude."""
    augmix_severity: int = 3
    """AugMix's severity."""
    random_erase: float = 0.0
    """RandomErasing's probability, in [0, 1]."""
    interpolation: str = "bilinear"
    """Resize interpolation of crops, resizes and the policy."""
    train_crop_size: int | None = None
    """Training RandomResizedCrop size (None: the image size)."""
    val_resize_size: int | None = None
    """Evaluation resize (None: from the crop)."""
    val_crop_size: int | None = None
    """Evaluation center crop (None: the image size)."""
    mixup_alpha: float = 0.0
    """MixUp's Beta(alpha, alpha) (0: off)."""
    cutmix_alpha: float = 0.0
    """CutMix's Beta(alpha, alpha) (0: off)."""
    min_crop_scale: float = 0.08
    """Smallest RandomResizedCrop area."""
    decode: str = "cpu"
    """Where image files are decoded and augmented: cpu or gpu."""

    def __post_init__(self) -> None:
        refuse_unused(self, [(self.auto_augment != "ra", ("ra_magnitude",), "{auto_augment} ra"),
                             (self.auto_augment != "augmix", ("augmix_severity",), "{auto_augment} augmix")])
        for name, high in (("mixup_alpha", math.inf), ("cutmix_alpha", math.inf), ("random_erase", 1)):
            value = getattr(self, name)
            if not (0 <= value <= high and math.isfinite(value)):
                bound = ">= 0" if high == math.inf else f"in [0, {high}]"
                raise ConfigError(f"{{{name}}} must be {bound} (got {value})", name)
        for name in ("train_crop_size", "val_resize_size", "val_crop_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{{{name}}} must be >= 1 (got {value})", name)

    def check_data(self, data: str) -> None:
        """Refuse what the pack's own ``data`` (synthetic, cifar10, imagefolder or stream) would not read."""
        files = data in ("imagefolder", "stream")  # image files: a converted stream holds the folder's files
        refuse_unused(self, [(data == "synthetic", ("auto_augment", "random_erase", "interpolation"),
                              "image data ({data} cifar10 or imagefolder, or {datamodule_class})"),
                             (data == "cifar10" and self.auto_augment is None, ("interpolation",),
                              "{auto_augment} on CIFAR-10 (its crops do not resample)"),
                             (data == "cifar10", ("train_crop_size", "val_resize_size", "val_crop_size"),
                              "{data} imagefolder (CIFAR-10 is 32 px)"),
                             (not files, ("min_crop_scale",),
                              "{data} imagefolder (the other data take no RandomResizedCrop)"),
                             (not files, ("decode",),
                              "{data} imagefolder (CIFAR-10 and synthetic data are in memory, not image files)")])

    def policy(self) -> dict:
        """The per-image settings every image DataModule of the pack takes."""
        return dict(auto_augment=self.auto_augment, ra_magnitude=self.ra_magnitude,
                    augmix_severity=self.augmix_severity, random_erase=self.random_erase,
                    interpolation=self.interpolation)

    def crops(self) -> dict:
        """The crop and resize sizes an image folder takes."""
        return dict(train_crop_size=self.train_crop_size, val_resize_size=self.val_resize_size,
                    val_crop_size=self.val_crop_size)
