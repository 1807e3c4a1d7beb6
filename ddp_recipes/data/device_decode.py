"""``--decode gpu``'s device side: decode an :class:`~ddp_recipes.data.encoded.EncodedBatch` on its device and
apply the drawn augmentation there, equal bit for bit to the CPU tensor pipeline for the same draws
(``tests/data/test_device_decode.py``; the steps: docs/recipes.md).

No step reads the device from the host (draws are host values, normalisation constants copied once, pinned).
On CUDA the decoders allocate outputs on the *current* stream without waiting for it, so the decode runs on a
side stream the training stream then waits for, and each image is recorded on the training stream: no block is
reused while a queued kernel still reads it. A file ``decode_jpeg`` refuses is decoded by ``--decode cpu``'s
loader (:mod:`ddp_recipes.data.pixels`) and copied over, counted in :attr:`DeviceDecoder.fallbacks`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ddp_recipes.data.decoders import image_decoders
from ddp_recipes.data.encoded import Draws, EncodedBatch, EvalPipeline, TrainPipeline
from ddp_recipes.data.pixels import open_rgb, to_tensor

JpegDecoder = Callable[..., Any]


def _to_device(image: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host image on ``device``: pinned and non-blocking on CUDA (a pageable copy would wait for the stream)."""
    if device.type != "cuda":
        return image.to(device)
    return image.pin_memory().to(device, non_blocking=True)


# nvJPEG's NVJPEG_STATUS_ALLOCATOR_FAILURE (5), as torchvision's checks print a failed status ("Failed to decode
# batch: 5"): nvJPEG allocates its own device buffers, outside torch's allocator.
_NVJPEG_ALLOCATOR_FAILURE = re.compile(r"Failed to [^:\n]+: 5\s*$", re.MULTILINE)


def is_out_of_memory(err: BaseException) -> bool:
    """Whether a decoder's error is the device running out of memory, not a file it refuses. torchvision's batched
    nvJPEG decode re-raises whatever is not a plain ``std::runtime_error`` as a RuntimeError ("Error while decoding
    JPEG images: CUDA out of memory. ..."), so torch's OutOfMemoryError reaches Python as a RuntimeError there."""
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower() or bool(
        _NVJPEG_ALLOCATOR_FAILURE.search(str(err)))


def out_of_memory(err: BaseException, files: int, device: torch.device) -> torch.OutOfMemoryError:
    """The device ran out of memory decoding ``files`` at once: said as such, with the fix (a file nvJPEG
    refuses is another matter, decoded on the CPU instead)."""
    first = (str(err).strip().splitlines() or ["out of memory"])[0]
    return torch.OutOfMemoryError(
        f"out of memory on {device} decoding {files} JPEG(s) at once (--decode gpu decodes each batch's files "
        f"together, their decoded images and the decoder's work space at the same time): lower --batch-size, the "
        f"files decoded at once per device, or use --decode cpu; {first}")


def decode_one(data: torch.Tensor, device: str | torch.device, jpeg_decoder: JpegDecoder | None = None,
               name: str | None = None) -> tuple[torch.Tensor, bool]:
    """One file's bytes as an RGB uint8 ``[3, H, W]`` image on ``device``, and whether it needed the CPU fallback:
    ``jpeg_decoder`` (default: :func:`~ddp_recipes.data.decoders.image_decoders`' ``decode_jpeg``) first; a file
    it refuses is decoded on the CPU by ``--decode cpu``'s loader (:func:`~ddp_recipes.data.pixels.open_rgb`). A
    file neither decodes, or with no faithful 8-bit picture, is an
    :class:`~ddp_recipes.data.unreadable.UnreadableImage` naming it (``name``)."""
    device = torch.device(device)
    try:
        return (jpeg_decoder or image_decoders().decode_jpeg)(data, device=device, mode="RGB"), False
    except (RuntimeError, ValueError) as err:  # libjpeg's "Not a JPEG file", nvJPEG's unsupported layouts
        if is_out_of_memory(err):
            raise out_of_memory(err, 1, device) from err
    image = to_tensor(open_rgb(data.numpy().tobytes(), name or "(unnamed)"))
    return _to_device(image, device), True


def decode_images(datas: Sequence[torch.Tensor], device: str | torch.device, jpeg_decoder: JpegDecoder | None = None,
                  names: Sequence[str] | None = None) -> tuple[list[torch.Tensor], int]:
    """Files' bytes as RGB uint8 images on ``device``, and how many needed the CPU fallback.

    The whole list goes to ``jpeg_decoder`` (default ``decode_jpeg``; on CUDA one batched nvJPEG call) at once;
    when that call refuses a file, the list is decoded file by file (:func:`decode_one`), so one PNG named
    ``.JPEG`` costs one CPU decode, not the batch."""
    device = torch.device(device)
    decoder = jpeg_decoder or image_decoders().decode_jpeg
    try:
        # RGB: ImageNet holds grayscale and CMYK JPEGs, which would otherwise decode to 1 or 4 channels.
        return list(decoder(list(datas), device=device, mode="RGB")), 0
    except (RuntimeError, ValueError) as err:
        if is_out_of_memory(err):  # never a file's refusal, never a CPU fallback
            raise out_of_memory(err, len(datas), device) from err
    images, fallbacks = [], 0
    for i, data in enumerate(datas):
        image, fell_back = decode_one(data, device, decoder, names[i] if names else None)
        images.append(image)
        fallbacks += fell_back
    return images, fallbacks


class DeviceDecoder:
    """Turns an :class:`EncodedBatch` on its device into ``(images, labels)``: decode, then the pipeline it names.

    One per process (the DataModule's): it keeps the side stream and the normalisation constants of each
    device, and counts :attr:`images` decoded and :attr:`fallbacks` (files decoded on the CPU instead).
    ``channels_last``: the images come out in NHWC memory format (the model's ``--channels-last``).
    """

    def __init__(self, channels_last: bool = False, jpeg_decoder: JpegDecoder | None = None) -> None:
        self.channels_last = channels_last
        self.jpeg_decoder = jpeg_decoder
        self.images = 0
        self.fallbacks = 0
        self._streams: dict[torch.device, Any] = {}
        self._constants: dict[tuple[torch.device, tuple[float, ...], tuple[float, ...]],
                              tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, batch: EncodedBatch) -> tuple[torch.Tensor, torch.Tensor]:
        device = batch.device
        images = self.decode(batch.data, device, batch.names)
        if isinstance(batch.pipeline, TrainPipeline):
            x = self.train_images(images, batch.draws or [], batch.pipeline)
        else:
            x = self.eval_images(images, batch.pipeline)
        return x, batch.labels

    def decode(self, datas: Sequence[torch.Tensor], device: torch.device,
               names: Sequence[str] | None = None) -> list[torch.Tensor]:
        """:func:`decode_images` on ``device``; on CUDA with the side stream current (the module docstring)."""
        if device.type != "cuda":
            images, fallbacks = decode_images(datas, device, self.jpeg_decoder, names)
        else:
            side = self._streams.get(device)
            if side is None:
                side = self._streams[device] = torch.cuda.Stream(device)
            compute = torch.cuda.current_stream(device)
            with torch.cuda.stream(side):
                images, fallbacks = decode_images(datas, device, self.jpeg_decoder, names)
            compute.wait_stream(side)
            for image in images:
                image.record_stream(compute)
        self.images += len(images)
        self.fallbacks += fallbacks
        return images

    def train_images(self, images: Sequence[torch.Tensor], draws: Sequence[Draws],
                     pipeline: TrainPipeline) -> torch.Tensor:
        """Decoded uint8 images with their draws -> the normalized float batch (the CPU pipeline's steps)."""
        steps = pipeline.steps()
        out = []
        for image, draw in zip(images, draws, strict=True):
            top, left, height, width = draw.crop
            image = steps.crop.transform(image, dict(top=top, left=left, height=height, width=width))
            if draw.flip:
                image = steps.flip.transform(image, {})  # type: ignore[union-attr]
            for op, magnitude in draw.ops:
                policy = steps.policy
                image = policy._apply_image_or_video_transform(image, op, magnitude,  # type: ignore[union-attr]
                                                               interpolation=policy.interpolation, fill=policy._fill)
            out.append(image)
        x = self._normalized(out, pipeline.mean, pipeline.std)
        for n, draw in enumerate(draws):
            if draw.erase is not None:
                top, left, height, width, value = draw.erase
                x[n, :, top:top + height, left:left + width] = value
        return x

    def eval_images(self, images: Sequence[torch.Tensor], pipeline: EvalPipeline) -> torch.Tensor:
        """Decoded uint8 images -> resized, centre-cropped, normalized float batch."""
        resize, centre = pipeline.steps()
        return self._normalized([centre.transform(resize.transform(image, {}), {}) for image in images],
                                pipeline.mean, pipeline.std)

    def _normalized(self, images: list[torch.Tensor], mean: tuple[float, ...], std: tuple[float, ...]) -> torch.Tensor:
        from torchvision.transforms.v2 import functional as F

        x = torch.stack(images)
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)  # on uint8: a quarter of the bytes of float
        x = F.to_dtype(x, torch.float32, scale=True)  # keeps the memory format
        shift, scale = self._constants_on(x.device, mean, std)
        return x.sub_(shift).div_(scale)  # torchvision's normalize, with the constants already on the device

    def _constants_on(self, device: torch.device, mean: tuple[float, ...],
                      std: tuple[float, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        key = (device, tuple(mean), tuple(std))
        found = self._constants.get(key)
        if found is None:
            found = self._constants[key] = tuple(  # type: ignore[assignment]
                _to_device(torch.tensor(values, dtype=torch.float32).view(1, -1, 1, 1), device)
                for values in (mean, std))
        return found  # type: ignore[return-value]

    def record(self) -> dict[str, Any]:
        """What this process decoded, and with which library, for ``summary.json``."""
        return {"images": self.images, "cpu_fallbacks": self.fallbacks, "decoder": image_decoders().name}
