"""Run config (generated CLI, batch arithmetic, validation) and LR rules, on known cases."""

from __future__ import annotations

import math

import pytest
import torch

from ddp_recipes.config.cli import build_parser, parse_config
from ddp_recipes.config.plan import scale_lr
from ddp_recipes.config.run_config import RunConfig
from ddp_recipes.errors import ConfigError
from ddp_recipes.optim.schedules import warmup_cosine, warmup_cosine_factor
from tests.helpers import cli_text, raises_cli


def test_cli_is_generated_from_the_dataclass():
    flags = {a.option_strings[0] for a in build_parser(RunConfig)._actions if a.option_strings}
    for flag in ("--devices", "--num-nodes", "--max-steps", "--global-batch-size", "--accumulate-grad-batches",
                 "--lr-scaling", "--warmup-epochs", "--sync-batchnorm", "--find-unused-parameters", "--comm-hook"):
        assert flag in flags
    cfg = parse_config(RunConfig, ["--devices", "2", "--sync-batchnorm", "--comm-hook", "bf16"])
    assert cfg.devices == 2 and cfg.sync_batchnorm and cfg.comm_hook == "bf16"


@pytest.mark.parametrize(
    ("kwargs", "plan"),
    [
        ({"devices": 2}, (64, 1, 128)),  # recipe default per-device batch
        ({"devices": 2, "batch_size": 32, "accumulate_grad_batches": 2}, (32, 2, 128)),
        ({"devices": 4, "global_batch_size": 256}, (64, 1, 256)),  # per-device derived
        ({"devices": 2, "global_batch_size": 256, "batch_size": 32}, (32, 4, 256)),  # accumulation derived
        ({"devices": 2, "num_nodes": 2, "global_batch_size": 512, "accumulate_grad_batches": 2}, (64, 2, 512)),
    ],
)
def test_batch_plan(kwargs, plan):
    assert RunConfig(**kwargs).plan.batch.astuple() == plan


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"devices": 0}, "--devices"),
        ({"batch_size": 0}, "--batch-size"),
        ({"devices": 2, "global_batch_size": 100, "accumulate_grad_batches": 3}, "--global-batch-size"),
        ({"devices": 2, "global_batch_size": 96, "batch_size": 64}, "--global-batch-size"),
        ({"devices": 2, "global_batch_size": 256, "batch_size": 32, "accumulate_grad_batches": 2},
         "--accumulate-grad-batches"),
        ({"max_steps": 0}, "--max-steps"),
        ({"precision": "fp8"}, "--precision"),
        ({"lr": float("nan")}, "--lr"),
        ({"warmup_epochs": -1}, "--warmup-epochs"),
    ],
)
def test_bad_values_name_the_flag(kwargs, flag):
    with pytest.raises(ConfigError) as err:
        RunConfig(**kwargs)
    assert flag in cli_text(err.value) and "\n" not in str(err.value)


def test_torchrun_environment_sets_the_world(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("WORLD_SIZE", "8")
    cfg = RunConfig()
    assert (cfg.plan.devices, cfg.plan.num_nodes, cfg.plan.world_size) == (2, 4, 8)
    with pytest.raises(ConfigError, match="^devices 3 disagrees with torchrun") as info:
        RunConfig(devices=3)
    # The library names the parameter; only the CLI spells it as a flag.
    assert info.value.param == "devices"
    assert info.value.cli() == "--devices 3 disagrees with torchrun's --nproc-per-node 2; drop --devices under torchrun"


def test_lr_scaling_rules():
    assert scale_lr(0.1, 1024, 256, "linear") == pytest.approx(0.4)
    assert scale_lr(0.1, 1024, 256, "sqrt") == pytest.approx(0.2)
    assert scale_lr(0.1, 1024, 256, "none") == 0.1
    with raises_cli(ValueError, match="--lr-scaling"):
        scale_lr(0.1, 1024, 256, "cubic")


def test_warmup_then_cosine():
    factors = [warmup_cosine_factor(s, warmup_steps=4, total_steps=14) for s in range(15)]
    assert factors[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert factors[4] == pytest.approx(1.0)
    assert factors[9] == pytest.approx(0.5)  # half-way through the cosine
    assert factors[14] == pytest.approx(0.0)
    assert all(a >= b for a, b in zip(factors[4:], factors[5:], strict=False))
    assert warmup_cosine_factor(100, warmup_steps=0, total_steps=0) == 1.0  # nothing to schedule

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.4)
    sched = warmup_cosine(opt, warmup_steps=2, total_steps=6)
    seen = []
    for _ in range(6):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen[:2] == pytest.approx([0.2, 0.4])
    assert seen[4] == pytest.approx(0.4 * 0.5 * (1 + math.cos(math.pi * 0.5)))
