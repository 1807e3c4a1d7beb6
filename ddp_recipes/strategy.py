"""TunedDDPStrategy: Lightning's DDPStrategy with the write-up's lessons built in, on CPU as on CUDA.

A drop-in subclass: every DDPStrategy argument, registry name style, checkpoint and launch mode works
unchanged. What it changes or adds, each for a reason:

* ``gradient_as_bucket_view=True`` (DDP's default is False): gradients live in the all-reduce buckets,
  saving one copy of all gradients in memory and a memcpy per step.
* ``comm_hook="fp16"|"bf16"|"powersgd"``: gradient compression registered on *every* device type.
  Lightning registers hooks only on CUDA and silently drops them elsewhere; "fp16 gradients halve the
  all-reduce traffic" is only true when such a hook runs.
* ``seed=S``: once the process group is up, rank r seeds random/numpy/torch with S + r so dropout,
  augmentation and noise differ per rank (``seed_everything`` gives every rank the same stream), while the
  model built before ``fit`` (and DDP's broadcast from rank 0) keeps the initial weights identical.
  ``PL_GLOBAL_SEED`` is left alone on purpose: Lightning seeds the DistributedSampler from it, and a
  per-rank value there would break the disjointness of the shards.
* SyncBatchNorm on CPU (gloo) too: ``Trainer(sync_batchnorm=True)`` gets :class:`SyncBatchNormPlugin`.
* NCCL settings from arguments, exported before the process group starts, never over a user's value.
* The "Expected to have finished reduction" error names the parameters without gradients and the flag.
"""

from __future__ import annotations

import logging
import os
import random
import re
from datetime import timedelta
from typing import Any

import numpy as np
import torch
from lightning.pytorch.overrides.distributed import _register_ddp_comm_hook
from lightning.pytorch.plugins.layer_sync import LayerSync, TorchSyncBatchNorm
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from ddp_recipes.syncbn import SyncBatchNormPlugin

log = logging.getLogger(__name__)

COMM_HOOKS = ("none", "fp16", "bf16", "powersgd")
UNUSED_PARAMETERS_PATTERN = "Expected to have finished reduction in the prior iteration"


def seed_rank(seed: int, rank: int) -> int:
    """Seed python, numpy and torch (all devices) with ``seed + rank``; returns that value."""
    value = (seed + rank) % 2**32
    random.seed(value)
    np.random.seed(value)
    torch.manual_seed(value)  # also seeds every CUDA device
    return value


class TunedDDPStrategy(DDPStrategy):
    """Lightning's DDPStrategy, tuned; see the module docstring for every changed default and why."""

    strategy_name = "tuned_ddp"

    def __init__(
        self,
        *args: Any,
        find_unused_parameters: bool = False,
        static_graph: bool = False,
        gradient_as_bucket_view: bool = True,
        bucket_cap_mb: float | None = None,
        comm_hook: str = "none",
        powersgd_rank: int = 1,
        powersgd_start_iter: int = 10,
        seed: int | None = None,
        timeout: timedelta | float | None = None,
        nccl_debug: str | None = None,
        nccl_socket_ifname: str | None = None,
        nccl_p2p_disable: bool | None = None,
        **kwargs: Any,
    ) -> None:
        if comm_hook not in COMM_HOOKS:
            raise ValueError(f"--comm-hook must be one of {', '.join(COMM_HOOKS)} (got {comm_hook!r})")
        if comm_hook != "none" and kwargs.get("ddp_comm_hook") is not None:
            raise ValueError("pass either comm_hook (--comm-hook) or ddp_comm_hook, not both")
        if powersgd_start_iter < 2:
            # DDP rebuilds its buckets after the first iteration; PowerSGD's error feedback needs them stable.
            raise ValueError(f"powersgd_start_iter must be >= 2 (got {powersgd_start_iter})")
        if isinstance(timeout, int | float):
            timeout = timedelta(seconds=timeout)
        if timeout is not None:
            kwargs["timeout"] = timeout
        ddp_kwargs: dict[str, Any] = dict(find_unused_parameters=find_unused_parameters, static_graph=static_graph,
                                          gradient_as_bucket_view=gradient_as_bucket_view)
        if bucket_cap_mb is not None:
            ddp_kwargs["bucket_cap_mb"] = bucket_cap_mb
        self._sync_bn: LayerSync | None = None  # before super(): its __init__ may assign _layer_sync
        super().__init__(*args, **ddp_kwargs, **kwargs)
        self.comm_hook = comm_hook
        self._powersgd = (powersgd_rank, powersgd_start_iter)
        self.seed = seed
        nccl = (("NCCL_DEBUG", nccl_debug), ("NCCL_SOCKET_IFNAME", nccl_socket_ifname),
                ("NCCL_P2P_DISABLE", nccl_p2p_disable))
        self._nccl = {key: value for key, value in nccl if value is not None}

    # ---- SyncBatchNorm: Lightning hands us its CUDA-only plugin; swap in the CPU-capable one --------

    @property
    def _layer_sync(self) -> LayerSync | None:
        plugin = self._sync_bn
        if isinstance(plugin, SyncBatchNormPlugin) and self.parallel_devices:
            plugin.device_type = self.root_device.type
        return plugin

    @_layer_sync.setter
    def _layer_sync(self, plugin: LayerSync | None) -> None:
        # Only Lightning's stock plugin is replaced; a user's own LayerSync is kept as given.
        if type(plugin) is TorchSyncBatchNorm:
            plugin = SyncBatchNormPlugin()
        self._sync_bn = plugin

    # ---- process group: NCCL environment first, per-rank seeds after -------------------------------

    @override
    def setup_environment(self) -> None:
        applied = apply_env_defaults(self._nccl)
        if applied:
            log.info("NCCL settings exported: %s", applied)
        super().setup_environment()

    @override
    def setup_distributed(self) -> None:
        super().setup_distributed()
        if self.seed is not None:
            seed_rank(self.seed, self.global_rank)

    # ---- comm hooks on every device type ------------------------------------------------------------

    def _resolve_comm_hook(self) -> tuple[Any, Any]:
        if self.comm_hook == "fp16":
            return None, default_hooks.fp16_compress_hook
        if self.comm_hook == "bf16":
            return None, default_hooks.bf16_compress_hook
        if self.comm_hook == "powersgd":
            rank, start = self._powersgd
            state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=rank,
                                                start_powerSGD_iter=start)
            return state, powerSGD_hook.powerSGD_hook
        return self._ddp_comm_state, self._ddp_comm_hook

    @override
    def _register_ddp_hooks(self) -> None:
        assert isinstance(self.model, DistributedDataParallel)
        state, hook = self._resolve_comm_hook()
        if hook is None and self._ddp_comm_wrapper is None:
            return
        _register_ddp_comm_hook(model=self.model, ddp_comm_state=state, ddp_comm_hook=hook,
                                ddp_comm_wrapper=self._ddp_comm_wrapper)
        rank_zero_info(f"DDP comm hook registered on {self.root_device.type}: {getattr(hook, '__name__', hook)}")

    # ---- errors that say what to do -----------------------------------------------------------------

    @override
    def on_exception(self, exception: BaseException) -> None:
        if UNUSED_PARAMETERS_PATTERN in str(exception):
            names = self.unused_parameter_names(str(exception))
            listed = ", ".join(names) if names else "(names unknown: set TORCH_DISTRIBUTED_DEBUG=DETAIL)"
            exception.args = (
                f"DDP: these parameters received no gradient in the last step: {listed}. Use them in the loss, "
                "freeze them (requires_grad=False), or pass --find-unused-parameters "
                "(find_unused_parameters=True; costs one extra autograd-graph traversal per step).\n\n"
                f"{exception.args[0] if exception.args else ''}",
                *exception.args[1:],
            )
            return
        super().on_exception(exception)

    def unused_parameter_names(self, message: str = "") -> list[str]:
        """Names of the parameters DDP reports without gradient (from its message, else grad is None)."""
        module = self.lightning_module
        if module is None:
            return []
        params = ddp_parameter_order(module, getattr(self.model, "parameters_to_ignore", ()))
        match = re.search(r"did not receive grad for rank \d+:\s*([\d\s]+)", message)
        if match:
            indices = [int(i) for i in match.group(1).split()]
            return [params[i][0] for i in indices if i < len(params)]
        return [name for name, p in params if p.grad is None]

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, fup in (("tuned_ddp", False), ("tuned_ddp_find_unused_parameters_true", True)):
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=f"TunedDDPStrategy, find_unused_parameters={fup}",
                                           find_unused_parameters=fup)


def ddp_parameter_order(module: nn.Module, ignore: Any = ()) -> list[tuple[str, nn.Parameter]]:
    """The parameters in the order DDP's reducer indexes them (its ``_build_params_for_reducer``)."""
    seen: set[int] = set()
    ordered = []
    for module_name, sub in module.named_modules():
        for param_name, param in sub.named_parameters(recurse=False):
            full = f"{module_name}.{param_name}" if module_name else param_name
            if not param.requires_grad or full in ignore or id(param) in seen:
                continue
            seen.add(id(param))
            ordered.append((full, param))
    return ordered


def apply_env_defaults(values: dict[str, Any]) -> dict[str, str]:
    """Export each variable unless the user already set it; returns what was exported."""
    applied = {}
    for key, value in values.items():
        text = str(int(value)) if isinstance(value, bool) else str(value)
        if key not in os.environ:
            os.environ[key] = text
            applied[key] = text
    return applied
