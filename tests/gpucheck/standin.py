"""CPU stand-ins for what the GPU does differently, so that a false failure of gpu-check is seen on CPU first.

* :class:`HostToDeviceCopies`: the blocking host-to-device copies that CUDA's sync debug mode
  (``torch.cuda.set_sync_debug_mode``) flags, counted on the CPU, where host and device are one. A
  ``TorchFunctionMode`` follows where each tensor made while it is entered would live on CUDA: a factory with no
  device (``torch.tensor(0.0)``, a metric's default) makes a host tensor, an op on host tensors only gives a host
  tensor, anything else (the model, the optimizer, tensors from before the mode) is on the device. A copy is a
  host tensor's ``.to(device)``, a device tensor's ``copy_`` from one, and ``torch.tensor``/``as_tensor`` of
  host data with ``device=``; blocking unless ``non_blocking=True``, which Lightning's batch transfer passes on
  CUDA (``lightning.fabric.utilities.apply_func.batch_to``; not on the CPU, so the stand-in gives it the flag).
  Not modelled: device-to-host copies (``.cpu()``: host and device are one here), allocator and cuDNN syncs.
* :class:`HostReads`: the device-to-host reads sync debug flags (``.item()``, ``bool(t)``), as the CPU suite
  counts them (``benchmarks/account/step_counts.py``).
* :func:`nearest_chroma_decode`: a JPEG decoder that fills 4:2:0-subsampled chroma by nearest neighbour, as
  nvJPEG's default does, where libjpeg-turbo (the CPU decoders) interpolates ("fancy upsampling"). It decodes with
  libjpeg (Pillow) to YCbCr, recovers the stored chroma samples from libjpeg's interpolated planes (the mean of
  each 2x2 block is the samples filtered by [1, 6, 1] / 8 each way, edges repeated: solved exactly), repeats each
  sample 2x2 and converts to RGB as JFIF does. Re-interpolating the recovered samples instead gives libjpeg's own
  output within 0.3 levels on average, 3 at most (tests/gpucheck/test_standins.py): the samples are right.
"""

from __future__ import annotations

import functools
import io
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# Lightning's batch transfer: on CUDA it passes non_blocking=True (its _BLOCKING_DEVICE_TYPES lists cpu and mps).
_LIGHTNING_BATCH_TO = ("batch_to", str(Path("lightning", "fabric", "utilities", "apply_func.py")))
_CREATE_FROM_DATA = {torch.tensor, torch.as_tensor, torch.Tensor.new_tensor}


def _caller_is_lightning_batch_to() -> bool:
    """Whether the Python function that called ``Tensor.to`` is Lightning's batch transfer."""
    frame = sys._getframe(1)
    while frame is not None and (frame.f_code.co_filename == __file__
                                 or frame.f_code.co_filename.endswith(str(Path("torch", "overrides.py")))):
        frame = frame.f_back
    return (frame is not None and frame.f_code.co_name == _LIGHTNING_BATCH_TO[0]
            and frame.f_code.co_filename.endswith(_LIGHTNING_BATCH_TO[1]))


class HostToDeviceCopies(TorchFunctionMode):
    """Calls ``on_copy(what)`` for each blocking host-to-device copy (see the module docstring) while entered."""

    def __init__(self, device: torch.device, on_copy: Callable[[str], None]) -> None:
        super().__init__()
        self.device = torch.device(device)
        self.on_copy = on_copy
        self._host: dict[int, Any] = {}  # id -> weakref of the tensors that live on the host

    def _is_host(self, t: torch.Tensor) -> bool:
        ref = self._host.get(id(t))
        return ref is not None and ref() is t

    def _mark(self, t: torch.Tensor, host: bool) -> None:
        import weakref

        if host:
            key = id(t)
            self._host[key] = weakref.ref(t, lambda _, key=key: self._host.pop(key, None))
        else:
            self._host.pop(id(t), None)

    def _on_device(self, device: Any) -> bool:
        return device is not None and torch.device(device).type == self.device.type

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if func is torch.Tensor.to:
            return self._to(args, kwargs)
        out = func(*args, **kwargs)
        if not isinstance(out, torch.Tensor):
            return out
        # (deepcopy's memo holds the copy itself: only the tensor copied is its input)
        inputs = [args[0]] if func is torch.Tensor.__deepcopy__ else [
            a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        if func is torch.Tensor.copy_:
            dst, src = args[0], args[1] if len(args) > 1 else kwargs["src"]
            blocking = not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
            if not self._is_host(dst) and self._is_host(src) and blocking:
                self.on_copy("copy_ from a host tensor")
            return out
        if any(out is t for t in inputs):  # in place: it stays where it was
            return out
        if func in _CREATE_FROM_DATA and self._on_device(kwargs.get("device")):
            data = args[0] if args and func is not torch.Tensor.new_tensor else args[1] if len(args) > 1 else None
            if not isinstance(data, torch.Tensor) or self._is_host(data):
                self.on_copy(f"{getattr(func, '__name__', func)}(..., device={kwargs['device']}) of host data")
            return out
        if inputs:
            self._mark(out, all(self._is_host(t) for t in inputs))
        else:
            self._mark(out, not self._on_device(kwargs.get("device")))
        return out

    def _to(self, args: tuple, kwargs: dict) -> Any:
        src = args[0]
        device, _, non_blocking, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
        out = torch.Tensor.to(*args, **kwargs)
        if not self._is_host(src):
            return out
        if not self._on_device(device):
            if out is not src:
                self._mark(out, True)
            return out
        if not (non_blocking or _caller_is_lightning_batch_to()):
            self.on_copy(f"Tensor.to({device}) of a host tensor")
        if out is src:  # on the CPU, a no-op: the device copy is a new tensor on CUDA
            out = src.clone()
        self._mark(out, False)
        return out


class HostReads(TorchDispatchMode):
    """Calls ``on_read(op)`` for each host read of a tensor's value (``.item()``, ``bool(t)``) while entered."""

    READS = ("aten::_local_scalar_dense", "aten::is_nonzero")

    def __init__(self, on_read: Callable[[str], None]) -> None:
        super().__init__()
        self.on_read = on_read

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if func._schema.name in self.READS:
            self.on_read(func._schema.name)
        return func(*args, **(kwargs or {}))


# ---- JPEG: nvJPEG's nearest-neighbour chroma ----------------------------------------------------------------

@functools.cache
def _unfilter(n: int) -> np.ndarray:
    """The inverse of [1, 6, 1] / 8 over ``n`` samples, edges repeated."""
    m = np.zeros((n, n))
    for i in range(n):
        m[i, i] += 6
        m[i, max(i - 1, 0)] += 1
        m[i, min(i + 1, n - 1)] += 1
    return np.linalg.inv(m / 8)


def _stored_chroma(plane: np.ndarray, fy: int, fx: int) -> np.ndarray:
    """The chroma samples libjpeg interpolated into ``plane`` (subsampled ``fy`` x ``fx``, each 1 or 2)."""
    h, w = -(-plane.shape[0] // fy), -(-plane.shape[1] // fx)
    padded = np.pad(plane, ((0, h * fy - plane.shape[0]), (0, w * fx - plane.shape[1])), mode="edge")
    mean = padded.reshape(h, fy, w, fx).mean(axis=(1, 3))
    if fy == 2:
        mean = _unfilter(h) @ mean
    if fx == 2:
        mean = mean @ _unfilter(w).T
    return mean


def _decode_one(data: torch.Tensor | bytes) -> torch.Tensor:
    from PIL import Image

    raw = data.numpy().tobytes() if isinstance(data, torch.Tensor) else bytes(data)
    image = Image.open(io.BytesIO(raw))
    if image.format != "JPEG" or image.mode != "RGB":
        raise RuntimeError(f"the stand-in decodes RGB JPEGs only (got {image.format} {image.mode})")
    sampling = {i: (h, v) for i, h, v, _ in image.layer}  # component id -> sampling factors
    image.draft("YCbCr", image.size)  # libjpeg's output before its colour conversion
    ycc = np.asarray(image, dtype=np.float64)
    height, width = ycc.shape[:2]
    luma_h, luma_v = sampling[1]
    planes = [ycc[..., 0]]
    for k in (1, 2):
        fx, fy = luma_h // sampling[k + 1][0], luma_v // sampling[k + 1][1]
        stored = _stored_chroma(ycc[..., k], fy, fx) if (fx, fy) != (1, 1) else ycc[..., k]
        planes.append(stored.repeat(fy, 0).repeat(fx, 1)[:height, :width])
    y, cb, cr = planes[0], planes[1] - 128, planes[2] - 128
    rgb = np.stack([y + 1.402 * cr, y - 0.344136 * cb - 0.714136 * cr, y + 1.772 * cb])
    return torch.from_numpy(np.clip(np.round(rgb), 0, 255).astype(np.uint8))


def nearest_chroma_decode(data: Any, device: str | torch.device = "cpu", mode: str = "RGB") -> Any:
    """``decode_jpeg``'s signature (one tensor of bytes or a list): RGB images with chroma repeated, not
    interpolated, on ``device``."""
    assert mode == "RGB", mode
    if isinstance(data, list):
        return [_decode_one(d).to(device) for d in data]
    return _decode_one(data).to(device)
