"""Which checkpoints a recipe run writes: ``last.ckpt`` and ``best.ckpt`` (which one ``--resume`` opens:
:mod:`~ddp_recipes.checkpointing.run_folder.resume`); and the ModelCheckpoint that ``build_trainer``
adds where Lightning adds its default one."""

from __future__ import annotations

import warnings
from typing import Any

from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from typing_extensions import override

from ddp_recipes.checkpointing.checkpoint import CHECKPOINT_DIR
from ddp_recipes.checkpointing.last import LastCheckpoint
from ddp_recipes.config.run_config import RunConfig
from ddp_recipes.storage import location


class RunFolderCheckpoint(ModelCheckpoint):
    """A ModelCheckpoint of the pack's in the run's own checkpoint folder."""

    @override
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        # The folder is this run's own (a new run into another run's is refused), so Lightning's "Checkpoint
        # directory ... exists and is not empty" would only greet every resumed run.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")
            super().setup(trainer, pl_module, stage)


class BestCheckpoint(RunFolderCheckpoint):
    """The recipe's ``best.ckpt``: a ModelCheckpoint under a state key of its own (led by this class's name), so
    a user's ModelCheckpoint on the same metric (``--callbacks ModelCheckpoint`` with ``monitor: val_acc``)
    runs beside it: Lightning refuses two stateful callbacks with one key. A checkpoint that holds best.ckpt's
    state under ModelCheckpoint's own key restores it too (``_legacy_state_key``)."""

    pack_owned = True  # its name in the recipe's folder is the recipe's (a user's ModelCheckpoint may not take it)

    @property
    def _legacy_state_key(self) -> str:  # type: ignore[override]
        # Lightning looks a callback's state up by state_key, then by this: best.ckpt's state kept under
        # ModelCheckpoint's own key restores too.
        return super().state_key.replace(type(self).__qualname__, ModelCheckpoint.__qualname__, 1)

    @override
    def _save_topk_checkpoint(self, trainer: Any, monitor_candidates: dict[str, Any]) -> None:
        if self.monitor not in monitor_candidates:
            return  # no validation has run yet (a run stopped by --max-steps before it): nothing to rank
        super()._save_topk_checkpoint(trainer, monitor_candidates)


class DefaultCheckpoint(RunFolderCheckpoint):
    """Lightning's default ``ModelCheckpoint()`` (no monitor, ``save_top_k=1``), which ``build_trainer`` adds where
    Lightning would (:func:`~ddp_recipes.train.trainer.trainer_for`), in ``last.ckpt``'s folder. Its state goes
    under ModelCheckpoint's own key: a checkpoint holds what a plain Trainer's default would, and restores
    into one."""

    @property
    def state_key(self) -> str:
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
