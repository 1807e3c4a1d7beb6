"""gpu-check's in-process checks, each run in a fresh process by ``ddp_recipes.bench.gpucheck``.

    python -m ddp_recipes.bench._gpucheck_worker sync-debug --out FILE [--steps 6] [--warmup-steps 3]

``sync-debug``: the pack's training path (``build_trainer``, the recipe's ResNet-50 LightningModule,
bf16-mixed, channels-last, one GPU) with ``torch.cuda.set_sync_debug_mode("warn")`` switched on for the
steady-state steps only (warm-up has one-off syncs: cuDNN set-up, the allocator). Every "synchronizing CUDA
operation" warning is counted with the Python frames that caused it; FILE gets ``{"syncs", "steps",
"sites"}``. bf16, not 16-mixed: a GradScaler reads found-inf on the host each step by design.
"""

from __future__ import annotations

import argparse
import json
import traceback
import warnings
from pathlib import Path
from typing import Any

SYNC_MESSAGE = "synchronizing CUDA operation"


class SyncCounter:
    """Records each sync-debug warning's caller frames while :meth:`active` is set."""

    def __init__(self) -> None:
        self.active = False
        self.sites: list[str] = []

    def showwarning(self, message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ANN001
        if self.active and SYNC_MESSAGE in str(message):
            frames = [f for f in traceback.extract_stack()[:-1] if "warnings.py" not in f.filename][-3:]
            self.sites.append(" <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames)))


def sync_debug(steps: int, warmup: int, batch: int) -> dict[str, Any]:
    import torch
    from lightning.pytorch.callbacks import Callback
    from torch.utils.data import DataLoader

    from ddp_recipes.bench.workers import Workload, build_dataset, build_module
    from ddp_recipes.data.samplers import keep_batch
    from ddp_recipes.train.trainer import build_trainer

    counter = SyncCounter()
    total = warmup + steps

    class Window(Callback):
        # The mode is global (not per thread), and backward's warnings are replayed on this thread.
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if batch_idx == warmup:
                torch.cuda.synchronize()
                counter.active = True
                torch.cuda.set_sync_debug_mode("warn")

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if batch_idx == total - 1:
                torch.cuda.set_sync_debug_mode("default")
                counter.active = False

    w = Workload(recipe="resnet", arch="resnet50", image_size=224, batch_size=batch, steps=steps,
                 warmup_steps=warmup, precision="bf16-mixed", accelerator="cuda", channels_last=1)
    trainer = build_trainer(devices=1, accelerator="cuda", precision="bf16-mixed", seed=0, max_steps=total,
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, num_sanity_val_steps=0, callbacks=[Window()])
    with warnings.catch_warnings():
        warnings.simplefilter("always")  # every occurrence, not once per call site
        warnings.showwarning = counter.showwarning
        trainer.fit(build_module(w), DataLoader(build_dataset(w), batch_size=batch, shuffle=True,
                                                collate_fn=keep_batch))
    torch.cuda.set_sync_debug_mode("default")
    return {"syncs": len(counter.sites), "steps": steps, "sites": sorted(set(counter.sites))[:20],
            "precision": "bf16-mixed", "batch_size": batch}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m ddp_recipes.bench._gpucheck_worker")
    p.add_argument("check", choices=["sync-debug"])
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup-steps", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32)
    args = p.parse_args(argv)
    result = sync_debug(args.steps, args.warmup_steps, args.batch_size)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
