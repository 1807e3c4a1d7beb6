"""An exponential moving average of the network's weights, as torchvision's classification reference keeps one.

:class:`ModelEMA` is a callback: it averages ``pl_module.model`` (parameters *and* buffers, so BatchNorm
statistics too) every ``update_every`` optimizer steps, copies the weights instead while the LR warm-up
lasts, and saves the average in the checkpoint so ``--resume`` continues it exactly.
:class:`~ddp_recipes.modules.classifier.ImageClassifier` evaluates the average beside the network
(``val_acc_ema``, ``val_loss_ema``, ...) whenever the callback is attached.

Under DDP every rank keeps its own copy and updates it from its own (identical) parameters: no collective
per step. BatchNorm running statistics are the exception: without SyncBatchNorm each rank's differ, and
DDP makes rank 0's the network's (it broadcasts them before every forward). The copy's buffers therefore
follow rank 0's at the points where the ranks meet anyway: before every validation or test and at the end
of training (one small broadcast each), and a checkpoint holds rank 0's.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from copy import deepcopy
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.optim.swa_utils import get_ema_multi_avg_fn
from typing_extensions import override

from ddp_recipes.config.ema import EMAArgs
from ddp_recipes.errors import ConfigError
from ddp_recipes.optim.schedules import steps_per_epoch


def adjusted_decay(decay: float, world_size: int, per_device_batch: int, update_every: int, epochs: float) -> float:
    """The reference's EMA decay for this run: ``decay`` made independent of batch size, devices and epochs.

    An EMA of decay ``d`` forgets with a time constant of ``1 / (1 - d)`` *updates*. The reference (after
    pycls) wants that constant to be a fixed share of the run, whatever its shape. A run makes
    ``dataset / (world_size * per_device_batch * update_every)`` updates per epoch, hence the ``adjust`` below
    (the dataset size left out). ``decay`` is then the value tuned for one sample per update over one epoch:
    0.99998 with 8 devices x 128 images, every 32 steps, over 600 epochs gives 1 - 2e-5 * 54.61 = 0.998908.
    Updates count optimizer steps: with gradient accumulation pass one optimizer step's batch on one device
    (per-device batch x accumulation); the reference has no accumulation.
    """
    EMAArgs(decay, update_every)  # checks them
    if world_size < 1 or per_device_batch < 1:
        raise ConfigError(f"adjusted_decay needs world_size >= 1 and per_device_batch >= 1 "
                          f"(got {world_size}, {per_device_batch})")
    if not epochs > 0:
        raise ConfigError(f"{{epochs}} must be > 0 to adjust the EMA decay (got {epochs})")
    adjust = world_size * per_device_batch * update_every / epochs
    alpha = min(1.0, (1.0 - decay) * adjust)
    return 1.0 - alpha


# EMAArgs lives in ddp_recipes.config.ema, torch-free: a recipe checks its flags before torch loads.


def ema_for_run(args: EMAArgs, world_size: int, step_batch: int, epochs: int | None) -> ModelEMA:
    """The run's :class:`ModelEMA`: ``args.decay`` adjusted over ``epochs`` (:func:`adjusted_decay`, with
    ``step_batch`` the per-device batch of one optimizer step); unadjusted when the run is bounded by steps only
    (``epochs`` None or <= 0: its epoch count is unknown before the data is sized)."""
    decay = args.decay
    if epochs and epochs > 0:
        decay = adjusted_decay(decay, world_size, step_batch, args.update_every, epochs)
    return ModelEMA(decay=decay, update_every=args.update_every, warmup_epochs=args.warmup_epochs)


def network_of(pl_module: L.LightningModule) -> nn.Module:
    """The network the EMA averages: ``pl_module.model`` (ImageClassifier's ``build_model()`` result)."""
    network = getattr(pl_module, "model", None)
    if not isinstance(network, nn.Module):
        raise ConfigError(f"{{model_ema}} averages the LightningModule's network, its `model` attribute "
                          f"(ImageClassifier: self.model = self.build_model()); {type(pl_module).__name__} has "
                          f"{'none' if network is None else f'a {type(network).__name__} there'}")
    return network


class ModelEMA(Callback):
    """Keeps an exponential moving average of ``pl_module.model``'s parameters and buffers.

    After every ``update_every``-th optimizer step (``trainer.global_step`` a multiple of it, so gradient
    accumulation counts once per step): ``ema = decay * ema + (1 - decay) * weights``; the first update
    copies. While the LR warm-up lasts (the first ``round(warmup_epochs * steps_per_epoch)`` optimizer
    steps, the rounding of :func:`~ddp_recipes.optim.schedules.lightning_scheduler`), every update copies, and so
    does the first one after it, as in the reference. Pass the warm-up of the LR schedule; for the
    reference's decay use :func:`adjusted_decay` (counting optimizer steps over the run, not batches per epoch,
    keeps the rhythm across epochs, accumulation and resumes). Checkpoint callbacks run after it (Lightning orders
    them last), so a checkpoint holds its step's update. The average lives here, not in the LightningModule, so
    DDP neither broadcasts it nor waits for its gradients. :attr:`network` is the averaged network (None before
    the fit, validation or test starts).
    """

    def __init__(self, decay: float = EMAArgs.decay, update_every: int = EMAArgs.update_every,
                 warmup_epochs: float = EMAArgs.warmup_epochs) -> None:
        EMAArgs(decay, update_every, warmup_epochs)  # checks them
        self.decay = float(decay)
        self.update_every = int(update_every)
        self.warmup_epochs = float(warmup_epochs)
        self._ema: nn.Module | None = None
        # Updates since the last copy, a host int: AveragedModel's CPU tensor is copied to the device per update.
        self._count = 0
        self._source: weakref.ref[nn.Module] | None = None  # the network the copy was made from
        self._pending: dict[str, Any] | None = None
        self._warmup_steps = 0
        self._seen_step = 0

    @property
    def network(self) -> nn.Module | None:
        """The averaged network (same class, keys and device as ``pl_module.model``), or None before it exists."""
        return self._ema

    @property
    def n_averaged(self) -> int:
        """Updates averaged since the last copy (0: the next update copies the weights)."""
        return self._count

    # ---- building the copy, once the network sits on its device with its restored weights -------------

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        network_of(pl_module)  # fail before training, on every rank

    def _build(self, pl_module: L.LightningModule) -> None:
        network = network_of(pl_module)
        if self._ema is None or self._source is None or self._source() is not network:
            ema = deepcopy(network).requires_grad_(False).eval()  # only ever evaluated
            self._ema, self._source, self._count = ema, weakref.ref(network), 0
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._apply(pending)

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # After the checkpoint's weights and the deferred load_state_dict, before the sanity check.
        self._build(pl_module)

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        steps = steps_per_epoch(trainer)
        self._warmup_steps = int(round(self.warmup_epochs * steps)) if self.warmup_epochs > 0 else 0
        self._seen_step = trainer.global_step

    # ---- updating ------------------------------------------------------------------------------------

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        if step == self._seen_step:  # an accumulation batch: no optimizer step
            return
        self._seen_step = step
        if step % self.update_every:
            return
        self.update(pl_module, copy=step <= self._warmup_steps)

    @torch.no_grad()
    def update(self, pl_module: L.LightningModule, copy: bool = False) -> None:
        """One EMA update from ``pl_module.model`` now; ``copy``: a warm-up update (the next one copies)."""
        self._build(pl_module)
        assert self._ema is not None
        network, groups = network_of(pl_module), {}
        # AveragedModel.update_parameters(use_buffers=True)'s arithmetic, torch's EMA per (device, dtype) group;
        # the network's tensors go to the copy's device as there (a no-op where they share one: the usual case, but
        # Lightning's teardown moves the module to the CPU after a fit while the copy stays on the GPU).
        for mine, theirs in zip((*self._ema.parameters(), *self._ema.buffers()),
                                (*network.parameters(), *network.buffers()), strict=True):
            theirs = theirs.detach().to(mine.device)
            if self._count == 0:
                mine.copy_(theirs)
            else:
                group = groups.setdefault((mine.device, mine.dtype), ([], []))
                group[0].append(mine)
                group[1].append(theirs)
        for mine, theirs in groups.values():
            get_ema_multi_avg_fn(self.decay)(mine, theirs, None)
        # The reference's warm-up: keep copying, so the average starts from the warmed-up weights.
        self._count = 0 if copy else self._count + 1

    # ---- rank agreement, where the ranks meet anyway ---------------------------------------------------

    @override
    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._build(pl_module)
        self._sync_buffers(trainer)

    @override
    def on_test_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._build(pl_module)
        self._sync_buffers(trainer)

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._sync_buffers(trainer)

    @torch.no_grad()
    def _sync_buffers(self, trainer: L.Trainer) -> None:
        """Give every rank rank 0's averaged buffers (parameters agree already): one broadcast per dtype."""
        if self._ema is None or trainer.world_size < 2 or not (dist.is_available() and dist.is_initialized()):
            return
        by_dtype: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for buffer in self._ema.buffers():
            by_dtype.setdefault((buffer.device, buffer.dtype), []).append(buffer)
        for buffers in by_dtype.values():
            flat = torch.cat([b.reshape(-1) for b in buffers])
            dist.broadcast(flat, src=0)
            offset = 0
            for b in buffers:
                b.copy_(flat[offset:offset + b.numel()].view_as(b))
                offset += b.numel()

    # ---- checkpoints -----------------------------------------------------------------------------------

    @override
    def state_dict(self) -> dict[str, Any]:
        if self._pending is not None or self._ema is None:
            return dict(self._pending or {})
        return {"network": self._ema.state_dict(), "n_averaged": self._count,
                "decay": self.decay, "update_every": self.update_every}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict:
            # Lightning restores callbacks before the fit starts and the copy exists: applied in _build.
            self._pending = dict(state_dict)

    @torch.no_grad()
    def _apply(self, state: Mapping[str, Any]) -> None:
        assert self._ema is not None
        self._ema.load_state_dict(state["network"])
        self._count = int(state["n_averaged"])


def ema_state_dict(checkpoint: Mapping[str, Any]) -> dict[str, torch.Tensor] | None:
    """The EMA network's weights in a loaded checkpoint (keys of ``pl_module.model.state_dict()``), or None.

    For evaluating the average of a saved run: ``module.model.load_state_dict(ema_state_dict(ckpt))``.
    """
    for key, state in (checkpoint.get("callbacks") or {}).items():
        if (key == ModelEMA.__qualname__ or str(key).startswith(ModelEMA.__qualname__ + "{")) and state:
            network = state.get("network") if isinstance(state, Mapping) else None
            if network is not None:
                return dict(network)
    return None
