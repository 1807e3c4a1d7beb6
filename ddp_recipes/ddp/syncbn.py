"""SyncBatchNorm that works on CPU (gloo) as well as CUDA.

``torch.nn.SyncBatchNorm`` refuses CPU inputs, so ``Trainer(sync_batchnorm=True)`` fails on CPU DDP, which
is where our tests and CI run. :class:`CPUSyncBatchNorm` computes the same thing with plain collectives:
the batch mean and variance over *all* ranks' samples, with gradients that flow through the reduction
(the backward of a SUM all-reduce is a SUM all-reduce of the gradients), so 2 ranks at batch B train
exactly like 1 process at batch 2B.

:class:`SyncBatchNormPlugin` is the Lightning ``LayerSync`` plugin: torch's layer on CUDA, ours elsewhere,
converted before the DDP wrap and reverted on teardown so that checkpoints hold plain BatchNorm.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.plugins.layer_sync import TorchSyncBatchNorm
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from typing_extensions import override


class _AllReduceSum(torch.autograd.Function):
    """A SUM all-reduce whose backward is a SUM all-reduce of the incoming gradients.

    Every rank's loss depends on the global statistics, so the gradient w.r.t. this rank's partial sums
    is the sum over ranks of each rank's upstream gradient. DDP then averages parameter gradients, which
    gives exactly the gradient of the mean loss over the global batch.
    """

    @staticmethod
    def forward(ctx: Any, tensor: Tensor, group: Any) -> Tensor:
        ctx.group = group
        out = tensor.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None


def all_reduce_sum(tensor: Tensor, group: Any = None) -> Tensor:
    """Differentiable SUM all-reduce over ``group`` (the whole world by default)."""
    return _AllReduceSum.apply(tensor, group)


class CPUSyncBatchNorm(_BatchNorm):
    """BatchNorm over the global batch of all ranks, for any device and backend (gloo included).

    Outside training (also with ``track_running_stats=False``, where evaluation normalises with this rank's
    batch statistics, as torch's SyncBatchNorm does), or without an initialised process group of more
    than one rank, it is plain BatchNorm. Statistics are reduced in float32 (two all-reduces: count+sum, then
    the centred sum of squares, which is numerically safer than E[x^2] - E[x]^2).
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, process_group: Any = None, device=None, dtype=None) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        self.process_group = process_group

    @override
    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def _world(self) -> int:
        if not (dist.is_available() and dist.is_initialized()):
            return 1
        return dist.get_world_size(self.process_group)

    @override
    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        momentum = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            # momentum=None means a cumulative moving average, as in torch's BatchNorm.
            momentum = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        use_batch_stats = self.training or not self.track_running_stats
        # Only training synchronises (as torch's SyncBatchNorm): evaluation shards differ in size per rank
        # (ExactDistributedSampler), so a collective there would pair with another rank's next batch.
        if not self.training or self._world() == 1:
            return F.batch_norm(
                input,
                self.running_mean if not self.training or self.track_running_stats else None,
                self.running_var if not self.training or self.track_running_stats else None,
                self.weight, self.bias, use_batch_stats, momentum, self.eps,
            )
        return self._sync_forward(input, momentum)

    def _sync_forward(self, input: Tensor, momentum: float) -> Tensor:
        dims = [0] + list(range(2, input.dim()))
        shape = [1, -1] + [1] * (input.dim() - 2)
        x = input.float()
        local_count = torch.tensor([input.numel() / input.size(1)], dtype=torch.float32, device=input.device)
        first = all_reduce_sum(torch.cat([local_count, x.sum(dims)]), self.process_group)
        count, mean = first[0], first[1:] / first[0]
        centred = x - mean.view(shape)
        var = all_reduce_sum(centred.pow(2).sum(dims), self.process_group) / count
        if count <= 1:
            raise ValueError(f"expected more than 1 value per channel across ranks when training, got {int(count)}")
        if self.track_running_stats:
            with torch.no_grad():
                # Running variance is unbiased, as in torch's BatchNorm.
                unbiased = var * (count / (count - 1))
                self.running_mean.mul_(1 - momentum).add_(mean.to(self.running_mean.dtype), alpha=momentum)
                self.running_var.mul_(1 - momentum).add_(unbiased.to(self.running_var.dtype), alpha=momentum)
        out = centred * torch.rsqrt(var + self.eps).view(shape)
        if self.affine:
            out = out * self.weight.float().view(shape) + self.bias.float().view(shape)
        return out.to(input.dtype)


def _copy_bn_state(src: _BatchNorm, dst: _BatchNorm) -> _BatchNorm:
    if src.affine:
        with torch.no_grad():
            dst.weight = src.weight
            dst.bias = src.bias
    dst.running_mean = src.running_mean
    dst.running_var = src.running_var
    dst.num_batches_tracked = src.num_batches_tracked
    dst.train(src.training)
    if hasattr(src, "qconfig"):
        dst.qconfig = src.qconfig
    return dst


def convert_sync_batchnorm(module: nn.Module, process_group: Any = None,
                           layer_cls: type[_BatchNorm] = CPUSyncBatchNorm) -> nn.Module:
    """Replace every BatchNorm*d in ``module`` with ``layer_cls`` (CPUSyncBatchNorm or nn.SyncBatchNorm).

    Children are replaced in place; the original class is remembered so :func:`revert_sync_batchnorm`
    restores BatchNorm1d/2d/3d exactly (torch's own converter forgets it). A frozen layer
    (:func:`is_frozen_norm`) is left as it is.
    """
    converted = module
    if (isinstance(module, _BatchNorm) and not isinstance(module, CPUSyncBatchNorm | nn.SyncBatchNorm)
            and not is_frozen_norm(module)):
        converted = layer_cls(module.num_features, module.eps, module.momentum, module.affine,
                              module.track_running_stats, process_group)
        _copy_bn_state(module, converted)
        converted._original_cls = type(module)
    for name, child in module.named_children():
        converted.add_module(name, convert_sync_batchnorm(child, process_group, layer_cls))
    return converted


def is_frozen_norm(module: _BatchNorm) -> bool:
    """A BatchNorm layer in eval mode whose parameters are all frozen (a fine-tuned model's frozen backbone).

    It normalises with its running statistics and never updates them, so a synchronised copy would only
    add a layer that never communicates; kept plain, the frozen part stays exactly the pretrained network.
    """
    return not module.training and not any(p.requires_grad for p in module.parameters(recurse=False))


def revert_sync_batchnorm(module: nn.Module) -> nn.Module:
    """Turn CPUSyncBatchNorm and torch SyncBatchNorm layers back into plain BatchNorm layers."""
    converted = module
    if isinstance(module, CPUSyncBatchNorm | nn.SyncBatchNorm):
        cls = getattr(module, "_original_cls", None) or _infer_bn_class(module)
        converted = cls(module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats)
        _copy_bn_state(module, converted)
    for name, child in module.named_children():
        converted.add_module(name, revert_sync_batchnorm(child))
    return converted


def _infer_bn_class(module: nn.Module) -> type[_BatchNorm]:
    # torch's converter forgets the original class; 2d is by far the common case and shares its
    # state-dict keys with 1d/3d, so a checkpoint stays loadable into the user's model either way.
    return nn.BatchNorm2d


class SyncBatchNormPlugin(TorchSyncBatchNorm):
    """Lightning LayerSync: torch's SyncBatchNorm on CUDA, :class:`CPUSyncBatchNorm` on other devices.

    A subclass of Lightning's TorchSyncBatchNorm so that ``Trainer(sync_batchnorm=True, plugins=[...])``
    accepts it.
    """

    def __init__(self, device_type: str = "cpu") -> None:
        # Lightning converts layers *before* moving the model to its device, so the strategy tells us
        # the device type instead of us reading it off the parameters.
        self.device_type = device_type

    @override
    def apply(self, model: nn.Module) -> nn.Module:
        layer_cls = nn.SyncBatchNorm if self.device_type == "cuda" else CPUSyncBatchNorm
        return convert_sync_batchnorm(model, layer_cls=layer_cls)

    @override
    def revert(self, model: nn.Module) -> nn.Module:
        return revert_sync_batchnorm(model)
