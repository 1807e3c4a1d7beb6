"""Re-wrap a running model in DDP after its set of trainable parameters changed (unfreezing mid-run).

DDP fixes the parameters it all-reduces when it wraps the model: only those with ``requires_grad`` at that
moment get a slot in its gradient buckets and an autograd hook. A parameter unfrozen later computes a
gradient on each rank that no all-reduce ever averages, so the ranks drift apart silently (Lightning's
``BaseFinetuning`` callback has exactly this problem under DDP). :func:`rewrap_ddp` builds a new
``DistributedDataParallel`` around the same module, with the strategy's own arguments and comm hook, and
retires the old one's hooks: from the next step the unfrozen parameters are bucketed like the others, and
a run resumed after the switch (wrapped once, with every parameter trainable) buckets them identically.
"""

from __future__ import annotations

from typing import Any

from torch.nn.parallel import DistributedDataParallel

from ddp_recipes.lightning_seam.reach import rewrap_module


def rewrap_ddp(strategy: Any) -> bool:
    """Wrap ``strategy.lightning_module`` in a fresh DDP (a no-op without one). Collective: every rank calls
    it at the same point (an epoch start), as DDP's constructor broadcasts rank 0's parameters and buffers.

    Layers the strategy's ``LayerSync`` plugin converts (``--sync-batchnorm``) and that have just become
    trainable are converted now; already converted ones are kept, frozen ones stay plain BatchNorm.
    Returns whether a new DDP was built.
    """
    old = getattr(strategy, "model", None)
    if not isinstance(old, DistributedDataParallel):
        return False
    module = old.module
    # The old reducer's autograd hooks would otherwise still fire in backward and all-reduce its buckets a
    # second time; its gradient views point into buckets about to be dropped.
    old._remove_autograd_hooks()
    for handle in getattr(old, "_accum_grad_hooks", []):
        handle.remove()
    for p in module.parameters():
        p.grad = None  # zeroed before the next step anyway (no accumulation window spans an epoch start)
    rewrap_module(strategy, module)
    return True
