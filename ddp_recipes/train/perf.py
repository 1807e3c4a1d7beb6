"""How fast a run is, in the units that compare across machines: TF32, FLOPs and MFU, input-pipeline wait.

* **TF32** for ``32-true`` on Ampere and newer GPUs, on by default (NVIDIA's published FP32 ResNet figures
  are TF32; PyTorch leaves matmuls in full FP32 and Lightning only warns). ``--no-tf32`` turns it off.
* **FLOPs per sample** of a training step (forward + backward), counted once with Lightning's
  ``measure_flops`` on a meta-device copy of the model (no memory, no compute); achieved FLOP/s follow
  from the measured samples/s, and MFU from the device's dense peak in the pack's own table
  (:mod:`ddp_recipes.train.peaks`; Lightning's ``get_available_flops`` only for a GPU the table lacks;
  unknown peak, e.g. any CPU: MFU is None, never a guess).
* **Input wait**: the time the training loop blocks on the next batch (Lightning's
  ``train_dataloader_next``: the loader, and its prefetch of the following batch), per step, from a
  profiler that times that one action.
* **Step time** (:class:`StepClock`): on CUDA, CUDA events recorded on the stream at each mark, so a
  figure is device time, not the host's launch queue; read without a synchronize (an event is read once
  the device has passed it). On CPU the host clock, which is the device's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.profilers import Profiler
from typing_extensions import override

from ddp_recipes.config.world import check_bf16_device

FETCH_ACTION = "train_dataloader_next"


# ---- TF32 ----------------------------------------------------------------------------------------------

def tf32_capable() -> bool:
    """A visible CUDA device with TF32 tensor cores (compute capability 8.0, Ampere, or newer)."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8


def configure_tf32(enabled: bool, accelerator: str) -> None:
    """Set TF32 for matmuls and cuDNN convolutions in this process (each rank calls it). CPU: untouched."""
    if accelerator != "cuda":
        return
    # "high" = TF32 matmuls; "highest" = full FP32. cuDNN convolutions have their own switch.
    torch.set_float32_matmul_precision("high" if enabled else "highest")
    torch.backends.cudnn.allow_tf32 = enabled


class TF32Setting(Callback):
    """Applies the TF32 choice in every rank's process at set-up: ranks started by the ``spawn`` launcher do
    not inherit the launching process's settings (build_trainer sets them there for the set-up print)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        configure_tf32(self.enabled, trainer.strategy.root_device.type)


class BF16Check(Callback):
    """``bf16-mixed`` on a GPU without bf16 units fails at set-up, in the rank, on its own device, naming the fix
    (:func:`~ddp_recipes.config.world.check_bf16_device`). TunedDDPStrategy checks first thing in its ranks; one
    device runs Lightning's own strategy, where this callback does it."""

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        check_bf16_device(str(trainer.precision), trainer.strategy.root_device)


def tf32_state(accelerator: str) -> str:
    """What the set-up print says about TF32 in this process."""
    if accelerator != "cuda":
        return "n/a (CPU)"
    if not tf32_capable():
        return "n/a (GPU before Ampere: no TF32 tensor cores)"
    matmul = torch.get_float32_matmul_precision() != "highest"
    conv = torch.backends.cudnn.allow_tf32
    if matmul and conv:
        return "on (FP32 matmuls and convolutions run as TF32; --no-tf32 for full FP32)"
    if not matmul and not conv:
        return "off (full FP32)"
    return f"partly (matmuls {'TF32' if matmul else 'FP32'}, convolutions {'TF32' if conv else 'FP32'})"


# ---- FLOPs and MFU --------------------------------------------------------------------------------------

def training_flops_per_sample(build_model: Callable[[], L.LightningModule], example: torch.Tensor) -> int | None:
    """FLOPs of one training sample (forward + backward) of the model ``build_model`` makes.

    Counted on a meta-device copy in eval mode: no weights allocated, and a gradient-checkpointing model
    is counted without its recompute (MFU's convention: model FLOPs, not hardware FLOPs). ``build_model`` runs
    once more for it, so a model whose ``__init__`` reads files reads them again. None when the model cannot
    be built or run on the meta device (e.g. it reads tensor values in ``__init__``).
    """
    from lightning.fabric.utilities.throughput import measure_flops

    if example.ndim == 0 or example.shape[0] < 1:
        return None
    try:
        with torch.device("meta"):
            model = build_model().eval()
            x = torch.empty(example.shape, dtype=example.dtype)  # token ids stay integers (embeddings)
        with torch.enable_grad():
            total = measure_flops(model, lambda: model(x), lambda y: y.float().sum())
    except Exception:  # noqa: BLE001 - a model that cannot run on meta only loses its FLOP count
        return None
    return int(total // example.shape[0]) or None


def peak_flops(device: torch.device, precision: str) -> int | None:
    """The device's dense peak FLOP/s at the run's compute dtype (TF32 counted for 32-true when it is on),
    from the pack's table (:mod:`ddp_recipes.train.peaks`), else Lightning's; None when neither knows the device
    (and on every CPU)."""
    from ddp_recipes.train.peaks import device_peak

    return device_peak(device, precision)


def flops_summary(flops_per_sample: int | None, samples_per_sec: float | None, world_size: int,
                  peak_per_device: int | None) -> dict[str, Any]:
    """The summary.json fields: FLOPs per sample, achieved FLOP/s per device and for the job, MFU."""
    job = flops_per_sample * samples_per_sec if flops_per_sample and samples_per_sec else None
    per_device = job / world_size if job else None
    return {
        "flops_per_sample": flops_per_sample,
        "achieved_flops_per_sec": round(job) if job else None,
        "achieved_flops_per_sec_per_device": round(per_device) if per_device else None,
        "peak_flops_per_sec_per_device": peak_per_device,
        "mfu": round(per_device / peak_per_device, 4) if per_device and peak_per_device else None,
    }


# ---- step time ------------------------------------------------------------------------------------------

class StepClock:
    """Marks points of the training loop and gives the seconds between two marks, in device time.

    ``kind`` is ``"host"`` (``time.perf_counter``; CPU and any non-CUDA device) or ``"cuda-events"``: a
    ``torch.cuda.Event`` recorded on the current stream, whose ``elapsed_time`` is known once the device
    reached it. :meth:`seconds` is None until then and never blocks; ``wait=True`` synchronizes on the later
    event (for reading the figures after training, outside the measured work).
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.kind = "cuda-events" if self.device.type == "cuda" else "host"

    def mark(self) -> Any:
        if self.kind == "host":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def seconds(self, start: Any, end: Any, wait: bool = False) -> float | None:
        """Seconds from mark ``start`` to mark ``end``; None while the device has not reached ``end``."""
        if self.kind == "host":
            return end - start
        if not end.query():  # a status read of the event, not a stream synchronize
            if not wait:
                return None
            end.synchronize()
        return start.elapsed_time(end) / 1000.0


# ---- input-pipeline wait -------------------------------------------------------------------------------

class InputWaitProfiler(Profiler):
    """Times only Lightning's ``train_dataloader_next`` action (the loop blocked on the next batch).

    Every other action costs one string test. ``last_wait`` is the latest fetch's seconds, read by
    :class:`~ddp_recipes.train.run.ThroughputMeter` and :class:`~ddp_recipes.train.diagnostics.DDPDiagnostics` at
    each batch end.
    """

    def __init__(self) -> None:
        super().__init__()
        self._started: float | None = None
        self.last_wait = 0.0

    @override
    def start(self, action_name: str) -> None:
        if action_name.endswith(FETCH_ACTION):
            self._started = time.perf_counter()

    @override
    def stop(self, action_name: str) -> None:
        if action_name.endswith(FETCH_ACTION) and self._started is not None:
            self.last_wait = time.perf_counter() - self._started
            self._started = None

    @override
    def profile(self, action_name: str) -> AbstractContextManager:
        # Lightning wraps every hook of every callback, of the module and of the strategy in profile()
        # (~45 per MNIST step): the base class's generator context costs more than the hooks the pack adds.
        # The fetch is timed through start/stop, never through profile().
        if action_name.endswith(FETCH_ACTION):
            return super().profile(action_name)
        return _UNTIMED

    @override
    def summary(self) -> str:
        return ""


_UNTIMED = nullcontext()  # stateless: one instance serves every nested use


def input_wait(trainer: L.Trainer) -> float | None:
    """Seconds the loop waited for the batch now being trained on; None without :class:`InputWaitProfiler`."""
    profiler = getattr(trainer, "profiler", None)
    return profiler.last_wait if isinstance(profiler, InputWaitProfiler) else None
