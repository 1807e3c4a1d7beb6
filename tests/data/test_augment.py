"""Augmentation and batch mixing (the flags of torchvision's classification reference): which transforms
each option adds and where, that the defaults are the earlier pipelines, that pipelines run on PIL images
and uint8 tensors, MixUp/CutMix targets, ConfigErrors naming the flag, and the DataModules with options."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from torchvision.transforms import v2

from ddp_recipes.config.choices import AUTO_AUGMENTS, INTERPOLATIONS
from ddp_recipes.data import augment
from ddp_recipes.data.augment import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    auto_augment_policy,
    batch_mixer,
    eval_transform,
    normalize_transform,
    train_transform,
)
from ddp_recipes.data.images import (
    CIFAR10_MEAN,
    CIFAR10_STD,
    CIFAR10DataModule,
    ImageFolderDataModule,
    imagenet_train_transform,
)
from ddp_recipes.errors import ConfigError


def _steps(pipeline: v2.Compose) -> list[v2.Transform]:
    assert isinstance(pipeline, v2.Compose)
    return list(pipeline.transforms)


def _types(pipeline: v2.Compose) -> list[type]:
    return [type(t) for t in _steps(pipeline)]


def _describe(t: v2.Transform) -> tuple[type, dict[str, Any]]:
    """A transform's class and public settings (size, scale, p, mean, interpolation, ...); an interpolation as
    its enum (torchvision 0.29 keeps a default as the string, 0.26 as the enum)."""
    settings = {k: v for k, v in vars(t).items() if not k.startswith("_") and k != "training"}
    if isinstance(settings.get("interpolation"), str):
        settings["interpolation"] = v2.InterpolationMode(settings["interpolation"])
    return type(t), settings


def _same(a: v2.Compose, b: v2.Compose) -> bool:
    return [_describe(t) for t in _steps(a)] == [_describe(t) for t in _steps(b)]


def _pil(size: tuple[int, int] = (20, 16), seed: int = 0) -> Image.Image:
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (size[1], size[0], 3), dtype=torch.uint8, generator=g)
    return Image.fromarray(pixels.numpy(), "RGB")


# ---------------------------------------------------------------- defaults = the earlier pipelines


def _old_tail(mean, std) -> list[v2.Transform]:
    return [v2.ToImage(), v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean, std)]


def test_defaults_equal_the_earlier_imagenet_pipelines(tmp_path):
    # The pipelines as images.py built them before augment.py, written out.
    old_train = v2.Compose([v2.RandomResizedCrop(24, scale=(0.5, 1.0), antialias=True), v2.RandomHorizontalFlip(),
                            *_old_tail(IMAGENET_MEAN, IMAGENET_STD)])
    old_val = v2.Compose([v2.Resize(int(24 * 256 / 224), antialias=True), v2.CenterCrop(24),
                          *_old_tail(IMAGENET_MEAN, IMAGENET_STD)])
    assert _same(train_transform(24, min_crop_scale=0.5), old_train)
    assert _same(imagenet_train_transform(24, 0.5), old_train)
    assert _same(eval_transform(24), old_val)
    dm = ImageFolderDataModule(tmp_path, image_size=24, min_crop_scale=0.5)
    assert _same(dm.train_transform(), old_train) and _same(dm.val_transform(), old_val)
    assert augment.default_resize_size(224) == 256 and augment.default_resize_size(24) == 27
    assert not _same(train_transform(24), old_train)  # the comparison does see parameters


def test_defaults_equal_the_earlier_cifar_pipelines(tmp_path):
    old_train = v2.Compose([v2.RandomCrop(32, padding=4), v2.RandomHorizontalFlip(),
                            *_old_tail(CIFAR10_MEAN, CIFAR10_STD)])
    dm = CIFAR10DataModule(tmp_path)
    assert _same(dm.train_transform(), old_train)
    assert _same(train_transform(32, small_image=True, mean=CIFAR10_MEAN, std=CIFAR10_STD), old_train)
    assert _same(dm.val_transform(), v2.Compose(_old_tail(CIFAR10_MEAN, CIFAR10_STD)))
    assert _same(normalize_transform(), v2.Compose(_old_tail(IMAGENET_MEAN, IMAGENET_STD)))


# ---------------------------------------------------------------- options: which transform, where


POLICIES = {"ra": v2.RandAugment, "ta_wide": v2.TrivialAugmentWide, "augmix": v2.AugMix,
            "imagenet": v2.AutoAugment}


@pytest.mark.parametrize("small_image", [False, True])
@pytest.mark.parametrize("name", AUTO_AUGMENTS)
def test_auto_augment_sits_between_flip_and_conversion(name, small_image):
    pipeline = train_transform(16, auto_augment=name, interpolation="nearest", ra_magnitude=5,
                               augmix_severity=7, small_image=small_image)
    crop = v2.RandomCrop if small_image else v2.RandomResizedCrop
    assert _types(pipeline) == [crop, v2.RandomHorizontalFlip, POLICIES[name], v2.ToImage, v2.ToDtype,
                                v2.Normalize]
    policy = _steps(pipeline)[2]
    assert v2.InterpolationMode(policy.interpolation) == v2.InterpolationMode.NEAREST
    if name == "ra":
        assert policy.magnitude == 5
    if name == "augmix":
        assert policy.severity == 7
    if name == "imagenet":  # the ImageNet policy on small images too, as in the reference
        assert policy.policy == v2.AutoAugmentPolicy.IMAGENET


def test_random_erasing_comes_last_after_normalize():
    pipeline = train_transform(16, auto_augment="ta_wide", random_erase=0.25)
    types = _types(pipeline)
    assert types[-1] is v2.RandomErasing and types.index(v2.Normalize) == len(types) - 2
    assert _steps(pipeline)[-1].p == 0.25
    assert v2.RandomErasing not in _types(train_transform(16, random_erase=0.0))


def test_flip_probability_and_interpolation():
    assert v2.RandomHorizontalFlip not in _types(train_transform(16, hflip_prob=0.0))
    assert _steps(train_transform(16, hflip_prob=0.3))[1].p == 0.3
    for mode in INTERPOLATIONS:
        crop = _steps(train_transform(16, interpolation=mode))[0]
        resize = _steps(eval_transform(16, interpolation=mode))[0]
        # The enum, never the string: torchvision 0.26 (the lent GPU machine's) raises on "bilinear".
        assert crop.interpolation is resize.interpolation is v2.InterpolationMode(mode)
        for name in AUTO_AUGMENTS:
            if not (name == "augmix" and mode == "bicubic"):
                assert type(auto_augment_policy(name, interpolation=mode).interpolation) is v2.InterpolationMode


def test_eval_sizes():
    resize, crop, *_ = _steps(eval_transform(224, resize_size=232))
    assert (resize.size, crop.size) == ([232], (224, 224))
    resize, crop, *_ = _steps(eval_transform(224))
    assert (resize.size, crop.size) == ([256], (224, 224))  # the reference's --val-resize-size / --val-crop-size


@pytest.mark.parametrize("name", [None, *AUTO_AUGMENTS])
def test_pipelines_run_on_pil_images_and_uint8_tensors(name):
    torch.manual_seed(0)
    pipeline = train_transform(12, auto_augment=name, random_erase=1.0)
    image = _pil()
    for inpt in (image, v2.functional.pil_to_tensor(image)):
        out = pipeline(inpt)
        assert out.shape == (3, 12, 12) and out.dtype == torch.float32
        assert (out == 0).any()  # erased (p=1): the box holds 0, the mean after normalizing
    small = train_transform(16, auto_augment=name, small_image=True)(_pil((16, 16)))
    assert small.shape == (3, 16, 16) and small.dtype == torch.float32
    val = eval_transform(12, resize_size=14)
    assert torch.equal(val(image), val(image)) and val(image).shape == (3, 12, 12)


# ---------------------------------------------------------------- batch mixing


def _batch(n: int = 6, classes: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 3, 16, 16, generator=g), torch.arange(n) % classes


@pytest.mark.parametrize("kind", ["mixup", "cutmix"])
def test_mixing_gives_soft_targets_reproducibly(kind):
    mixer = batch_mixer(5, **{f"{kind}_alpha": 1.0})
    assert isinstance(mixer, v2.MixUp if kind == "mixup" else v2.CutMix)
    images, labels = _batch()
    torch.manual_seed(3)
    mixed, targets = mixer(images, labels)
    assert mixed.shape == images.shape and not torch.equal(mixed, images)
    assert targets.shape == (6, 5) and targets.dtype == torch.float32
    assert torch.allclose(targets.sum(1), torch.ones(6))
    assert not torch.equal(targets, F.one_hot(labels, 5).float())  # neighbours have other labels
    assert torch.equal(targets.argmax(1) == labels, targets.max(1).values >= 0.5)
    torch.manual_seed(3)
    again = mixer(images, labels)
    assert torch.equal(again[0], mixed) and torch.equal(again[1], targets)


def test_both_alphas_pick_one_per_batch():
    mixer = batch_mixer(5, mixup_alpha=0.2, cutmix_alpha=1.0)
    assert isinstance(mixer, v2.RandomChoice)
    assert [type(t) for t in mixer.transforms] == [v2.MixUp, v2.CutMix]
    assert (mixer.transforms[0].alpha, mixer.transforms[1].alpha) == (0.2, 1.0)
    images, labels = _batch()
    torch.manual_seed(0)
    mixed, targets = mixer(images, labels)
    assert mixed.shape == images.shape and torch.allclose(targets.sum(1), torch.ones(6))


def test_no_mixing_by_default():
    assert batch_mixer(10) is None and batch_mixer(10, 0.0, 0.0) is None


def test_cross_entropy_takes_soft_targets_with_label_smoothing():
    torch.manual_seed(0)
    logits = torch.randn(6, 5)
    _, targets = batch_mixer(5, mixup_alpha=1.0)(*_batch())
    s = 0.1
    smoothed = targets * (1 - s) + s / 5
    manual = -(smoothed * logits.log_softmax(1)).sum(1).mean()
    assert torch.allclose(F.cross_entropy(logits, targets, label_smoothing=s), manual, atol=1e-6)


# ---------------------------------------------------------------- errors name the flag


@pytest.mark.parametrize("build, param", [
    (lambda: train_transform(16, auto_augment="rand"), "auto_augment"),
    (lambda: train_transform(16, auto_augment="ra", ra_magnitude=31), "ra_magnitude"),
    (lambda: train_transform(16, ra_magnitude=2.5), "ra_magnitude"),
    (lambda: train_transform(16, augmix_severity=0), "augmix_severity"),
    (lambda: train_transform(16, random_erase=1.5), "random_erase"),
    (lambda: train_transform(0), "train_crop_size"),
    (lambda: train_transform(16, interpolation="lanczos"), "interpolation"),
    (lambda: train_transform(16, auto_augment="augmix", interpolation="bicubic"), "interpolation"),
    (lambda: train_transform(16, min_crop_scale=0.0), "min_crop_scale"),
    (lambda: eval_transform(0), "val_crop_size"),
    (lambda: eval_transform(16, resize_size=0), "val_resize_size"),
    (lambda: eval_transform(16, resize_size=12), "val_crop_size"),
    (lambda: eval_transform(16, interpolation="area"), "interpolation"),
    (lambda: batch_mixer(5, mixup_alpha=-0.1), "mixup_alpha"),
    (lambda: batch_mixer(5, cutmix_alpha=float("nan")), "cutmix_alpha"),
    (lambda: batch_mixer(1, mixup_alpha=0.2), "num_classes"),
    (lambda: CIFAR10DataModule("data", random_erase=-1.0), "random_erase"),
    (lambda: ImageFolderDataModule("data", image_size=16, val_crop_size=32, val_resize_size=24), "val_crop_size"),
])
def test_bad_values_raise_config_error_naming_the_flag(build, param):
    with pytest.raises(ConfigError) as info:
        build()
    err = info.value
    flag = "--" + param.replace("_", "-")
    assert err.param == param and err.cli().startswith(flag) and "{" not in str(err)


# ---------------------------------------------------------------- DataModules with the options


@pytest.fixture
def tiny_folder(tmp_path) -> Path:
    """2 classes x 3 images per split, 16 px (20 wide: the crops and resizes really resample)."""
    for split in ("train", "val"):
        for c in range(2):
            folder = tmp_path / split / f"c{c}"
            folder.mkdir(parents=True)
            for i in range(3):
                _pil((20, 16), seed=10 * c + i).save(folder / f"{i}.png")
    return tmp_path


@pytest.mark.parametrize("name", [None, *AUTO_AUGMENTS])
def test_imagefolder_batches_with_options(tiny_folder, name):
    dm = ImageFolderDataModule(tiny_folder, batch_size=4, image_size=16, num_workers=0, pin_memory=False,
                               auto_augment=name, random_erase=0.5, train_crop_size=12, val_resize_size=14,
                               val_crop_size=10, interpolation="nearest" if name == "augmix" else "bicubic")
    assert (dm.image_size, dm.num_classes) == (16, 2)
    dm.setup("fit")
    torch.manual_seed(0)
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (4, 3, 12, 12) and x.dtype == torch.float32 and y.shape == (4,)
    val_x, _ = next(iter(dm.val_dataloader()))
    assert val_x.shape[1:] == (3, 10, 10)
    mixed, targets = batch_mixer(dm.num_classes, mixup_alpha=0.2, cutmix_alpha=1.0)(x, y)
    assert mixed.shape == x.shape and targets.shape == (4, 2)


def test_cifar10_options_reach_the_pipeline(tmp_path):
    dm = CIFAR10DataModule(tmp_path, auto_augment="augmix", augmix_severity=5, random_erase=0.1)
    steps = _steps(dm.train_transform())
    assert [type(t) for t in steps] == [v2.RandomCrop, v2.RandomHorizontalFlip, v2.AugMix, v2.ToImage,
                                        v2.ToDtype, v2.Normalize, v2.RandomErasing]
    assert steps[2].severity == 5 and steps[-1].p == 0.1
    out = dm.train_transform()(_pil((32, 32)))
    assert out.shape == (3, 32, 32) and out.dtype == torch.float32


def test_augment_args_refuse_what_the_policy_or_the_data_does_not_read():
    from ddp_recipes.config.augment import AugmentArgs

    AugmentArgs(auto_augment="ra", ra_magnitude=5).check_data("imagefolder")
    for kwargs, message in [(dict(augmix_severity=5), "augmix_severity has no effect without auto_augment augmix"),
                            (dict(cutmix_alpha=math.inf), r"cutmix_alpha must be >= 0 \(got inf\)"),
                            (dict(random_erase=1.5), r"random_erase must be in \[0, 1\] \(got 1.5\)"),
                            (dict(val_crop_size=0), r"val_crop_size must be >= 1 \(got 0\)")]:
        with pytest.raises(ConfigError, match=message):
            AugmentArgs(**kwargs)
    with pytest.raises(ConfigError, match="interpolation has no effect without auto_augment on CIFAR-10"):
        AugmentArgs(interpolation="bicubic").check_data("cifar10")
    with pytest.raises(ConfigError, match="decode has no effect without data imagefolder"):
        AugmentArgs(decode="gpu").check_data("synthetic")
    assert set(AugmentArgs().policy()) == {"auto_augment", "ra_magnitude", "augmix_severity", "random_erase",
                                           "interpolation"}
