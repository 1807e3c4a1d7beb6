"""Which checkpoints a recipe run writes (``last.ckpt``, ``best.ckpt``) and which one ``--resume`` opens."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from ddp_recipes.checkpointing.checkpoint import (
    CHECKPOINT_DIR,
    check_compatible,
    read_checkpoint,
    resolve_resume,
)
from ddp_recipes.checkpointing.preemption import LastCheckpoint
from ddp_recipes.config.run_config import RunConfig
from ddp_recipes.storage import location


def checkpoint_callbacks(cfg: RunConfig, has_val: bool, model_class: type | None = None) -> list[Callback]:
    """``last.ckpt`` at each epoch end, every ``--checkpoint-every-n-steps`` and on preemption; ``best.ckpt``
    by the model class's ``monitor`` (``val_acc``) when there is validation. Both in
    ``<output-dir>/checkpoints``, through the atomic IO."""
    folder = location(cfg.output_dir) / CHECKPOINT_DIR  # a Path, or a Url on an object store
    callbacks: list[Callback] = [LastCheckpoint(folder, every_n_steps=cfg.checkpoint_every_n_steps)]
    if has_val:
        monitor = getattr(model_class, "monitor", "val_acc")
        callbacks.append(ModelCheckpoint(dirpath=str(folder), filename="best", monitor=monitor,
                                         mode="min" if monitor.endswith("loss") else "max",
                                         save_top_k=1, save_last=False, enable_version_counter=False))
    return callbacks



def open_resume(cfg: RunConfig) -> tuple[str | None, dict[str, Any] | None]:
    """The checkpoint ``--resume`` names and its contents ((None, None): start fresh).

    Every rank resolves and reads the same file; a bad one fails here, before training touches anything.
    """
    resume = resolve_resume(cfg.resume, cfg.output_dir)
    return (resume, read_checkpoint(resume)) if resume else (None, None)



def resume_checkpoint(cfg: RunConfig, expected: dict[str, Any], accepted: dict[str, tuple] | None = None) -> str | None:
    """The checkpoint ``--resume`` names (None: start fresh), checked against this run's model flags."""
    resume, checkpoint = open_resume(cfg)
    if resume:
        check_compatible(checkpoint, resume, expected, accepted)
    return resume
