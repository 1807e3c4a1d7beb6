"""Lightning's own idioms after ``fit`` on a ``build_trainer`` Trainer, for tests/train/test_lightning_idioms.py.

    python tests/scenarios/lightning_idioms_scenario.py OUT MODE EPOCHS      (2 CPU ranks through build_trainer)
    python tests/scenarios/lightning_idioms_scenario.py cli OUT -- ARGS...   (LightningCLI, as Lightning's examples)

MODE ``default``: the user's EarlyStopping only (so Lightning's default ModelCheckpoint is expected); ``monitor``:
the user's own ``ModelCheckpoint(monitor="valid_loss", save_top_k=2)`` beside it; ``plain``: no callback of the
user's, continued with ``fit(ckpt_path="last")`` (the same command starts and continues the run). Every mode then
runs what Lightning's examples run after fit: ``validate``/``test``/``predict`` with ``ckpt_path="best"`` and
``"last"``, ``trainer.checkpoint_callback``'s best model, ``trainer.save_checkpoint``. Rank 0 writes
``OUT/facts-EPOCHS.json`` (:func:`facts`, which a test also calls on a plain ``lightning.Trainer``).

``cli``: ``LightningCLI(BoringModel, BoringData, run=False)`` then ``fit``, ``test(ckpt_path="best")`` and
``predict(ckpt_path="best")`` without a model, as ``examples/pytorch/basics/backbone_image_classifier.py`` does,
with ``trainer_class=build_trainer`` when ``DDP_RECIPES_CLI_TRAINER=build_trainer``; the script imports
``ddp_recipes.ddp.strategy`` so that ``--trainer.strategy tuned_ddp`` is known.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

BATCHES = 3  # limit_train_batches: 3 steps per epoch at any world size, so file names match a 1-device run


class Numbers(Dataset):
    def __init__(self, n: int = 32) -> None:
        self.x = torch.randn(n, 8, generator=torch.Generator().manual_seed(n))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.x[i]


class BoringModel(L.LightningModule):
    """Lightning's bug-report model, with a metric that never improves (EarlyStopping stops after 2 epochs)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 2)

    def training_step(self, batch, batch_idx):
        return self.layer(batch).pow(2).mean()

    def validation_step(self, batch, batch_idx):
        self.log("valid_loss", self.layer(batch).pow(2).mean(), sync_dist=True)
        self.log("val_const", 1.0, sync_dist=True)

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self.layer(batch).pow(2).mean(), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self.layer(batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class BoringData(L.LightningDataModule):
    def train_dataloader(self):
        return DataLoader(Numbers(), batch_size=2)

    def val_dataloader(self):
        return DataLoader(Numbers(16), batch_size=2)

    def test_dataloader(self):
        return DataLoader(Numbers(16), batch_size=2)

    def predict_dataloader(self):
        return DataLoader(Numbers(16), batch_size=2)


def user_callbacks(mode: str, out: Path) -> list[Any]:
    stop = EarlyStopping(monitor="val_const", mode="min", patience=1)
    if mode == "monitor":
        return [ModelCheckpoint(dirpath=out / "mine", monitor="valid_loss", mode="min", save_top_k=2), stop]
    return [stop] if mode == "default" else []


TRAINER = {"limit_train_batches": BATCHES, "limit_val_batches": 2, "limit_test_batches": 2,
           "limit_predict_batches": 2, "num_sanity_val_steps": 0, "logger": False, "enable_progress_bar": False,
           "enable_model_summary": False}


def _rel(path: Any, out: Path) -> Any:
    return os.path.relpath(path, out) if path else path


def facts(trainer: L.Trainer, model: L.LightningModule, out: Path) -> dict[str, Any]:
    """What a script reads after fit: the checkpoint callback's best model, and the checkpoint that
    validate/test/predict load for "best" and "last" (and whether its weights are what the model then holds)."""
    callback = trainer.checkpoint_callback
    found: dict[str, Any] = {
        "callback": type(callback).__name__ if not isinstance(callback, ModelCheckpoint) else "ModelCheckpoint",
        "state_keys": sorted(c.state_key for c in trainer.callbacks if isinstance(c, ModelCheckpoint)),
        "model_checkpoints": sum(isinstance(c, ModelCheckpoint) for c in trainer.callbacks),
        "best_model_path": _rel(callback.best_model_path, out),
        "best_model_score": None if callback.best_model_score is None else float(callback.best_model_score),
        "best_k_models": {_rel(k, out): float(v) for k, v in callback.best_k_models.items()},
        "current_epoch": trainer.current_epoch, "global_step": trainer.global_step,
        "stopped_epoch": next((c.stopped_epoch for c in trainer.callbacks if isinstance(c, EarlyStopping)), None),
    }
    loader = DataLoader(Numbers(16), batch_size=2)
    for fn in ("validate", "test", "predict"):
        for ckpt in ("best", "last"):
            getattr(trainer, fn)(model, loader, ckpt_path=ckpt, **({} if fn == "predict" else {"verbose": False}))
            loaded = trainer.ckpt_path
            same = None
            if loaded:
                saved = torch.load(loaded, map_location="cpu", weights_only=False)["state_dict"]
                same = all(torch.equal(saved[k], v.cpu()) for k, v in model.state_dict().items())
            found[f"{fn}:{ckpt}"] = {"path": _rel(loaded, out), "weights_loaded": same}
    trainer.save_checkpoint(out / "saved.ckpt")
    found["saved"] = (out / "saved.ckpt").is_file()
    return found


def main(out: Path, mode: str, epochs: int) -> None:
    import ddp_recipes

    trainer = ddp_recipes.build_trainer(devices=2, accelerator="cpu", seed=0, max_epochs=epochs,
                                        default_root_dir=str(out), callbacks=user_callbacks(mode, out), **TRAINER)
    model = BoringModel()
    data = BoringData()
    trainer.fit(model, data.train_dataloader(), data.val_dataloader(), ckpt_path="last")
    seen = facts(trainer, model, out)
    if trainer.is_global_zero:
        seen["folder"] = sorted(p.name for p in (out / "checkpoints").iterdir())
        (out / f"facts-{epochs}.json").write_text(json.dumps(seen))


def cli(out: Path, args: list[str]) -> None:
    from lightning.pytorch.cli import LightningCLI

    import ddp_recipes.ddp.strategy  # noqa: F401  (registers tuned_ddp for --trainer.strategy)

    kwargs: dict[str, Any] = {}
    if os.environ.get("DDP_RECIPES_CLI_TRAINER") == "build_trainer":
        from ddp_recipes import build_trainer

        kwargs["trainer_class"] = build_trainer
    run = LightningCLI(BoringModel, BoringData, seed_everything_default=1234, run=False, args=args,
                       save_config_kwargs={"overwrite": True}, **kwargs)
    trainer = run.trainer
    trainer.fit(run.model, datamodule=run.datamodule)
    tested = trainer.test(ckpt_path="best", datamodule=run.datamodule, verbose=False)
    predicted = trainer.predict(ckpt_path="best", datamodule=run.datamodule)
    if trainer.is_global_zero:
        callback = trainer.checkpoint_callback
        (out / "cli.json").write_text(json.dumps({
            "trainer": type(trainer).__name__, "strategy": type(trainer.strategy).__name__,
            "callbacks": [type(c).__name__ for c in trainer.callbacks], "best_model_path": callback.best_model_path,
            "tested_from": trainer.ckpt_path, "test_loss": tested[0]["test_loss"], "predicted": len(predicted)}))


if __name__ == "__main__":
    if sys.argv[1] == "cli":
        cli(Path(sys.argv[2]), sys.argv[4:])
    else:
        main(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]))
