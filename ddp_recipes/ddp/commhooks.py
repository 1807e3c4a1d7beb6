"""PowerSGD whose state survives a checkpoint: a resumed run compresses as the uninterrupted one would.

:class:`ResumablePowerSGD` saves PowerSGD's per-rank state (error-feedback residuals, warm-start Q matrices,
iteration, RandomState) per parameter, tagged with its bucket layout, because DDP rebuilds its buckets after the
first step: a bucket that arrives with other parameters gets its entry assembled from the per-parameter pieces.
For the first resumed step the saved layout is kept (a copy in and out on that step only): MKL's ``bmm`` gives
other last bits for another 16-byte offset, so a step compressed in place would drift 1e-8 from the
uninterrupted run (docs/resume-and-preemption.md).
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
            layout = self._layout_of(bucket)
            target = self._prepare(bucket.index(), layout, bucket.buffer())
            if target == layout:
                return powerSGD_hook.powerSGD_hook(state, bucket)
            return self._run_staged(state, bucket, layout, target)

        return hook

    def _layout_of(self, bucket: Any) -> Layout:
        return tuple((self._names.get(id(p), f"#{i}"), tuple(g.shape))
                     for i, (p, g) in enumerate(zip(bucket.parameters(), bucket.gradients(), strict=True)))

    def _prepare(self, index: int, layout: Layout, buffer: torch.Tensor) -> Layout:
        """Put ``index``'s state in the layout torch's hook is to run on, and return that layout: the stored
        one when the bucket holds the same tensors in another order on a compressing step (see the module
        docstring), else the bucket's own."""
        home, target = self.layouts.get(index), layout
        if (home is not None and home != layout and sorted(home) == sorted(layout)
                and self.state.iter >= self.state.start_powerSGD_iter):
            target = home
        if (home != target or any(name in self._pool for name, _ in target)) and (self._pool or self.layouts):
            self._relayout(index, target, buffer)
        self.layouts[index] = target
        self._owner.update((name, index) for name, _ in target)
        return target

    @staticmethod
    def _run_staged(state: powerSGD_hook.PowerSGDState, bucket: Any, layout: Layout,
                    target: Layout) -> torch.futures.Future:
        """torch's hook on a copy of ``bucket`` laid out as ``target``; the result goes back into the bucket."""
        buffer = bucket.buffer()
        where, offset = {}, 0
        for name, shape in layout:
            where[name] = offset
            offset += _numel(shape)
        staged = torch.empty_like(buffer, memory_format=torch.contiguous_format)  # a fresh, aligned allocation
        moves, views, offset = [], [], 0
        for name, shape in target:
            size = _numel(shape)
            moves.append((where[name], offset, size))
            staged[offset:offset + size].copy_(buffer[where[name]:where[name] + size])
            views.append(staged[offset:offset + size].view(shape))
            offset += size

        def unstage(fut: torch.futures.Future) -> torch.Tensor:
            result = fut.value()
            for src, dst, size in moves:
                buffer[src:src + size].copy_(result[dst:dst + size])
            return buffer

        return powerSGD_hook.powerSGD_hook(state, _StagedBucket(bucket, staged, views)).then(unstage)

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
        # The layout each bucket's entries were computed in: the resumed run's first step uses it.
        out["layouts"] = {int(i): [[n, list(shape)] for n, shape in layout] for i, layout in self.layouts.items()}
        return out

    def load_state_dict(self, saved: dict[str, Any], device: torch.device) -> None:
        s = self.state
        s.error_dict, s.q_memory_dict, s.p_memory_dict = {}, {}, {}
        # A checkpoint without layouts: the first resumed step runs in DDP's
        # initial layout (equal to the last bits only where the BLAS does not depend on alignment).
        self.layouts = {int(i): tuple((n, tuple(shape)) for n, shape in layout)
                        for i, layout in saved.get("layouts", {}).items()}
        self._pool = {n: {k: t.to(device) for k, t in p.items()} for n, p in saved["pieces"].items()}
        self._owner = dict.fromkeys(self._pool, "pool")
        for n in _COUNTERS:
            setattr(s, n, int(saved[n]))
        name, keys, pos, has_gauss, gauss = saved["rng"]
        s.rng.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))


class _StagedBucket:
    """What torch's PowerSGD hook reads from a ``GradBucket``, over a staged copy of its buffer."""

    def __init__(self, bucket: Any, buffer: torch.Tensor, gradients: list[torch.Tensor]) -> None:
        self._bucket, self._buffer, self._gradients = bucket, buffer, gradients

    def index(self) -> int:
        return self._bucket.index()

    def is_last(self) -> bool:
        return self._bucket.is_last()

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        return self._gradients
