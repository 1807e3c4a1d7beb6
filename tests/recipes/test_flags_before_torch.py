"""Both recipes answer ``--help`` and every error in the flags alone before torch, torchvision and Lightning are
imported (a fraction of a second instead of several): each case runs the recipe as ``python -m`` does, in a fresh
process, and looks at what that process imported by the time it exits. No timings: what is imported is the cause."""

from __future__ import annotations

import importlib
import re

import pytest

from tests.launch import run

# Runs the module named by its first argument as ``python -m`` would, with the rest as its argv; prints, last, the
# exit code and the heavy packages loaded by then.
PROBE = """
import runpy, sys
name, sys.argv = sys.argv[1], [sys.argv[1], *sys.argv[2:]]
code = 0
try:
    runpy.run_module(name, run_name="__main__", alter_sys=True)
except SystemExit as stop:
    code = 0 if stop.code is None else stop.code
loaded = [m for m in ("torch", "lightning", "torchvision") if m in sys.modules]
print("PROBE", code, ",".join(loaded) or "-", flush=True)
"""
HEAVY = ("torch", "lightning")
RECIPES = ("recipes.mnist", "recipes.resnet")

# (argv, the flag the error names): errors of the run's flags, which both recipes share.
SHARED_ERRORS = [
    (["--max_step", "3"], "--max-steps"),  # unknown, with a close match
    (["--batch-size", "0"], "--batch-size"),
    (["--max-steps", "0"], "--max-steps"),
    (["--precision", "8-true"], "--precision"),  # not one of the choices
    (["--global-batch-size", "100", "--devices", "3"], "--global-batch-size"),  # not divisible by the world
    (["--trainer", "max_epochs=3"], "--max-epochs"),  # a Trainer setting the recipe owns
]
RECIPE_ERRORS = {
    "recipes.mnist": [(["--val-size", "-1"], "--val-size")],
    "recipes.resnet": [
        (["--lr-gamma", "2", "--lr-scheduler", "steplr"], "--lr-gamma"),
        (["--random-erase", "2"], "--random-erase"),
        (["--model-ema-decay", "0.5"], "--model-ema-decay"),  # without --model-ema
        (["--unfreeze-at-epoch", "2"], "--unfreeze-at-epoch"),  # without --freeze-backbone
        # a thaw the run never reaches: checked against the plan's epochs, before torchvision
        (["--freeze-backbone", "--unfreeze-at-epoch", "5", "--max-epochs", "3"], "--unfreeze-at-epoch"),
    ],
}
CASES = [(name, argv, flag) for name in RECIPES for argv, flag in [*SHARED_ERRORS, *RECIPE_ERRORS[name]]]
CASE_IDS = [f"{name.split('.')[-1]}:{' '.join(argv)}" for name, argv, _ in CASES]


def probe(name: str, argv: list[str]) -> tuple[int, list[str], str, str]:
    """Run recipe ``name`` with ``argv``: its exit code, the heavy packages it imported, its stdout and stderr."""
    done = run(["-c", PROBE, name, *argv], timeout=120)
    assert done.returncode == 0, f"the probe itself failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    lines = done.stdout.rstrip("\n").splitlines()
    assert lines and lines[-1].startswith("PROBE "), f"no probe report:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    _, code, loaded = lines[-1].split(" ")
    return int(code), [m for m in loaded.split(",") if m != "-"], "\n".join(lines[:-1]), done.stderr


@pytest.mark.parametrize("name", RECIPES)
def test_help_before_torch(name):
    code, loaded, out, err = probe(name, ["--help"])
    assert code == 0, err[-2000:]
    assert f"usage: python -m {name}" in out and "--print-config" in out
    assert not set(HEAVY) & set(loaded), f"--help imported {loaded}"
    # Each example command of the docstring on a line of its own, as written, not run into one paragraph.
    doc = importlib.import_module(name).__doc__
    examples = [line for line in doc.splitlines() if line.lstrip().startswith(("python -m", "torchrun"))]
    assert examples and all(line in out.splitlines() for line in examples), out[:3000]
    # A flag's default said once: never "(default: None)", never twice in one flag's help.
    blocks = re.split(r"\n  (?=-)", out.partition("options:")[2])
    assert "(default: None)" not in out
    twice = [b.split()[0] for b in blocks if b.count("(default:") + b.count("; default ") > 1]
    assert not twice, f"these flags state their default twice: {twice}"


@pytest.mark.parametrize(("name", "argv", "flag"), CASES, ids=CASE_IDS)
def test_flag_errors_before_torch(name, argv, flag):
    # --accelerator cpu: no CUDA question, which is asked (importing torch) only once every flag has passed.
    code, loaded, _, err = probe(name, [*argv, "--accelerator", "cpu"])
    errors = [line for line in err.splitlines() if line.startswith(f"python -m {name}: error: ")]
    assert code == 2 and len(errors) == 1, err[-2000:]
    assert errors[0] == err.rstrip("\n").splitlines()[-1] and flag in errors[0], err[-2000:]
    assert not set(HEAVY) & set(loaded), f"{' '.join(argv)} imported {loaded} before its error: {errors[0]}"


def test_a_bad_choice_is_named_before_the_rules_that_depend_on_it():
    """A value outside a field's choices (from --config or Python, where argparse did not see it) is the error,
    not a rule of the recipe's that reads the field (``--momentum has no effect without --optimizer sgd``)."""
    from ddp_recipes.errors import ConfigError
    from recipes.config import ResNetConfig

    for kwargs, flag in (({"optimizer": "SGD", "momentum": 0.95}, "optimizer"),
                         ({"lr_scheduler": "StepLR", "lr_step_size": 10}, "lr_scheduler"),
                         ({"auto_augment": "RA", "ra_magnitude": 5}, "auto_augment")):
        with pytest.raises(ConfigError, match=flag + " must be one of"):
            ResNetConfig(accelerator="cpu", **kwargs)
