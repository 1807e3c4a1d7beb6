"""Lightning's precision spellings (``16``, ``"bf16"``, ``32``, ``64``, ``bf16-true``...) mean in a recipe's
``--precision`` and its ``--config`` file what they mean to Lightning and to ``build_trainer``: one table
(``ddp_recipes.config.choices.PRECISION_SPELLINGS``), one resolution (the plan's). A bad value is one line naming
the flag and the values it takes."""

from __future__ import annotations

import warnings
from typing import get_args

import pytest
from lightning.fabric.plugins.precision.precision import (
    _PRECISION_INPUT_INT,
    _PRECISION_INPUT_STR,
    _PRECISION_INPUT_STR_ALIAS,
)

from ddp_recipes import build_trainer
from ddp_recipes.config.choices import LIGHTNING_PRECISIONS, PRECISION_FLAGS
from ddp_recipes.config.cli import parse_config
from ddp_recipes.config.world import lightning_precision
from recipes import mnist
from recipes.config import MNISTConfig, ResNetConfig
from tests.helpers import refusal

LIGHTNINGS = (*get_args(_PRECISION_INPUT_STR), *get_args(_PRECISION_INPUT_INT), *get_args(_PRECISION_INPUT_STR_ALIAS))


@pytest.mark.parametrize("spelling", LIGHTNINGS)
def test_each_of_lightnings_spellings_means_what_it_means_to_lightning(spelling):
    from lightning.fabric.connector import _convert_precision_to_unified_args

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's "16 is supported for historical reasons" advice
        unified = _convert_precision_to_unified_args(spelling)
    assert lightning_precision(spelling) == unified
    assert str(spelling) in LIGHTNING_PRECISIONS


@pytest.mark.parametrize(("spelling", "resolved"), [
    ("32", "32-true"), ("16", "bf16-mixed"), ("bf16", "bf16-mixed"), ("64", "64-true"), ("bf16-true", "bf16-true"),
    ("16-true", "16-true"), ("64-true", "64-true"), ("16-mixed", "bf16-mixed"),  # 16-mixed: bf16 on CPU
])
def test_the_recipe_flag_resolves_as_build_trainer_does(spelling, resolved):
    """The recipe's plan and the Trainer build_trainer makes of the same spelling (its str and, where Lightning
    has one, its int) run the same precision."""
    plan = parse_config(MNISTConfig, ["--precision", spelling, "--accelerator", "cpu"]).plan
    assert plan.precision == resolved
    for given in {spelling, int(spelling) if spelling.isdigit() else spelling}:
        trainer = build_trainer(precision=given, accelerator="cpu", devices=1, logger=False,
                                enable_progress_bar=False, enable_model_summary=False)
        assert trainer.precision == resolved, given


def test_a_config_file_takes_them_and_print_config_reads_back(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text("precision: 16\naccelerator: cpu\n")  # YAML's 16 is an int: Lightning's int spelling
    cfg = parse_config(ResNetConfig, ["--config", str(path)])
    assert cfg.precision == "16" and cfg.plan.precision == "bf16-mixed"
    with pytest.raises(SystemExit) as stopped:
        parse_config(ResNetConfig, ["--config", str(path), "--precision", "bf16", "--print-config"])
    assert stopped.value.code == 0
    printed = capsys.readouterr().out
    assert "precision bf16-mixed" in printed and "\nprecision: bf16\n" in printed
    path.write_text(printed)
    assert parse_config(ResNetConfig, ["--config", str(path)]).plan.precision == "bf16-mixed"


PROG = "python -m recipes.mnist: error: "
ACCEPTED = "32-true, 16-mixed, bf16-mixed, bf16-true, 16-true, 64-true, 32, 16, bf16, 64"


def test_a_bad_precision_is_one_line_naming_the_flag_and_its_values(tmp_path, capsys):
    assert PRECISION_FLAGS == tuple(ACCEPTED.split(", "))
    with pytest.raises(SystemExit) as stopped:
        mnist.main(["--precision", "fp8", "--accelerator", "cpu"])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and "usage:" not in err
    assert err.strip().splitlines() == [f"{PROG}--precision must be one of {ACCEPTED} (got 'fp8')"]
    # transformer-engine is Lightning's (build_trainer passes it on) but not a recipe's: it swaps the model's layers.
    path = tmp_path / "te.yaml"
    path.write_text("precision: transformer-engine\n")
    assert refusal(mnist.main, ["--config", str(path)], capsys, PROG) == \
        f"--precision must be one of {ACCEPTED} (got 'transformer-engine')"


def test_any_flag_with_choices_refuses_in_one_line(capsys):
    with pytest.raises(SystemExit) as stopped:
        mnist.main(["--accelerator", "tpu"])
    err = capsys.readouterr().err
    assert stopped.value.code == 2
    assert err.strip().splitlines() == [f"{PROG}--accelerator must be one of auto, cpu, gpu, cuda (got 'tpu')"]


def test_the_bench_takes_the_same_short_spellings():
    from ddp_recipes.bench.speedup.run import BenchConfig

    assert BenchConfig(precision="bf16", accelerator="cpu").resolve()["precision"] == "bf16-mixed"
    assert BenchConfig(precision="32", accelerator="cpu").resolve()["precision"] == "32-true"
