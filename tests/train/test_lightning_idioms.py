"""Lightning's own idioms on a ``build_trainer`` Trainer, as Lightning's ``Trainer`` gives them to a script: the
checkpoint callback's best model, ``ckpt_path="best"``/``"last"`` in validate/test/predict, a user's
ModelCheckpoint and EarlyStopping, ``save_checkpoint``, LightningCLI
(docs/strategy-and-trainer.md#your-own-lightning-script).

Each 2-rank run is compared with a plain ``lightning.Trainer`` run in this process (1 CPU device: with
``limit_train_batches`` the steps, hence the file names, are the same at any world size)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import lightning as L
import pytest
from lightning.pytorch.cli import _JSONARGPARSE_SIGNATURES_AVAILABLE

from tests.launch import run
from tests.scenarios import lightning_idioms_scenario as scenario

SCRIPT = "tests/scenarios/lightning_idioms_scenario.py"
needs_lightning_cli = pytest.mark.skipif(not _JSONARGPARSE_SIGNATURES_AVAILABLE,
                                         reason="LightningCLI needs jsonargparse[signatures] (the dev extra)")


def plain_lightning(out: Path, mode: str, epochs: int) -> dict:
    """The same script on lightning.Trainer (1 CPU device, no strategy of the pack's)."""
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=epochs, default_root_dir=str(out),
                        callbacks=scenario.user_callbacks(mode, out), **scenario.TRAINER)
    model, data = scenario.BoringModel(), scenario.BoringData()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, data.train_dataloader(), data.val_dataloader())
        return scenario.facts(trainer, model, out)


def two_ranks(out: Path, mode: str, epochs: int, **options) -> dict:
    run([SCRIPT, str(out), mode, str(epochs)], check=True, **options)
    return json.loads((out / f"facts-{epochs}.json").read_text())


def test_best_and_last_after_fit_at_two_ranks_as_lightning_gives_them(tmp_path):
    """Lightning's default ModelCheckpoint is there (LastCheckpoint used to replace it: 'LastCheckpoint' object has
    no attribute 'best_model_path' on every rank): "best" is the newest epoch's checkpoint, as in Lightning, in
    the run's checkpoint folder; "last" is the pack's last.ckpt (Lightning, with no save_last, finds none and
    keeps the weights in memory: the same weights). EarlyStopping stops where it does on plain Lightning."""
    pack = two_ranks(tmp_path / "pack", "default", 5)
    plain = plain_lightning(tmp_path / "plain", "default", 5)
    for key in ("callback", "model_checkpoints", "state_keys", "best_model_path", "best_model_score", "best_k_models",
                "current_epoch", "global_step", "stopped_epoch"):
        assert pack[key] == plain[key], key
    assert pack["best_model_path"] == "checkpoints/epoch=1-step=6.ckpt" and pack["stopped_epoch"] == 1
    for fn in ("validate", "test", "predict"):
        assert pack[f"{fn}:best"] == plain[f"{fn}:best"] == {"path": pack["best_model_path"], "weights_loaded": True}
        assert plain[f"{fn}:last"]["path"] is None
        assert pack[f"{fn}:last"] == {"path": "checkpoints/last.ckpt", "weights_loaded": True}
    assert pack["saved"] and pack["folder"] == ["epoch=1-step=6.ckpt", "last.ckpt", "run.json"]


@pytest.mark.slow  # three 2-rank launches: make test-slow
def test_a_users_model_checkpoint_is_the_checkpoint_callback_and_no_default_is_added(tmp_path):
    """The user's ModelCheckpoint(monitor=..., save_top_k=2) with EarlyStopping: theirs is
    trainer.checkpoint_callback, its best and top-k are Lightning's, and no second ModelCheckpoint is added."""
    pack = two_ranks(tmp_path / "pack", "monitor", 5)
    plain = plain_lightning(tmp_path / "plain", "monitor", 5)
    assert pack["model_checkpoints"] == plain["model_checkpoints"] == 1
    assert pack["best_model_path"].startswith("mine/") and len(pack["best_k_models"]) == 2
    assert sorted(pack["best_k_models"]) == sorted(plain["best_k_models"])
    assert pack["stopped_epoch"] == plain["stopped_epoch"] == 1
    assert pack["test:best"] == {"path": pack["best_model_path"], "weights_loaded": True}
    assert pack["folder"] == ["last.ckpt", "run.json"]


@pytest.mark.slow
def test_a_continued_run_keeps_lightnings_checkpoint_state(tmp_path):
    """fit(ckpt_path="last") to 2 epochs, then the same command to 3: the default ModelCheckpoint's state comes
    back (its folder is the run's, not a logger version that changes per launch), so its top-1 file of epoch 1 is
    replaced as in a run never stopped, and "best" is epoch 2's."""
    out = tmp_path / "pack"
    two_ranks(out, "plain", 2)
    done = run([SCRIPT, str(out), "plain", "3"], check=True, quiet=False)
    continued = json.loads((out / "facts-3.json").read_text())
    plain = plain_lightning(tmp_path / "plain", "plain", 3)
    # the state came back whole, in the run's own folder: neither of Lightning's warnings about its folder
    assert "dirpath has changed" not in done.stdout + done.stderr
    assert "exists and is not empty" not in done.stdout + done.stderr
    assert continued["best_model_path"] == plain["best_model_path"] == "checkpoints/epoch=2-step=9.ckpt"
    assert continued["folder"] == ["epoch=2-step=9.ckpt", "last.ckpt", "run.json"]
    assert continued["global_step"] == 9


@needs_lightning_cli
@pytest.mark.slow
@pytest.mark.parametrize("trainer", ["build_trainer", "tuned_ddp"])
def test_lightning_cli_examples_idiom_at_two_ranks(tmp_path, trainer):
    """Lightning's basics examples: LightningCLI(run=False), fit, then test/predict(ckpt_path="best") with no
    model; through LightningCLI(trainer_class=build_trainer), and through plain LightningCLI with
    --trainer.strategy tuned_ddp (the script imports ddp_recipes.ddp.strategy)."""
    out = tmp_path / "out"
    args = ["--trainer.devices", "2", "--trainer.accelerator", "cpu", "--trainer.max_epochs", "2",
            "--trainer.default_root_dir", str(out), "--trainer.logger", "false",
            *[f"--trainer.{k}={v}" for k, v in scenario.TRAINER.items() if k.startswith("limit_")]]
    env = {}
    if trainer == "build_trainer":
        env["DDP_RECIPES_CLI_TRAINER"] = "build_trainer"
    else:
        args += ["--trainer.strategy", "tuned_ddp"]
    out.mkdir()
    done = run([SCRIPT, "cli", str(out), "--", *args], env=env, check=True, quiet=False)
    facts = json.loads((out / "cli.json").read_text())
    assert facts["strategy"] == "TunedDDPStrategy"
    assert facts["best_model_path"].endswith("epoch=1-step=6.ckpt") and facts["tested_from"] == facts["best_model_path"]
    assert facts["predicted"] > 0
    assert "multiple `ModelCheckpoint`" not in done.stdout + done.stderr
    if trainer == "build_trainer":
        assert "LastCheckpoint" in facts["callbacks"] and (out / "checkpoints" / "last.ckpt").is_file()


def test_the_checkpoint_callbacks_build_trainer_adds(tmp_path):
    """Lightning's rule: its default ModelCheckpoint when the script gives no checkpoint callback, first among the
    checkpoint callbacks (trainer.checkpoint_callback), in last.ckpt's folder; none beside a user's own."""
    from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint

    from ddp_recipes import LastCheckpoint, build_trainer

    def checkpoints(**kwargs):
        trainer = build_trainer(devices=1, accelerator="cpu", default_root_dir=str(tmp_path), logger=False, **kwargs)
        return trainer, [type(c).__name__ for c in trainer.checkpoint_callbacks]

    trainer, names = checkpoints()
    assert names == ["DefaultCheckpoint", "LastCheckpoint"] and isinstance(trainer.checkpoint_callback, ModelCheckpoint)
    assert trainer.checkpoint_callback.dirpath == str(tmp_path / "checkpoints")
    assert trainer.checkpoint_callback.state_key == ModelCheckpoint().state_key  # Lightning's default's key
    mine = ModelCheckpoint(monitor="valid_loss")
    trainer, names = checkpoints(callbacks=[LastCheckpoint(tmp_path / "ck"), mine])  # theirs first, Last after
    assert names == ["ModelCheckpoint", "LastCheckpoint"] and trainer.checkpoint_callback is mine
    assert checkpoints(callbacks=OnExceptionCheckpoint(str(tmp_path)))[1] == ["OnExceptionCheckpoint", "LastCheckpoint"]
    assert checkpoints(preemption=False)[1] == ["ModelCheckpoint"]  # Lightning's own
    assert checkpoints(enable_checkpointing=False)[1] == []


def test_lightning_defaults_passed_explicitly_mean_what_leaving_them_out_means():
    """LightningCLI(trainer_class=build_trainer) passes strategy="auto" and profiler=None on every run: they used
    to replace TunedDDPStrategy with Lightning's DDPStrategy and drop the input-wait profiler."""
    from ddp_recipes import TunedDDPStrategy, build_trainer
    from ddp_recipes.train.perf import InputWaitProfiler

    trainer = build_trainer(devices=2, accelerator="cpu", strategy="auto", profiler=None, logger=False)
    assert type(trainer.strategy) is TunedDDPStrategy and isinstance(trainer.profiler, InputWaitProfiler)
    given = build_trainer(devices=2, accelerator="cpu", strategy="ddp", logger=False)
    assert type(given.strategy).__name__ == "DDPStrategy"  # a strategy named is used as given
