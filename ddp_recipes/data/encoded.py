"""``--decode gpu``'s loader side: batches of encoded image bytes with each sample's drawn augmentation.

The loader workers read a file's bytes, its size from the header (no pixels), and draw the sample's augmentation
with the very transforms the CPU pipeline runs, in the same order, from the same per-sample seeded stream: a
sample gets the same crop in both modes, in every worker, before and after a restart. Decoding and applying the
draws happens on the training device (:mod:`ddp_recipes.data.device_decode`). A batch's files travel in one uint8
buffer: one shared-memory transfer and one pinned copy per batch instead of one per file.
"""

from __future__ import annotations

import functools
import io
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from PIL import Image
from torch.utils.data import Dataset
from torchvision.transforms import v2

from ddp_recipes.config.choices import INTERPOLATIONS, check_choice
from ddp_recipes.data import augment
from ddp_recipes.data.unreadable import relative_name, unreadable
from ddp_recipes.errors import ConfigError

# Policies whose draws are separable from their image operation; AugMix draws its mixing weights on the image.
REPLAYABLE_POLICIES = (v2.AutoAugment, v2.RandAugment, v2.TrivialAugmentWide)
JPEG_SUFFIXES = (".jpg", ".jpeg")


@dataclass(frozen=True)
class TrainPipeline:
    """The training augmentation, as :func:`~ddp_recipes.data.augment.train_transform`'s arguments (hashable:
    it travels with every batch, and each process builds its transforms once per pipeline)."""

    crop_size: int
    min_crop_scale: float = 0.08
    interpolation: str = "bilinear"
    auto_augment: str | None = None
    ra_magnitude: int = 9
    augmix_severity: int = 3
    random_erase: float = 0.0
    mean: tuple[float, ...] = augment.IMAGENET_MEAN
    std: tuple[float, ...] = augment.IMAGENET_STD

    def build(self) -> v2.Compose:
        """The CPU pipeline (PIL images or uint8 tensors in, normalized float out)."""
        return augment.train_transform(self.crop_size, min_crop_scale=self.min_crop_scale,
                                       interpolation=self.interpolation, auto_augment=self.auto_augment,
                                       ra_magnitude=self.ra_magnitude, augmix_severity=self.augmix_severity,
                                       random_erase=self.random_erase, mean=self.mean, std=self.std)

    def steps(self) -> TrainSteps:
        """The pipeline's transforms by role, built once per process."""
        return _train_steps(self)

    def check_device(self) -> None:
        """A :class:`ConfigError` naming the flag when a step cannot be applied on the device."""
        if self.auto_augment == "augmix":
            raise ConfigError("{auto_augment} augmix is not applied with {decode} gpu (it mixes several augmented "
                              "copies of each image with weights drawn on the image); use ra, ta_wide or imagenet, "
                              "or {decode} cpu", "auto_augment")
        if self.auto_augment is not None and self.interpolation == "bicubic":
            raise ConfigError("{interpolation} bicubic does not work with {auto_augment} and {decode} gpu: the policy "
                              "then rotates and shears tensors, which take nearest or bilinear only; pick bilinear "
                              "or {decode} cpu", "interpolation")
        self.steps()


@dataclass(frozen=True)
class EvalPipeline:
    """The evaluation resize and centre crop, as :func:`~ddp_recipes.data.augment.eval_transform`'s arguments."""

    crop_size: int
    resize_size: int | None = None
    interpolation: str = "bilinear"
    mean: tuple[float, ...] = augment.IMAGENET_MEAN
    std: tuple[float, ...] = augment.IMAGENET_STD

    def build(self) -> v2.Compose:
        return augment.eval_transform(self.crop_size, resize_size=self.resize_size, interpolation=self.interpolation,
                                      mean=self.mean, std=self.std)

    def steps(self) -> tuple[v2.Transform, v2.Transform]:
        """(resize, centre crop), built once per process."""
        return _eval_steps(self)


class TrainSteps(NamedTuple):
    """The transforms of a training pipeline by role; ``None`` where the pipeline has no such step."""

    crop: v2.RandomResizedCrop
    flip: v2.RandomHorizontalFlip | None
    policy: v2.Transform | None
    to_float: v2.ToDtype
    erase: v2.RandomErasing | None
    recorder: _PolicyRecorder | None


class Draws(NamedTuple):
    """One sample's augmentation: crop box ``(top, left, height, width)`` of the decoded image, the flip, the
    policy's ``(operation, magnitude)`` list, and the erased box ``(top, left, height, width, value)`` after
    normalizing (None: nothing erased)."""

    crop: tuple[int, int, int, int]
    flip: bool
    ops: tuple[tuple[str, float], ...]
    erase: tuple[int, int, int, int, float] | None


@functools.lru_cache(maxsize=16)
def _train_steps(pipeline: TrainPipeline) -> TrainSteps:
    compose = pipeline.build()
    crop, *rest = compose.transforms
    flip = policy = to_float = erase = None
    for t in rest:
        if isinstance(t, v2.RandomHorizontalFlip):
            flip = t
        elif isinstance(t, REPLAYABLE_POLICIES):
            policy = t
        elif isinstance(t, v2.ToDtype):
            to_float = t
        elif isinstance(t, v2.RandomErasing):
            erase = t
        elif not isinstance(t, v2.ToImage | v2.Normalize):
            raise TypeError(f"the device pipeline does not know the training step {type(t).__name__}")
    if not isinstance(crop, v2.RandomResizedCrop) or to_float is None:
        raise TypeError(f"the device pipeline expects RandomResizedCrop ... ToDtype, got {compose}")
    if erase is not None and erase.value is None:
        raise TypeError("the device pipeline erases with a constant value, not RandomErasing(value='random')")
    recorder = _PolicyRecorder(pipeline) if policy is not None else None
    return TrainSteps(crop, flip, policy, to_float, erase, recorder)


@functools.lru_cache(maxsize=16)
def _eval_steps(pipeline: EvalPipeline) -> tuple[v2.Transform, v2.Transform]:
    resize, centre, *_ = pipeline.build().transforms
    return resize, centre


class _PolicyRecorder:
    """Runs a policy's own ``forward`` on a stand-in of the image's shape, recording each ``(operation,
    magnitude)`` instead of applying it: the CPU pipeline's draws depend on the size only. The device replays them
    with ``_apply_image_or_video_transform``, the one method that applies an operation (torchvision 0.26 to 0.29)."""

    def __init__(self, pipeline: TrainPipeline) -> None:
        self.policy = augment.auto_augment_policy(pipeline.auto_augment,  # type: ignore[arg-type]
                                                  interpolation=pipeline.interpolation,  # type: ignore[arg-type]
                                                  ra_magnitude=pipeline.ra_magnitude,
                                                  augmix_severity=pipeline.augmix_severity)
        self.ops: list[tuple[str, float]] = []
        self.policy._apply_image_or_video_transform = self._record  # an instance attribute: this copy only

    def _record(self, image: Any, transform_id: str, magnitude: float, interpolation: Any, fill: Any) -> Any:
        self.ops.append((transform_id, float(magnitude)))
        return image

    def draw(self, height: int, width: int) -> tuple[tuple[str, float], ...]:
        self.ops = []
        self.policy(_stand_in(height, width, torch.uint8))
        return tuple(self.ops)


def _stand_in(height: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """A ``[3, height, width]`` tensor of one element (stride 0): what ``make_params`` reads is the shape."""
    return torch.zeros((), dtype=dtype).expand(3, height, width)


def draw_train(steps: TrainSteps, height: int, width: int) -> Draws:
    """One sample's draws for an image of ``height x width``, consuming the random stream exactly as the CPU
    pipeline's ``forward`` calls do (torchvision's ``_RandomApplyTransform``: a coin ``torch.rand(1) >= p``
    skips the step, else ``make_params``)."""
    box = steps.crop.make_params([_stand_in(height, width, torch.uint8)])
    size_h, size_w = steps.crop.size
    flip = steps.flip is not None and not bool(torch.rand(1) >= steps.flip.p)
    ops = steps.recorder.draw(size_h, size_w) if steps.recorder is not None else ()
    erase = None
    if steps.erase is not None and not bool(torch.rand(1) >= steps.erase.p):
        zone = steps.erase.make_params([_stand_in(size_h, size_w, torch.float32)])
        if zone["v"] is not None:  # None: no box fitted in 10 tries, nothing is erased
            erase = (zone["i"], zone["j"], zone["h"], zone["w"], float(zone["v"].reshape(-1)[0]))
    return Draws((box["top"], box["left"], box["height"], box["width"]), flip, ops, erase)


def image_size(data: bytes) -> tuple[int, int]:
    """(height, width) from an image file's header, as the decoders will see it (no EXIF rotation: neither
    the PIL loader of the CPU pipeline nor ``decode_jpeg`` applies one, :func:`ddp_recipes.data.decoders.unrotated`
    keeping TorchCodec's from it)."""
    with Image.open(io.BytesIO(data)) as image:
        width, height = image.size
    return height, width


class EncodedBatch:
    """What a ``decode="gpu"`` loader yields: encoded files, labels, per-sample draws and the pipeline to apply.

    :meth:`to` moves the labels only (``decode_jpeg`` reads the bytes on the host); the DataModule's
    ``on_after_batch_transfer`` decodes it. Not a sequence: Lightning's collection walks leave it whole."""

    def __init__(self, buffer: torch.Tensor, lengths: list[int], labels: torch.Tensor, draws: list[Draws] | None,
                 pipeline: TrainPipeline | EvalPipeline, names: list[str], device: torch.device | None = None) -> None:
        self.buffer, self.lengths, self.labels = buffer, lengths, labels
        self.draws, self.pipeline, self.names = draws, pipeline, names
        self.device = device if device is not None else labels.device

    @property
    def data(self) -> list[torch.Tensor]:
        """Each file's bytes: a list of 1-D uint8 tensors (views of the one host buffer)."""
        return list(self.buffer.split(self.lengths))

    @property
    def size(self) -> int:
        return len(self.lengths)

    def _with(self, buffer: torch.Tensor, labels: torch.Tensor, device: torch.device) -> EncodedBatch:
        return EncodedBatch(buffer, self.lengths, labels, self.draws, self.pipeline, self.names, device)

    def pin_memory(self) -> EncodedBatch:
        return self._with(self.buffer.pin_memory(), self.labels.pin_memory(), self.device)

    def to(self, device: torch.device | str, *args: Any, **kwargs: Any) -> EncodedBatch:
        """Labels to ``device`` (non-blocking from pinned memory); the bytes stay on the host."""
        device = torch.device(device)
        labels = self.labels.to(device, non_blocking=self.labels.is_pinned() if device.type == "cuda" else False)
        return self._with(self.buffer, labels, device)

    def __iter__(self):
        raise TypeError("an EncodedBatch (decode 'gpu') reached the step undecoded: ImageFolderDataModule's "
                        "on_after_batch_transfer decodes it; a subclass that overrides it must call super()")


class EncodedImageFolder(Dataset):
    """ImageFolder samples as ``(file bytes, label, draws)``; :meth:`collate` makes the :class:`EncodedBatch`.
    A :class:`TrainPipeline` draws per sample (the resumable loader seeds them); an :class:`EvalPipeline` none."""

    def __init__(self, samples: Sequence[tuple[str, int]], pipeline: TrainPipeline | EvalPipeline,
                 root: str | Path | None = None) -> None:
        check_choice("interpolation", pipeline.interpolation, INTERPOLATIONS)
        self.samples = list(samples)
        self.pipeline = pipeline
        self.root = root  # the data folder: errors name a file relative to it

    def __len__(self) -> int:
        return len(self.samples)

    def read(self, index: int) -> tuple[bytes, int, str]:
        """Sample ``index``'s encoded bytes, label and path (what errors name): a file of the folder here; a
        subclass reads them elsewhere (:class:`~ddp_recipes.data.stream.EncodedStream`: a converted stream)."""
        path, label = self.samples[index]
        return Path(path).read_bytes(), label, path

    def __getitem__(self, index: int) -> tuple[bytes, int, Draws | None, str]:
        data, label, path = self.read(index)
        draws = None
        name = relative_name(path, self.root)
        if isinstance(self.pipeline, TrainPipeline):
            try:
                size = image_size(data)
            except (OSError, SyntaxError, ValueError) as err:  # PIL cannot read its header: no decoder will
                raise unreadable(path, self.root, err) from None
            draws = draw_train(self.pipeline.steps(), *size)
        return data, label, draws, name

    def collate(self, samples: list[tuple[bytes, int, Draws | None, str]]) -> EncodedBatch:
        """The loader's ``collate_fn`` (a bound method: it pickles with the dataset into the workers)."""
        datas, labels, draws, names = zip(*samples, strict=True)
        buffer = torch.frombuffer(bytearray(b"".join(datas)), dtype=torch.uint8)
        return EncodedBatch(buffer, [len(d) for d in datas], torch.tensor(labels, dtype=torch.long),
                            list(draws) if isinstance(self.pipeline, TrainPipeline) else None, self.pipeline,
                            list(names))

    def not_jpeg(self) -> int:
        """Files not named .jpg/.jpeg: nvJPEG refuses them, so each is decoded on the CPU instead."""
        return sum(1 for path, _ in self.samples if not path.lower().endswith(JPEG_SUFFIXES))
