"""PowerSGD whose state survives a checkpoint: a resumed run compresses as the uninterrupted one would.

PowerSGD keeps per-rank state between steps: the error-feedback residual of every bucket (what
compression dropped, added back next step), the warm-start Q matrices, its iteration counter and the
RandomState its Q initialisation draws from. A run resumed without them restarts PowerSGD's warm-up and
loses the residuals. :class:`ResumablePowerSGD` turns that state into plain tensors and lists (one entry
per rank, gathered to rank 0 by the caller) and loads it back.

Its keys are DDP bucket indices. DDP rebuilds its buckets once after the first iteration (by the order
gradients became ready), so the first step of a resumed process runs on the initial layout. Where that
layout differs from the saved one for a bucket, the saved entry for it is dropped (with one warning)
rather than added to the wrong gradients.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

_DICTS = ("error_dict", "p_memory_dict", "q_memory_dict")
_COUNTERS = ("iter", "total_numel_before_compression", "total_numel_after_compression")


class ResumablePowerSGD:
    """A PowerSGD state and hook pair with :meth:`state_dict` / :meth:`load_state_dict`."""

    def __init__(self, matrix_approximation_rank: int, start_powerSGD_iter: int) -> None:
        self.state = powerSGD_hook.PowerSGDState(process_group=None,
                                                 matrix_approximation_rank=matrix_approximation_rank,
                                                 start_powerSGD_iter=start_powerSGD_iter)
        self.layouts: dict[int, tuple[int, ...]] = {}  # bucket index -> numel of each gradient in it
        self._expected: dict[int, tuple[int, ...]] = {}
        self.hook = self._make_hook()

    def _make_hook(self):
        @functools.wraps(powerSGD_hook.powerSGD_hook)
        def hook(state: powerSGD_hook.PowerSGDState, bucket: Any) -> torch.futures.Future:
            index = bucket.index()
            layout = tuple(g.numel() for g in bucket.gradients())
            expected = self._expected.pop(index, None)
            if expected is not None and expected != layout:
                for name in _DICTS:
                    getattr(state, name).pop(index, None)
                rank_zero_warn(f"PowerSGD: bucket {index} has another layout than in the checkpoint (DDP has not "
                               "rebuilt its buckets yet in this process); its error feedback starts from zero")
            self.layouts[index] = layout
            return powerSGD_hook.powerSGD_hook(state, bucket)

        return hook

    def state_dict(self) -> dict[str, Any]:
        """This rank's state, on CPU, as tensors, lists and ints (``weights_only``-loadable)."""
        s = self.state
        name, keys, pos, has_gauss, gauss = s.rng.get_state()
        out: dict[str, Any] = {n: {int(k): v.detach().cpu().clone() for k, v in getattr(s, n).items()}
                               for n in _DICTS}
        out.update({n: int(getattr(s, n)) for n in _COUNTERS})
        out["rng"] = [name, keys.tolist(), int(pos), int(has_gauss), float(gauss)]
        out["layouts"] = {int(k): list(v) for k, v in self.layouts.items()}
        return out

    def load_state_dict(self, saved: dict[str, Any], device: torch.device) -> None:
        s = self.state
        for n in _DICTS:
            setattr(s, n, {int(k): v.to(device) for k, v in saved[n].items()})
        for n in _COUNTERS:
            setattr(s, n, int(saved[n]))
        name, keys, pos, has_gauss, gauss = saved["rng"]
        s.rng.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
        self._expected = {int(k): tuple(v) for k, v in saved["layouts"].items()}
