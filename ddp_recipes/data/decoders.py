"""Which library decodes image bytes into tensors: TorchCodec's decoders where torchcodec is installed (the pack's
``decode`` extra), torchvision.io's where it is not (the lent GPU machine's stack: torchvision 0.26, no torchcodec).

torchvision 0.29 deprecates its image decoders (every call warns) in favour of TorchCodec's, which take the same
arguments and decode a JPEG to the same pixels, but for one thing: TorchCodec always applies the EXIF orientation,
which ``--decode cpu``'s PIL loader does not (and the crops are drawn on the stored size), so the pack hands it a
JPEG's EXIF segments renamed (:func:`unrotated`). Decided once per process; ``DDP_RECIPES_IMAGE_DECODER=torchvision``
forces torchvision.io. Without torchcodec on torchvision 0.29, the first decode says so once, naming the extra.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch

ENV = "DDP_RECIPES_IMAGE_DECODER"
#: torchvision 0.29's per-call warning (torchvision/io/image.py), matched from its start.
DEPRECATED = "The image decoding and encoding capabilities of TorchVision are deprecated"


class ImageDecoders(NamedTuple):
    """One library's decoders; both take ``mode="RGB"`` and a file's bytes as a uint8 tensor."""

    name: str  # "torchcodec" or "torchvision"
    decode_jpeg: Callable[..., Any]  # (bytes or a list of them, device=, mode=) -> image(s) on device
    decode_image: Callable[..., Any]  # (bytes or a path, mode=) -> image on the CPU


LIBRARIES = ("torchcodec", "torchvision")


@functools.cache
def image_decoders(library: str | None = None) -> ImageDecoders:
    """This process's decoders, chosen on the first call: TorchCodec's where it imports, else torchvision.io's.
    ``library`` asks for one of :data:`LIBRARIES` (``"torchcodec"``: ImportError where it is missing)."""
    missing, forced = None, os.environ.get(ENV, "")
    if forced not in ("", *LIBRARIES):  # a typo would silently decode with the other library
        from ddp_recipes.errors import ConfigError, lit

        raise ConfigError(f"{ENV}={lit(forced)} is not a decoder: set it to {' or '.join(LIBRARIES)}, or unset it")
    if library == "torchcodec" or library is None and forced != "torchvision":
        try:
            from torchcodec.decoders import decode_image, decode_jpeg

            return ImageDecoders("torchcodec", _stored(decode_jpeg), _stored(decode_image))
        except (ImportError, OSError) as error:  # OSError: installed, but its libraries do not load with this torch
            if library:
                raise ImportError(f"torchcodec does not import here ({error})") from error
            missing = error
    import torchvision
    from packaging.version import Version
    from torchvision.io import decode_image, decode_jpeg

    if Version(torchvision.__version__).release[:2] < (0, 29):
        return ImageDecoders("torchvision", decode_jpeg, decode_image)
    if missing is not None:
        from lightning.pytorch.utilities.rank_zero import rank_zero_warn

        from ddp_recipes.extras import install_hint

        why = "is not installed" if isinstance(missing, ImportError) else f"does not load ({missing})"
        rank_zero_warn(f"images decode with torchvision.io, which torchvision {torchvision.__version__} deprecates: "
                       f"TorchCodec {why}; for its decoders, {install_hint('decode', 'torchcodec')}")
    return ImageDecoders("torchvision", _quiet(decode_jpeg), _quiet(decode_image))


def _quiet(decode: Callable[..., Any]) -> Callable[..., Any]:
    """``decode`` without torchvision's per-call deprecation warning (said once, above); other warnings pass."""

    @functools.wraps(decode)
    def call(*args: Any, **kwargs: Any) -> Any:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=DEPRECATED, category=DeprecationWarning)
            return decode(*args, **kwargs)

    return call


def _stored(decode: Callable[..., Any]) -> Callable[..., Any]:
    """TorchCodec's ``decode`` of what a file stores: its source (or each of a list) through :func:`unrotated`."""

    @functools.wraps(decode)
    def call(source: Any, **kwargs: Any) -> Any:
        many = isinstance(source, list | tuple)
        return decode([unrotated(s) for s in source] if many else unrotated(source), **kwargs)

    return call


APP1, UNREAD_APP = 0xE1, 0xEF  # EXIF (and XMP) live in APP1 segments; APP15 is read by no decoder


def unrotated(source: torch.Tensor | str | os.PathLike) -> torch.Tensor:
    """A file's bytes (a path is read), with each APP1 segment of a JPEG's header renamed APP15 in a copy:
    TorchCodec then finds no EXIF orientation and decodes the pixels as stored. Other files are left as they are."""
    data = source if isinstance(source, torch.Tensor) else torch.frombuffer(bytearray(Path(source).read_bytes()),
                                                                              dtype=torch.uint8)
    view, pos, found = data.numpy(), 2, []
    if view[:2].tobytes() != b"\xff\xd8":
        return data
    while pos + 4 <= len(view) and view[pos] == 0xFF and view[pos + 1] not in (0xDA, 0xD9):  # up to SOS/EOI
        if view[pos + 1] == 0xFF:  # a fill byte: any marker may follow any number of them (JPEG B.1.1.2)
            pos += 1
            continue
        if view[pos + 1] == APP1:
            found.append(pos + 1)
        pos += 2 + (int(view[pos + 2]) << 8 | int(view[pos + 3]))
    if found:
        data = data.clone()
        data[found] = UNREAD_APP
    return data
