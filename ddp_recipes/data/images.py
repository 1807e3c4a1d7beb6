"""Image DataModules for the ResNet recipes: synthetic tensors, CIFAR-10, and an ImageNet-style folder.

All three share :class:`~ddp_recipes.data.base.SplitDataModule` (resumable training loader, exact unpadded
evaluation loaders) and expose ``num_classes`` and ``image_size``, so a recipe sizes the model and checks the stem
before training. Pipelines come from :mod:`ddp_recipes.data.augment`.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from pathlib import Path

import torch
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import Dataset
from torchvision import datasets
from torchvision.transforms import v2
from typing_extensions import override

from ddp_recipes.config.choices import DECODES, AutoAugment, Decode, Interpolation, check_choice
from ddp_recipes.config.world import default_num_workers
from ddp_recipes.data import augment
from ddp_recipes.data.base import SplitDataModule
from ddp_recipes.data.device_decode import DeviceDecoder
from ddp_recipes.data.encoded import EncodedBatch, EncodedImageFolder, EvalPipeline, TrainPipeline
from ddp_recipes.data.pixels import named_loader
from ddp_recipes.data.samplers import TensorBatchDataset
from ddp_recipes.errors import ConfigError, DataError, MissingDataError, lit

# Per-channel statistics of the 50k CIFAR-10 training images (std over pixels, not the often-copied
# 0.2023/0.1994/0.2010, which are a std of per-image means).
CIFAR10_MEAN, CIFAR10_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


class _ImageDataModule(SplitDataModule):
    """Batch, worker and pinning defaults shared by the image DataModules; subclasses fill the splits."""

    def __init__(self, batch_size: int, num_workers: int | None, pin_memory: bool | None, seed: int = 0) -> None:
        super().__init__()
        self.seed = seed  # of the training order: same seed and epoch, same order, resumed or not
        if batch_size < 1:
            raise ConfigError(f"{{batch_size}} must be >= 1 (got {batch_size})")
        if num_workers is not None and num_workers < 0:
            raise ConfigError(f"{{num_workers}} must be >= 0 (got {num_workers})")
        self.batch_size = batch_size
        self._num_workers = num_workers
        self._pin_memory = pin_memory
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None
        self.test_set: Dataset | None = None

    @property
    def num_classes(self) -> int:
        raise NotImplementedError

    @property
    def image_size(self) -> int:
        """The side of the square images the model sees: the subclass's ``_image_size``."""
        return self._image_size

    @property
    def num_workers(self) -> int:
        """The given ``num_workers``, or :func:`default_num_workers` for the trainer's devices per node."""
        if self._num_workers is not None:
            return self._num_workers
        devices = getattr(self.trainer, "num_devices", 1) if self.trainer is not None else 1
        return default_num_workers(devices)


class SyntheticImageDataModule(_ImageDataModule):
    """Random ``[3, H, W]`` float images with random labels: no I/O, no decode, for throughput runs.

    Built in ``setup`` from ``seed`` with a private generator, so every rank holds the identical dataset
    whatever the global RNG state. ``val_samples=0`` disables validation (and test)."""

    def __init__(self, num_samples: int = 512, image_size: int = 32, num_classes: int = 10,
                 batch_size: int = 32, seed: int = 0, num_workers: int = 0, val_samples: int = 0) -> None:
        super().__init__(batch_size, num_workers, pin_memory=None)
        if num_samples < 1:
            raise ConfigError(f"{{num_samples}} must be >= 1 (got {num_samples})")
        if val_samples < 0:
            raise ConfigError(f"{{val_samples}} must be >= 0 (got {val_samples})")
        if image_size < 1:
            raise ConfigError(f"{{image_size}} must be >= 1 (got {image_size})")
        if num_classes < 1:
            raise ConfigError(f"{{num_classes}} must be >= 1 (got {num_classes})")
        self.num_samples, self.val_samples, self.seed = num_samples, val_samples, seed
        self._image_size, self._num_classes = image_size, num_classes

    @property
    @override
    def num_classes(self) -> int:
        return self._num_classes

    @property
    def train_size(self) -> int:
        """Training samples (known before ``setup``: the recipe checks the batch against them)."""
        return self.num_samples

    def describe(self) -> str:
        """The run's ``data`` line: what a user must know before reading its loss and accuracy."""
        chance = 100 / self._num_classes
        return (f"synthetic: {self.num_samples} random-noise images with random labels ({self._num_classes} classes): "
                f"nothing to learn, so validation and test accuracy stay near chance ({chance:.3g}%) and the "
                f"training loss falls only as the network memorises them; it measures speed, not learning")

    @override
    def eval_sizes(self) -> dict[str, int]:
        return {"validation": self.val_samples, "test": self.val_samples}

    @override
    def more_eval_samples(self, what: str, need: int) -> str:
        return f"pass {{val_samples}} {need} or more"

    @override
    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        generator = torch.Generator().manual_seed(self.seed)
        sets = []
        for n in (self.num_samples, self.val_samples):  # train first: val_samples leaves train unchanged
            images = torch.randn(n, 3, self._image_size, self._image_size, generator=generator)
            labels = torch.randint(0, self._num_classes, (n,), generator=generator)
            sets.append(TensorBatchDataset(images, labels))
        self.train_set, self.val_set = sets
        self.test_set = self.val_set


class CIFAR10DataModule(_ImageDataModule):
    """CIFAR-10 through torchvision: pad-4 random crop + flip for training; validation is the test split,
    uncropped. The augmentation options are :func:`ddp_recipes.data.augment.train_transform`'s."""

    def __init__(self, data_dir: str | Path = "data", batch_size: int = 128, num_workers: int | None = None,
                 pin_memory: bool | None = None, seed: int = 0, *, auto_augment: AutoAugment | None = None,
                 ra_magnitude: int = 9, augmix_severity: int = 3, random_erase: float = 0.0,
                 interpolation: Interpolation = "bilinear") -> None:
        super().__init__(batch_size, num_workers, pin_memory, seed)
        self.data_dir = Path(data_dir)
        self.auto_augment, self.ra_magnitude = auto_augment, ra_magnitude
        self.augmix_severity, self.random_erase = augmix_severity, random_erase
        self.interpolation = interpolation
        self.train_transform()  # a bad option fails here, once, not in setup on every rank

    @property
    @override
    def num_classes(self) -> int:
        return 10

    @property
    @override
    def image_size(self) -> int:
        return 32

    def _not_found(self, reason: str) -> FileNotFoundError:
        return MissingDataError(
            f"CIFAR-10 not found under {self.data_dir / datasets.CIFAR10.base_folder} ({lit(reason)}): pass "
            "{data_dir} pointing at a folder holding cifar-10-batches-py, or run once with internet", "data_dir")

    @override
    def prepare_data(self) -> None:
        """Download on local rank 0 (torchvision skips it when the files are present and verified)."""
        try:
            for train in (True, False):
                datasets.CIFAR10(os.fspath(self.data_dir), train=train, download=True)
        except (OSError, RuntimeError) as e:  # URLError is an OSError; torchvision raises RuntimeError too
            raise self._not_found(f"download failed with {type(e).__name__}; offline?") from None

    def train_transform(self) -> v2.Transform:
        return augment.train_transform(
            32, small_image=True, auto_augment=self.auto_augment, ra_magnitude=self.ra_magnitude,
            augmix_severity=self.augmix_severity, random_erase=self.random_erase,
            interpolation=self.interpolation, mean=CIFAR10_MEAN, std=CIFAR10_STD)

    def val_transform(self) -> v2.Transform:
        return augment.normalize_transform(CIFAR10_MEAN, CIFAR10_STD)

    @override
    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        try:  # other nodes never ran prepare_data: fail here with the same message
            self.train_set = datasets.CIFAR10(os.fspath(self.data_dir), train=True, download=False,
                                              transform=self.train_transform())
            self.val_set = datasets.CIFAR10(os.fspath(self.data_dir), train=False, download=False,
                                            transform=self.val_transform())
        except RuntimeError:  # torchvision: "Dataset not found or corrupted"
            raise self._not_found("missing or corrupt") from None
        self.test_set = self.val_set


class ImageFolderDataModule(_ImageDataModule):
    """An ImageNet-style tree ``<data_dir>/{train,val}/<class>/<image>``, decoded by PIL each epoch.

    Training: RandomResizedCrop + flip; validation (and test): resize and center-crop, the standard ImageNet
    evaluation; ``val`` must hold the same class folders as ``train``. ``min_crop_scale``: 0.08 is the ImageNet
    default; small images and short runs train better with a milder one (an 8% crop of a 32 px digit is a stroke
    fragment). The crop and resize sizes are the reference's; ``image_size`` stays the size the model's stem is
    checked against.

    ``decode="gpu"``: the loader workers read each file's bytes and draw its augmentation only
    (:mod:`ddp_recipes.data.encoded`); :meth:`on_after_batch_transfer` decodes the batch on the training device
    with the same draws (:mod:`ddp_recipes.data.device_decode`).
    """

    def __init__(self, data_dir: str | Path, batch_size: int = 64, image_size: int = 224,
                 num_workers: int | None = None, pin_memory: bool | None = None,
                 min_crop_scale: float = 0.08, seed: int = 0, *, auto_augment: AutoAugment | None = None,
                 ra_magnitude: int = 9, augmix_severity: int = 3, random_erase: float = 0.0,
                 train_crop_size: int | None = None, val_resize_size: int | None = None,
                 val_crop_size: int | None = None, interpolation: Interpolation = "bilinear",
                 mean: Sequence[float] = augment.IMAGENET_MEAN, std: Sequence[float] = augment.IMAGENET_STD,
                 val_interpolation: Interpolation | None = None, decode: Decode = "cpu",
                 channels_last: bool = False) -> None:
        super().__init__(batch_size, num_workers, pin_memory, seed)
        check_choice("decode", decode, DECODES)
        self.decode = decode
        self.decoder = DeviceDecoder(channels_last=channels_last)  # used with decode "gpu" only
        self.mean, self.std = tuple(mean), tuple(std)
        self.val_interpolation = interpolation if val_interpolation is None else val_interpolation
        if image_size < 1:
            raise ConfigError(f"{{image_size}} must be >= 1 (got {image_size})")
        if not 0 < min_crop_scale <= 1:
            raise ConfigError(f"{{min_crop_scale}} must be in (0, 1] (got {min_crop_scale})")
        self.data_dir = Path(data_dir)
        self._image_size = image_size
        self.min_crop_scale = min_crop_scale
        self.auto_augment, self.ra_magnitude = auto_augment, ra_magnitude
        self.augmix_severity, self.random_erase = augmix_severity, random_erase
        self.interpolation = interpolation
        self.train_crop_size = image_size if train_crop_size is None else train_crop_size
        self.val_crop_size = image_size if val_crop_size is None else val_crop_size
        self.val_resize_size = val_resize_size
        self._classes: list[str] | None = None
        self._counts: dict[str, dict[str, int]] = {}  # image files per class folder, per split (listed once)
        self._record: dict = {"device": None, "images": 0, "cpu_fallbacks": 0} if decode == "gpu" else {}
        self.train_transform()  # a bad option fails here, once, not in setup on every rank
        self.val_transform()
        if decode == "gpu":
            self.train_pipeline().check_device()

    @property
    @override
    def num_classes(self) -> int:
        """Class folders under ``train/`` (lists the directory on first use, never in ``__init__``)."""
        return len(self._train_classes())

    @property
    def train_size(self) -> int:
        """Image files under ``train/``, known before ``setup``: the recipe checks the batch against it."""
        if self.train_set is not None:
            return len(self.train_set)
        return sum(self._image_counts("train").values())

    @property
    def class_names(self) -> list[str]:
        """The class folders under ``train/``, in label order."""
        return list(self._train_classes())

    def _image_counts(self, split: str) -> dict[str, int]:
        """Image files per class folder of ``split``, counted as ImageFolder lists them; listed once."""
        if split not in self._counts:
            classes = self._train_classes() if split == "train" else self._split_classes(split)
            counts = {}
            for name in classes:
                found = 0
                for _, _, files in os.walk(self.data_dir / split / name, followlinks=True):
                    found += sum(datasets.folder.has_file_allowed_extension(f, datasets.folder.IMG_EXTENSIONS)
                                 for f in files)
                counts[name] = found
            self._counts[split] = counts
        return self._counts[split]

    def check_files(self) -> None:
        """The folders against what a run needs, before any rank starts (and in ``setup`` when a listing fails):
        ``train/`` and ``val/`` with the same class folders and an image in each (ImageFolder's extensions)."""
        self.check_layout()
        self._check_val_classes()
        for split in ("train", "val"):
            empty = [name for name, found in self._image_counts(split).items() if found == 0]
            if empty:
                more = f" (and {len(empty) - 1} more)" if len(empty) > 1 else ""
                raise DataError(f"{{data_dir}} {lit(self.data_dir)}: the class folder {split}/{lit(empty[0])}{more} "
                                "holds no image file (" + ", ".join(datasets.folder.IMG_EXTENSIONS) + "); add "
                                "images to it, or remove that class from train/ and val/", "data_dir")

    @override
    def eval_sizes(self) -> dict[str, int]:
        val = sum(self._image_counts("val").values())
        return {"validation": val, "test": val}

    @override
    def more_eval_samples(self, what: str, need: int) -> str:
        return f"put at least {need} images in {lit(self.data_dir / 'val')} (it serves validation and test)"

    def _train_classes(self) -> list[str]:
        if self._classes is None:
            self.check_layout()
            self._classes = self._split_classes("train")
        return self._classes

    def check_layout(self) -> None:
        """A one-line ``FileNotFoundError`` naming the flags unless ``train/`` and ``val/`` both exist."""
        have = [split for split in ("train", "val") if (self.data_dir / split).is_dir()]
        if len(have) == 2:
            return
        if not self.data_dir.is_dir():
            state = "neither (it is not a directory)"
        else:
            state = f"only {have[0]}/" if have else "neither"
        raise MissingDataError(f"{{data}} imagefolder needs <dir>/train and <dir>/val class subfolders; "
                               f"{{data_dir}} {lit(self.data_dir)} has {state}", "data_dir")

    def _split_classes(self, split: str) -> list[str]:
        try:
            found, _ = datasets.folder.find_classes(os.fspath(self.data_dir / split))
        except FileNotFoundError as err:  # torchvision: the split holds no class folder
            raise MissingDataError(f"{{data_dir}} {lit(self.data_dir)}: {lit(err)}", "data_dir") from None
        return found

    def _check_val_classes(self) -> None:
        train = self._train_classes()
        val = self._split_classes("val")
        if val != train:
            # ImageFolder numbers classes by sorted folder name per split: any difference mislabels val.
            missing, extra = sorted(set(train) - set(val)), sorted(set(val) - set(train))
            raise DataError(f"{{data_dir}} {lit(self.data_dir)}: val/ class folders differ from train/ "
                             f"(missing in val: {missing[:5]}, extra in val: {extra[:5]})")

    def train_pipeline(self) -> TrainPipeline:
        """The training augmentation's settings: the CPU pipeline is its ``build()``, the device one applies it."""
        return TrainPipeline(self.train_crop_size, min_crop_scale=self.min_crop_scale,
                             interpolation=self.interpolation, auto_augment=self.auto_augment,
                             ra_magnitude=self.ra_magnitude, augmix_severity=self.augmix_severity,
                             random_erase=self.random_erase, mean=self.mean, std=self.std)

    def eval_pipeline(self) -> EvalPipeline:
        return EvalPipeline(self.val_crop_size, resize_size=self.val_resize_size,
                            interpolation=self.val_interpolation, mean=self.mean, std=self.std)

    def train_transform(self) -> v2.Transform:
        return self.train_pipeline().build()

    def val_transform(self) -> v2.Transform:
        return self.eval_pipeline().build()

    @property
    def decode_record(self) -> dict:
        """With decode "gpu": this process's decoded images and CPU fallbacks (it fills during the run)."""
        return self._record

    @override
    def on_after_batch_transfer(self, batch, dataloader_idx: int):
        """Decode an :class:`EncodedBatch` on its device into ``(images, labels)``; then the model's own
        ``on_after_batch_transfer``, if it has one (Lightning calls only the DataModule's when both do)."""
        if isinstance(batch, EncodedBatch):
            self._record.update(device=str(batch.device))
            batch = self.decoder(batch)
            self._record.update(self.decoder.record())
        module = self.trainer.lightning_module if self.trainer is not None else None
        if module is not None and is_overridden("on_after_batch_transfer", module):
            batch = module.on_after_batch_transfer(batch, dataloader_idx)
        return batch

    @override
    def prepare_data(self) -> None:
        self.check_layout()  # fail before any rank starts decoding

    @override
    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        self.check_layout()
        self._check_val_classes()
        gpu = self.decode == "gpu"
        try:
            # With decode "gpu" the folders only list the files: the encoded datasets read them.
            loader = functools.partial(named_loader, root=os.fspath(self.data_dir))  # a bad file is named
            train = datasets.ImageFolder(os.fspath(self.data_dir / "train"), loader=loader,
                                         transform=None if gpu else self.train_transform())
            val = datasets.ImageFolder(os.fspath(self.data_dir / "val"), loader=loader,
                                       transform=None if gpu else self.val_transform())
        except FileNotFoundError as err:  # torchvision: a class folder without a single image file
            self.check_files()  # names the folder and the fix
            raise MissingDataError(f"{{data_dir}} {lit(self.data_dir)}: {lit(err)}", "data_dir") from None
        if gpu:
            train = EncodedImageFolder(train.samples, self.train_pipeline(), root=self.data_dir)
            val = EncodedImageFolder(val.samples, self.eval_pipeline(), root=self.data_dir)
            warn_not_jpeg(train, val, self.data_dir)
        self.train_set, self.val_set = train, val
        self.test_set = self.val_set


def warn_not_jpeg(train: EncodedImageFolder, val: EncodedImageFolder, where: object) -> None:
    """``--decode gpu``: say before training how many files nvJPEG will hand back to the CPU."""
    others = train.not_jpeg() + val.not_jpeg()
    if others:
        rank_zero_warn(f"decode gpu: {others} of {len(train) + len(val)} files under {where} are not named "
                       ".jpg/.jpeg; nvJPEG decodes JPEG only, so each of them is decoded on the CPU in the training "
                       "process (counted in summary.json's decode.cpu_fallbacks)")


def imagenet_train_transform(image_size: int, min_crop_scale: float = 0.08) -> v2.Transform:
    """RandomResizedCrop + flip + float + ImageNet normalisation, for PIL images and uint8 tensors alike."""
    return augment.train_transform(image_size, min_crop_scale=min_crop_scale)
