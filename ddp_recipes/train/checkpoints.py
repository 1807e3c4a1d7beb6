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


class BestCheckpoint(ModelCheckpoint):
    """The recipe's ``best.ckpt``: a ModelCheckpoint under a state key of its own (led by this class's name), so
    a user's ModelCheckpoint on the same metric (``--callbacks ModelCheckpoint`` with ``monitor: val_acc``)
    runs beside it: Lightning refuses two stateful callbacks with one key. Checkpoints that kept best.ckpt's
    state under ModelCheckpoint's key still restore it."""

    @property
    def _legacy_state_key(self) -> str:  # type: ignore[override]
        # Lightning looks a callback's state up by state_key, then by this: the recipe's checkpoints from
        # before this class kept best.ckpt's state under ModelCheckpoint's own key.
        return super().state_key.replace(type(self).__qualname__, ModelCheckpoint.__qualname__, 1)


def checkpoint_callbacks(cfg: RunConfig, has_val: bool, model_class: type | None = None) -> list[Callback]:
    """``last.ckpt`` at each epoch end, every ``--checkpoint-every-n-steps`` and on preemption; ``best.ckpt``
    by the model class's ``monitor`` (``val_acc``) when there is validation. Both in
    ``<output-dir>/checkpoints``, through the atomic IO."""
    folder = location(cfg.output_dir) / CHECKPOINT_DIR  # a Path, or a Url on an object store
    callbacks: list[Callback] = [LastCheckpoint(folder, every_n_steps=cfg.checkpoint_every_n_steps)]
    if has_val:
        monitor = getattr(model_class, "monitor", "val_acc")
        callbacks.append(BestCheckpoint(dirpath=str(folder), filename="best", monitor=monitor,
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
