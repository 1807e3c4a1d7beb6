"""PowerSGD whose state survives a checkpoint: a resumed run compresses as the uninterrupted one would.

PowerSGD keeps per-rank state between steps: the error-feedback residual of every bucket (what
compression dropped, added back next step), the warm-start Q matrices, its iteration counter and the
RandomState its Q initialisation draws from. A run resumed without them restarts PowerSGD's warm-up and
loses the residuals. :class:`ResumablePowerSGD` turns that state into plain tensors and lists (one entry
per rank; the strategy gathers them to rank 0) and loads it back.

torch keys that state by DDP bucket index, and a bucket's flat buffer holds its gradients in bucket
order. A new process's first step runs on DDP's *initial* bucket layout (reverse parameter order); DDP
then rebuilds the buckets in the order gradients became ready, which the saved state was laid out in. So
each entry is tagged with its layout (parameter names and shapes); when a bucket arrives with another
layout, every entry is cut into per-parameter pieces and reassembled for the layout that arrived. The
compression itself is per tensor, so the numbers are the same whichever bucket a tensor sits in.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

_COUNTERS = ("iter", "total_numel_before_compression", "total_numel_after_compression")
Layout = tuple[tuple[str, tuple[int, ...]], ...]  # (parameter name, shape) in bucket order


class ResumablePowerSGD:
    """A PowerSGD state and hook pair with :meth:`state_dict` / :meth:`load_state_dict`."""

    def __init__(self, matrix_approximation_rank: int, start_powerSGD_iter: int) -> None:
        self.state = powerSGD_hook.PowerSGDState(process_group=None,
                                                 matrix_approximation_rank=matrix_approximation_rank,
                                                 start_powerSGD_iter=start_powerSGD_iter)
        self.layouts: dict[int, Layout] = {}  # the layout each index's stored entries are in
        self._names: dict[int, str] = {}  # id(parameter) -> name
        self._pieces: dict[str, dict[str, torch.Tensor]] = {}  # per parameter, between two layouts
        self._loaded: dict[str, Any] | None = None  # what load_state_dict got, until every bucket took it
        self.hook = self._make_hook()

    def set_module(self, module: nn.Module) -> None:
        """The module DDP wraps: parameter names make a layout comparable across processes."""
        self._names = {id(p): name for name, p in module.named_parameters()}

    # ---- the hook --------------------------------------------------------------------------------------

    def _make_hook(self):
        @functools.wraps(powerSGD_hook.powerSGD_hook)
        def hook(state: powerSGD_hook.PowerSGDState, bucket: Any) -> torch.futures.Future:
            index = bucket.index()
            layout = tuple((self._names.get(id(p), f"#{i}"), tuple(g.shape))
                           for i, (p, g) in enumerate(zip(bucket.parameters(), bucket.gradients(), strict=True)))
            if index in state.error_dict and self.layouts.get(index) != layout:
                self._cut_all()
            if index not in state.error_dict and self._pieces:
                self._assemble(index, layout, bucket.buffer())
            self.layouts[index] = layout
            return powerSGD_hook.powerSGD_hook(state, bucket)

        return hook

    def _packing(self, layout: Layout) -> list[tuple[str, int, int]]:
        """(name, n*r, m*r) of the tensors PowerSGD compresses, in the order it packs their P and Q."""
        groups: dict[tuple[int, int], list[tuple[str, int, int]]] = {}
        for name, shape in layout:
            if not shape:
                continue
            n = shape[0]
            m = int(np.prod(shape[1:])) if len(shape) > 1 else 1
            r = min(n, m, self.state.matrix_approximation_rank)
            if powerSGD_hook._should_compress(n, m, r, self.state.min_compression_rate)[0]:
                groups.setdefault((n, m), []).append((name, n * r, m * r))
        return [entry for entries in groups.values() for entry in entries]

    def _cut_all(self) -> None:
        s = self.state
        for index, layout in self.layouts.items():
            if index not in s.error_dict:
                continue
            error, offset = s.error_dict.pop(index), 0
            for name, shape in layout:
                numel = int(np.prod(shape)) if shape else 1
                self._pieces.setdefault(name, {})["error"] = error[offset:offset + numel]
                offset += numel
            q, offset = s.q_memory_dict.pop(index, None), 0
            s.p_memory_dict.pop(index, None)
            for name, _, q_len in self._packing(layout) if q is not None else []:
                self._pieces[name]["q"] = q[offset:offset + q_len]
                offset += q_len
        self.layouts.clear()

    def _assemble(self, index: int, layout: Layout, buffer: torch.Tensor) -> None:
        s = self.state
        parts = [self._pieces.get(name, {}).get("error") for name, _ in layout]
        if any(p is None for p in parts):
            return  # a parameter PowerSGD never saw: start this bucket fresh, as torch would
        s.error_dict[index] = torch.cat(parts).to(buffer.device, buffer.dtype)
        packing = self._packing(layout)
        qs = [self._pieces[name].get("q") for name, _, _ in packing]
        if packing and all(q is not None for q in qs):
            s.q_memory_dict[index] = torch.cat(qs).to(buffer.device, buffer.dtype)  # type: ignore[arg-type]
            # P is recomputed from Q before it is read; only its size must match.
            s.p_memory_dict[index] = buffer.new_zeros(sum(p_len for _, p_len, _ in packing))
        for name, _ in layout:
            self._pieces.pop(name, None)
        if not self._pieces:
            self._loaded = None

    # ---- checkpoint ------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """This rank's state, on CPU, as tensors, lists and ints (``weights_only``-loadable)."""
        s = self.state
        if self._pieces and self._loaded is not None:
            return self._loaded  # loaded and not used by a step yet: the same state
        name, keys, pos, has_gauss, gauss = s.rng.get_state()
        out: dict[str, Any] = {n: {int(k): v.detach().cpu().clone() for k, v in getattr(s, n).items()}
                               for n in ("error_dict", "q_memory_dict")}
        out.update({n: int(getattr(s, n)) for n in _COUNTERS})
        out["rng"] = [name, keys.tolist(), int(pos), int(has_gauss), float(gauss)]
        out["layouts"] = {int(k): [[n, list(shape)] for n, shape in v] for k, v in self.layouts.items()}
        return out

    def load_state_dict(self, saved: dict[str, Any], device: torch.device) -> None:
        s = self.state
        s.error_dict = {int(k): v.to(device) for k, v in saved["error_dict"].items()}
        s.q_memory_dict = {int(k): v.to(device) for k, v in saved["q_memory_dict"].items()}
        s.p_memory_dict = {}
        for n in _COUNTERS:
            setattr(s, n, int(saved[n]))
        name, keys, pos, has_gauss, gauss = saved["rng"]
        s.rng.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
        self.layouts = {int(k): tuple((n, tuple(shape)) for n, shape in v) for k, v in saved["layouts"].items()}
        # Every stored entry is cut and reassembled on first use, for whatever layout that step has.
        self._cut_all()
        self._loaded = saved if self._pieces else None
