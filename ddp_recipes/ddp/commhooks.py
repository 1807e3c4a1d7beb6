"""PowerSGD whose state survives a checkpoint: a resumed run compresses as the uninterrupted one would.

PowerSGD keeps per-rank state between steps: the error-feedback residual of every bucket (what
compression dropped, added back next step), the warm-start Q matrices, its iteration counter and the
RandomState its Q initialisation draws from. A run resumed without them restarts PowerSGD's warm-up and
loses the residuals. :class:`ResumablePowerSGD` saves that state per parameter (one entry per rank; the
strategy gathers them to rank 0) and loads it back.

Why per parameter: torch keys the state by DDP bucket index, and a bucket's flat buffer holds its
gradients in bucket order. A new process's first step runs on DDP's *initial* bucket layout (reverse
parameter order); DDP then rebuilds the buckets in the order gradients became ready. So every stored entry
is tagged with its layout (parameter names and shapes), and a bucket that arrives with another layout gets
its entry assembled from the per-parameter pieces of whatever entries hold them. The compression itself
is per tensor, so the numbers do not depend on which bucket a tensor sits in.
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


def _numel(shape: tuple[int, ...]) -> int:
    return int(np.prod(shape)) if shape else 1


class ResumablePowerSGD:
    """A PowerSGD state and hook pair with :meth:`state_dict` / :meth:`load_state_dict`."""

    def __init__(self, matrix_approximation_rank: int, start_powerSGD_iter: int) -> None:
        self.state = powerSGD_hook.PowerSGDState(process_group=None,
                                                 matrix_approximation_rank=matrix_approximation_rank,
                                                 start_powerSGD_iter=start_powerSGD_iter)
        self.layouts: dict[int, Layout] = {}  # the layout each index's stored entries are in
        # Pieces whose bucket entry was replaced before another bucket took them (and a loaded state).
        self._pool: dict[str, dict[str, torch.Tensor]] = {}
        # Where each parameter's latest pieces live: a bucket index, or "pool". A piece copied into a new
        # entry stays in its old one too until that is replaced; only the owner's copy is current.
        self._owner: dict[str, int | str] = {}
        self._names: dict[int, str] = {}  # id(parameter) -> name
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
            if self.layouts.get(index) != layout and (self._pool or self.layouts):
                self._relayout(index, layout, bucket.buffer())
            self.layouts[index] = layout
            self._owner.update((name, index) for name, _ in layout)
            return powerSGD_hook.powerSGD_hook(state, bucket)

        return hook

    def _packing(self, layout: Layout) -> list[tuple[str, int, int]]:
        """(name, n*r, m*r) of the tensors PowerSGD compresses, in the order it packs their P and Q."""
        groups: dict[tuple[int, int], list[tuple[str, int, int]]] = {}
        for name, shape in layout:
            if not shape:
                continue
            n, m = shape[0], _numel(shape[1:]) if len(shape) > 1 else 1
            r = min(n, m, self.state.matrix_approximation_rank)
            if powerSGD_hook._should_compress(n, m, r, self.state.min_compression_rate)[0]:
                groups.setdefault((n, m), []).append((name, n * r, m * r))
        return [entry for entries in groups.values() for entry in entries]

    def _pieces_of(self, index: int) -> dict[str, dict[str, torch.Tensor]]:
        """Per-parameter views of index's stored entries, for the parameters it owns."""
        s, layout, out = self.state, self.layouts.get(index, ()), {}
        error, offset = s.error_dict.get(index), 0
        for name, shape in layout if error is not None else ():
            out.setdefault(name, {})["error"] = error[offset:offset + _numel(shape)]
            offset += _numel(shape)
        q, offset = s.q_memory_dict.get(index), 0
        for name, _, q_len in self._packing(layout) if q is not None and q.numel() else ():
            out.setdefault(name, {})["q"] = q[offset:offset + q_len]
            offset += q_len
        return {name: piece for name, piece in out.items() if self._owner.get(name) == index}

    def _relayout(self, index: int, layout: Layout, buffer: torch.Tensor) -> None:
        s = self.state
        wanted = {name for name, _ in layout}
        # What index held for parameters that now live elsewhere must outlive its replacement.
        for name, piece in self._pieces_of(index).items():
            if name not in wanted:
                self._pool[name], self._owner[name] = piece, "pool"
        sources = {**{n: p for j in self.layouts if j != index for n, p in self._pieces_of(j).items()},
                   **self._pieces_of(index), **self._pool}
        for name in (s.error_dict, s.q_memory_dict, s.p_memory_dict):
            name.pop(index, None)
        errors = [sources.get(name, {}).get("error") for name, _ in layout]
        if any(e is None for e in errors):
            return  # a parameter PowerSGD has not seen yet: this bucket starts fresh, as torch's would
        s.error_dict[index] = torch.cat(errors).to(buffer.device, buffer.dtype)  # type: ignore[arg-type]
        packing = self._packing(layout)
        qs = [sources.get(name, {}).get("q") for name, _, _ in packing]
        if all(q is not None for q in qs):
            # P is recomputed from Q before it is read: only its size matters. A present entry (even an
            # empty one, for a bucket with nothing to compress) tells torch not to draw a new random Q.
            s.q_memory_dict[index] = (torch.cat(qs) if qs else buffer.new_zeros(0)).to(buffer.device, buffer.dtype)
            s.p_memory_dict[index] = buffer.new_zeros(sum(p_len for _, p_len, _ in packing))
        for name in wanted:
            self._pool.pop(name, None)

    # ---- checkpoint ------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """This rank's state per parameter, on CPU (tensors, lists, ints: ``weights_only``-loadable)."""
        s = self.state
        pieces = {**{n: p for j in self.layouts for n, p in self._pieces_of(j).items()}, **self._pool}
        name, keys, pos, has_gauss, gauss = s.rng.get_state()
        out: dict[str, Any] = {n: int(getattr(s, n)) for n in _COUNTERS}
        out["pieces"] = {n: {k: t.detach().cpu().clone() for k, t in p.items()} for n, p in pieces.items()}
        out["rng"] = [name, keys.tolist(), int(pos), int(has_gauss), float(gauss)]
        return out

    def load_state_dict(self, saved: dict[str, Any], device: torch.device) -> None:
        s = self.state
        s.error_dict, s.q_memory_dict, s.p_memory_dict = {}, {}, {}
        self.layouts = {}
        self._pool = {n: {k: t.to(device) for k, t in p.items()} for n, p in saved["pieces"].items()}
        self._owner = dict.fromkeys(self._pool, "pool")
        for n in _COUNTERS:
            setattr(s, n, int(saved[n]))
        name, keys, pos, has_gauss, gauss = saved["rng"]
        s.rng.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
