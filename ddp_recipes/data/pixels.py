"""An image file's pixels as the 8-bit RGB picture every image pipeline of the pack takes, whatever its bit depth.

Pillow's ``convert("RGB")`` clips a high-bit-depth image at 255 (a 16-bit scan turns white, silently); here it
is scaled by ``to_dtype(..., torch.uint8, scale=True)``'s rule, by the file's full range, never its own min/max.
An image no rule fits is refused with a :class:`ValueError` naming its mode and range. The rules: docs/recipes.md.
"""

from __future__ import annotations

import io
import os
from typing import Any

import numpy as np
from PIL import Image

from ddp_recipes.data.unreadable import unreadable

SIXTEEN_BIT = frozenset({"I;16", "I;16L", "I;16B", "I;16N"})
FIX = "save it as 8-bit, 16-bit, or float in [0, 1]"


def as_rgb(image: Image.Image) -> Image.Image:
    """``image`` as 8-bit RGB: high-bit-depth modes scaled (the module docstring's rules), others converted.
    A :class:`ValueError` naming the mode when no rule maps it faithfully."""
    mode = image.mode
    if mode in SIXTEEN_BIT or mode in ("I", "F"):
        stored = {tile.args if isinstance(tile.args, str) else (tile.args or ("",))[0] for tile in image.tile or ()}
        sixteen = mode in SIXTEEN_BIT or any(str(raw).startswith("I;16") for raw in stored)
        return Image.fromarray(_eight_bit(np.asarray(image), "I;16" if sixteen else mode), mode="L").convert("RGB")
    try:
        return image.convert("RGB")
    except ValueError as err:  # "conversion from X to RGB not supported"
        raise ValueError(f"image mode {mode} has no 8-bit RGB conversion ({err}); {FIX}") from None


def _eight_bit(values: np.ndarray, mode: str) -> np.ndarray:
    if mode in SIXTEEN_BIT:
        return (values.astype(np.uint16) >> 8).astype(np.uint8)
    low, high = (values.min(), values.max()) if values.size else (0, 0)
    if mode == "I":
        if low < 0 or high > 65535:
            raise ValueError(f"image mode I (32-bit integer) with values {low}..{high}: only 0..65535 (16-bit) "
                             f"scales to 8 bits without picking a window; {FIX}")
        if high <= 255:  # 8-bit levels in a 32-bit file: as they are
            return values.astype(np.uint8)
        return (values.astype(np.uint16) >> 8).astype(np.uint8)
    if not (np.isfinite(low) and np.isfinite(high)) or low < 0 or high > 255:
        raise ValueError(f"image mode F (32-bit float) with values {low:g}..{high:g}: only [0, 1] (or 8-bit levels "
                         f"0..255) maps to 8 bits without picking a window; {FIX}")
    if high > 1:  # 8-bit levels in a float file: as convert("RGB") kept them
        return values.astype(np.uint8)
    return (values * np.float32(255.999)).astype(np.uint8)  # to_dtype's float -> uint8: scale by 256 - eps, floor


def open_rgb(source: str | os.PathLike | bytes, name: str | os.PathLike | None = None,
             root: str | os.PathLike | None = None) -> Image.Image:
    """A file (a path, or its bytes) decoded by Pillow as 8-bit RGB (:func:`as_rgb`); a file that does not
    decode, or has no faithful 8-bit picture, is an :class:`~ddp_recipes.data.unreadable.UnreadableImage` naming
    ``name`` (default: the path) relative to ``root``."""
    path = source if not isinstance(source, bytes) else None
    try:
        with Image.open(io.BytesIO(source) if isinstance(source, bytes) else source) as opened:
            return as_rgb(opened)
    except (OSError, SyntaxError, ValueError) as err:  # PIL: truncated, unidentified, broken headers; as_rgb
        raise unreadable(name if name is not None else path or "(unnamed)", root, err) from None


def named_loader(path: str, root: str | None = None) -> Image.Image:
    """The ImageFolder loader of the recipes: :func:`open_rgb` on the file (torchvision's ``pil_loader`` clips
    high-bit-depth images), its failure naming the file relative to ``root`` (a module function: with
    ``functools.partial`` it pickles into the loader workers)."""
    return open_rgb(path, root=root)


def to_tensor(image: Image.Image) -> Any:
    """An RGB picture as a uint8 ``[3, H, W]`` tensor (torchvision's ``pil_to_tensor``: no decoder involved)."""
    from torchvision.transforms.v2.functional import pil_to_tensor

    return pil_to_tensor(image)
