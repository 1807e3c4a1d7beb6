"""The open Trainer surface of the recipes: ``main(callbacks=, logger=, trainer_kwargs=)``, ``--trainer KEY=VALUE``,
``--callbacks`` and their ``--config`` keys; refusals in one line; a user's callback across 2 ranks and a resume."""

from __future__ import annotations

import json
import sys

import pytest
import yaml
from lightning.pytorch.callbacks import Callback, EarlyStopping, LearningRateFinder, LearningRateMonitor
from lightning.pytorch.cli import _JSONARGPARSE_SIGNATURES_AVAILABLE
from lightning.pytorch.loggers import CSVLogger

from ddp_recipes.config.cli import parse_config
from ddp_recipes.config.trainer_settings import PACK_OWNED, check_trainer_settings
from recipes import mnist, resnet
from tests.helpers import SHARED_DATA
from tests.launch import run
from tests.marks import needs_mnist

# LightningCLI's own test for its optional dependency (absent on the lent GPU machine's stack).
needs_lightning_cli = pytest.mark.skipif(not _JSONARGPARSE_SIGNATURES_AVAILABLE,
                                         reason="LightningCLI needs jsonargparse[signatures] (the dev extra)")
DATA = ["--data-dir", str(SHARED_DATA), "--no-download", "--accelerator", "cpu"]


class Probe(Callback):
    """What the Trainer was built with, and how often it validated."""

    def __init__(self) -> None:
        self.seen: dict = {}
        self.validations = 0

    def on_fit_start(self, trainer, pl_module) -> None:
        self.seen = {"val_check_interval": trainer.val_check_interval,
                     "limit_val_batches": trainer.limit_val_batches,
                     "log_every_n_steps": trainer.log_every_n_steps,
                     "num_sanity_val_steps": trainer.num_sanity_val_steps,
                     "logger": trainer.logger, "callbacks": [type(c) for c in trainer.callbacks]}

    def on_validation_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            self.validations += 1


def test_text_values_take_the_type_lightning_annotates():
    owned = PACK_OWNED
    got = check_trainer_settings({"limit_val_batches": "1.0", "limit_train_batches": "10", "val_check_interval": "0.25",
                                  "deterministic": "warn", "benchmark": "true", "num_sanity_val_steps": "null",
                                  "max_time": "00:00:10:00", "gradient_clip_algorithm": "norm"}, owned)
    assert got == {"limit_val_batches": 1.0, "limit_train_batches": 10, "val_check_interval": 0.25,
                   "deterministic": "warn", "benchmark": True, "num_sanity_val_steps": None,
                   "max_time": "00:00:10:00", "gradient_clip_algorithm": "norm"}
    # 1.0 (the whole set) and 1 (one batch) mean different things to Lightning: the text decides.
    assert type(got["limit_val_batches"]) is float and type(got["limit_train_batches"]) is int


@needs_mnist
def test_settings_callbacks_and_logger_reach_the_trainer(tmp_path):
    """--trainer and the config's callbacks (class_path/init_args) and main()'s callbacks, logger and
    trainer_kwargs all reach one Trainer; the command line wins over trainer_kwargs; val_check_interval works."""
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({
        "trainer": {"limit_val_batches": 3},
        "callbacks": [{"class_path": "lightning.pytorch.callbacks.LearningRateMonitor",
                       "init_args": {"logging_interval": "step"}},
                      {"class_path": "EarlyStopping",
                       "init_args": {"monitor": "val_acc", "mode": "max", "patience": 9}}],
    }))
    probe, logs = Probe(), tmp_path / "mine"
    out = tmp_path / "out"
    mnist.main([*DATA, "--output-dir", str(out), "--max-steps", "20", "--val-size", "256", "--config", str(config),
                "--trainer", "val_check_interval=10", "--trainer", "limit_val_batches=2", "--log-every-n-steps", "1"],
               callbacks=[probe], logger=CSVLogger(logs, name="run"),
               trainer_kwargs={"num_sanity_val_steps": 0, "limit_val_batches": 7})
    seen = probe.seen
    assert seen["val_check_interval"] == 10 and seen["limit_val_batches"] == 2 and seen["num_sanity_val_steps"] == 0
    assert seen["log_every_n_steps"] == 1  # the recipe's own flag
    # limit_val_batches: --trainer (2) over the config file (3) over trainer_kwargs (7)
    assert probe.validations == 2  # at steps 10 and 20, inside the first epoch
    assert isinstance(seen["logger"], CSVLogger) and seen["logger"].save_dir == str(logs)
    assert {LearningRateMonitor, EarlyStopping, Probe} <= set(seen["callbacks"])
    assert seen["callbacks"].index(Probe) > seen["callbacks"].index(EarlyStopping)  # main()'s after the config's
    metrics = (logs / "run" / "version_0" / "metrics.csv").read_text().splitlines()
    assert "lr-SGD" in metrics[0].split(",") and len(metrics) > 20  # logged every step, by our logger
    assert not (out / "logs").exists(), "the recipe's CSVLogger must be replaced, not added"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["trainer"] == {"limit_val_batches": 2, "val_check_interval": 10}


class CountTests(Callback):
    def __init__(self) -> None:
        self.test_batches = 0

    def on_test_batch_end(self, *args) -> None:
        self.test_batches += 1


def test_resnet_takes_the_same_surface_in_fit_and_test_only(tmp_path):
    tiny = ["--accelerator", "cpu", "--data", "synthetic", "--image-size", "16", "--synthetic-samples", "32",
            "--synthetic-val-samples", "48", "--batch-size", "16", "--output-dir", str(tmp_path / "out")]
    probe, counted = Probe(), CountTests()
    resnet.main([*tiny, "--max-steps", "1", "--trainer", "limit_val_batches=1"], callbacks=[probe, counted],
                logger=False, trainer_kwargs={"num_sanity_val_steps": 0})
    assert probe.seen["limit_val_batches"] == 1 and probe.seen["num_sanity_val_steps"] == 0
    assert probe.seen["logger"] is None and not (tmp_path / "out" / "logs").exists()
    assert counted.test_batches == 3  # 48 images / 16: the whole test set
    again = CountTests()
    resnet.main([*tiny, "--test-only", "--resume", "auto", "--trainer", "limit_test_batches=2"], callbacks=[again])
    assert again.test_batches == 2


def test_print_config_round_trips_trainer_and_callbacks(tmp_path, capsys):
    args = ["--trainer", "val_check_interval=0.5", "--trainer", "limit_val_batches=1.0",
            "--callbacks", "LearningRateMonitor",
            "--callbacks", "{class_path: EarlyStopping, init_args: {monitor: val_acc}}"]
    with pytest.raises(SystemExit):
        mnist.main([*args, "--print-config"])
    printed = capsys.readouterr().out
    (tmp_path / "c.yaml").write_text(printed)
    cfg = parse_config(mnist.MNISTConfig, ["--config", str(tmp_path / "c.yaml")])
    assert cfg.trainer == {"val_check_interval": 0.5, "limit_val_batches": 1.0}
    assert cfg.callbacks == [{"class_path": "LearningRateMonitor", "init_args": {}},
                             {"class_path": "EarlyStopping", "init_args": {"monitor": "val_acc"}}]
    moved = parse_config(mnist.MNISTConfig, ["--config", str(tmp_path / "c.yaml"), "--trainer", "val_check_interval=3",
                                             "--callbacks", "ModelSummary"])
    assert moved.trainer == {"val_check_interval": 3, "limit_val_batches": 1.0}  # the flag moves one key
    assert [c["class_path"] for c in moved.callbacks] == ["LearningRateMonitor", "EarlyStopping", "ModelSummary"]


@pytest.mark.parametrize(
    ("recipe", "args", "kwargs", "expected"),
    [
        (mnist, ["--trainer", "devices=2"], {}, "--trainer devices is the recipe's own setting; use --devices"),
        (mnist, ["--trainer", "max_steps=5"], {}, "use --max-steps"),
        (mnist, ["--trainer", "default_root_dir=x"], {}, "use --output-dir"),
        (mnist, ["--trainer", "callbacks=x"], {}, "use --callbacks"),
        (mnist, ["--trainer", "log_every_n_steps=5"], {}, "use --log-every-n-steps"),
        (mnist, ["--trainer", "logger=false"], {}, "use --logger"),
        (mnist, ["--trainer", "overfit_batches=2"], {}, "overfit_batches is the recipe's own setting; use --trainer "
         "limit_train_batches=N"),
        (resnet, [], {"trainer_kwargs": {"overfit_batches": 0.1}}, "overfit_batches .* resumable loader"),
        (mnist, ["--trainer", "val_chek_interval=2"], {}, "no such argument; did you mean val_check_interval"),
        (mnist, ["--trainer", "limit_val_batches=lots"], {},
         "limit_val_batches='lots': lightning.Trainer takes float | int"),
        (mnist, ["--trainer", "limit_val_batches"], {}, "--trainer takes KEY=VALUE"),
        (mnist, ["--callbacks", "NoSuchCallback"], {}, "--callbacks"),
        (mnist, ["--callbacks", "lightning.pytorch.LightningModule"], {}, "--callbacks .* does not subclass"),
        (mnist, ["--callbacks", "{class_path: EarlyStopping, init_args: {monitr: val_acc}}"], {},
         "--callbacks EarlyStopping: .*monitr"),
        (mnist, ["--callbacks", "{class_path: EarlyStopping, init_args: {monitor: val_acc, mode: up}}"], {},
         "--callbacks EarlyStopping\\(monitor='val_acc', mode='up'\\): "),
        (mnist, [], {"trainer_kwargs": {"strategy": "ddp"}}, "main\\(trainer_kwargs=...\\) strategy .* --comm-hook"),
        (mnist, [], {"callbacks": ["LearningRateMonitor"]},
         "main\\(callbacks=...\\) takes lightning Callback instances"),
        (mnist, ["--callbacks", "BatchSizeFinder"], {},
         "--callbacks BatchSizeFinder changes the batch size .* --batch-size"),
        (resnet, [], {"callbacks": [LearningRateFinder()]}, "main\\(callbacks=...\\) LearningRateFinder changes the "
         "learning rate .* --lr instead"),
        (resnet, ["--trainer", "gradient_clip_val=1"], {}, "use --clip-grad-norm"),
    ],
)
def test_bad_surface_input_fails_in_one_line(tmp_path, capsys, recipe, args, kwargs, expected):
    import re

    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exc:
        recipe.main(["--output-dir", str(out), *args], **kwargs)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(expected, err[0]), err
    assert not out.exists(), "nothing may be written on bad input"


@pytest.mark.parametrize(("text", "expected"), [("trainer: [1]\n", "trainer must be a mapping"),
                                                ("trainer: {precision: 16-mixed}\n", "use --precision"),
                                                ("callbacks: {class_path: X}\n", "callbacks must be a list"),
                                                ("callbacks: [{class_path: X, args: {}}]\n", "unknown key 'args'")])
def test_bad_config_keys_fail_in_one_line(tmp_path, capsys, text, expected):
    (tmp_path / "c.yaml").write_text(text)
    with pytest.raises(SystemExit) as exc:
        mnist.main(["--config", str(tmp_path / "c.yaml"), "--output-dir", str(tmp_path / "out")])
    assert exc.value.code == 2
    assert expected in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # two 2-rank runs
@needs_mnist
def test_user_callback_survives_two_ranks_and_resume_auto(tmp_path):
    """A script's own stateful callback runs on both ranks, is checkpointed, and continues its count after
    --resume auto; trainer_kwargs and --trainer reach every rank's Trainer."""
    out = tmp_path / "out"
    base = ["tests/scenarios/surface_scenario.py", "--devices", "2", *DATA, "--output-dir", str(out),
            "--batch-size", "32", "--val-size", "128", "--checkpoint-every-n-steps", "3", "--log-every-n-steps", "2",
            "--trainer", "enable_progress_bar=false"]
    run([*base, "--max-steps", "6"], env={"SURFACE_RUN": "first"}, check=True)
    run([*base, "--max-steps", "9", "--resume", "auto"], env={"SURFACE_RUN": "resumed"}, check=True)
    for rank in (0, 1):
        first = json.loads((out / f"tally-first-rank{rank}.json").read_text())
        resumed = json.loads((out / f"tally-resumed-rank{rank}.json").read_text())
        assert first == {"batches": 6, "restored": None, "world_size": 2, "global_step": 6,
                         "strategy": "TunedDDPStrategy", "limit_val_batches": 2, "log_every_n_steps": 2,
                         "own_callbacks": 1}
        assert resumed["restored"] == 6 and resumed["batches"] == 9 and resumed["global_step"] == 9


# ---- the pack under a user's own LightningCLI ------------------------------------------------------------


def _cli(args: list[str]):
    from lightning.pytorch.cli import LightningCLI

    return LightningCLI(args=args, run=False, save_config_callback=None)


@needs_lightning_cli
@pytest.mark.parametrize("form", ["flags", "yaml"])
def test_lightning_cli_takes_the_strategy_by_class_path(tmp_path, monkeypatch, form):
    """No import of the pack in the script: the class path names TunedDDPStrategy, init_args reach it (LightningCLI
    spells out every DistributedDataParallel default through **kwargs; the strategy takes them)."""
    from ddp_recipes.ddp.strategy import TunedDDPStrategy

    monkeypatch.setattr(sys, "argv", ["my_cli.py"])  # LightningCLI warns when pytest's own argv is there too
    if form == "flags":
        strategy = ["--trainer.strategy.class_path", "ddp_recipes.TunedDDPStrategy",
                    "--trainer.strategy.init_args.comm_hook", "bf16", "--trainer.strategy.init_args.bucket_cap_mb", "5"]
    else:
        (tmp_path / "trainer.yaml").write_text(yaml.safe_dump({"trainer": {"strategy": {
            "class_path": "ddp_recipes.TunedDDPStrategy", "init_args": {"comm_hook": "bf16", "bucket_cap_mb": 5}}}}))
        strategy = ["--config", str(tmp_path / "trainer.yaml")]
    cli = _cli([*strategy, "--trainer.accelerator", "cpu", "--trainer.devices", "2", "--trainer.logger", "false",
                "--model", "ddp_recipes.MNISTClassifier", "--data", "ddp_recipes.MNISTDataModule"])
    assert type(cli.trainer.strategy) is TunedDDPStrategy
    assert cli.trainer.strategy.comm_hook == "bf16" and cli.trainer.strategy._ddp_kwargs["bucket_cap_mb"] == 5
    assert "gradient_as_bucket_view" not in cli.trainer.strategy._ddp_kwargs  # the pack's per-device choice, kept


@needs_mnist
@needs_lightning_cli
@pytest.mark.slow  # a long multi-process run: make test-slow (keeps make test near 10 min)
def test_lightning_cli_two_ranks_with_the_registry_name(tmp_path):
    """``fit --trainer.strategy tuned_ddp --trainer.devices 2`` with the pack's MNIST module and DataModule named
    on the command line: 2 gloo ranks under TunedDDPStrategy, identical parameters after training."""
    out = tmp_path / "out"
    run(["tests/scenarios/lightning_cli_scenario.py", "fit", "--model", "ddp_recipes.MNISTClassifier",
         "--data", "ddp_recipes.MNISTDataModule", "--data.data_dir", str(SHARED_DATA), "--data.download", "false",
         "--data.batch_size", "32", "--trainer.strategy", "tuned_ddp", "--trainer.devices", "2",
         "--trainer.accelerator", "cpu", "--trainer.max_steps", "8", "--trainer.logger", "false",
         "--trainer.enable_progress_bar", "false", "--trainer.enable_checkpointing", "false",
         "--trainer.enable_model_summary", "false", "--trainer.default_root_dir", str(out), "--seed_everything", "3",
         "--trainer.callbacks+=tests.scenarios.lightning_cli_scenario.SameWeights"], check=True)
    facts = json.loads((out / "ranks.json").read_text())
    assert facts["strategy"] == "TunedDDPStrategy" and facts["world_size"] == 2 and facts["backend"] == "gloo"
    assert facts["global_step"] == 8 and facts["gradient_as_bucket_view"] is False  # its CPU choice
    assert facts["rank_max_abs_diff"] == 0.0 and facts["moved_from_start"] > 0


@needs_mnist
def test_a_users_model_checkpoint_on_the_recipes_metric_runs_beside_best_ckpt(tmp_path):
    """A ModelCheckpoint of the user's own monitoring val_acc (max), as the recipe's best.ckpt does, used to stop
    the run at Trainer construction ("more than one stateful callback of type ModelCheckpoint")."""
    out, mine = tmp_path / "out", tmp_path / "mine"
    spec = f"{{class_path: ModelCheckpoint, init_args: {{monitor: val_acc, mode: max, dirpath: '{mine}'}}}}"
    mnist.main([*DATA, "--output-dir", str(out), "--max-steps", "4", "--val-size", "64", "--callbacks", spec,
                "--trainer", "val_check_interval=2", "--trainer", "num_sanity_val_steps=0",
                "--trainer", "enable_progress_bar=false"], logger=False)
    assert (out / "checkpoints" / "best.ckpt").is_file()
    assert [p.suffix for p in mine.iterdir()] == [".ckpt"]
    import torch

    states = torch.load(out / "checkpoints" / "last.ckpt", weights_only=False)["callbacks"]
    assert sum(key.startswith("ModelCheckpoint{") for key in states) == 1  # the user's, under its own key


def test_best_ckpt_state_saved_under_model_checkpoints_key_still_restores():
    from lightning.pytorch.callbacks import ModelCheckpoint

    from ddp_recipes.train.checkpoints import BestCheckpoint

    best = BestCheckpoint(dirpath="x", filename="best", monitor="val_acc", mode="max")
    assert best.state_key != ModelCheckpoint(monitor="val_acc", mode="max").state_key
    assert best._legacy_state_key == ModelCheckpoint(monitor="val_acc", mode="max").state_key


@needs_mnist
def test_a_users_progress_bar_replaces_the_recipes(tmp_path):
    """Lightning takes one progress bar: a user's (here another refresh rate) used to stop the run at Trainer
    construction ("multiple progress bar callbacks"); it replaces the recipe's."""
    from lightning.pytorch.callbacks import TQDMProgressBar

    probe = Probe()
    mnist.main([*DATA, "--output-dir", str(tmp_path / "out"), "--max-steps", "2", "--callbacks",
                "{class_path: TQDMProgressBar, init_args: {refresh_rate: 1}}"], callbacks=[probe], logger=False)
    bars = [c for c in probe.seen["callbacks"] if issubclass(c, TQDMProgressBar)]
    assert len(bars) == 1
