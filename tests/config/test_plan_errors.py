"""The run resolved once into a frozen plan, DDP options as one object, choice lists defined once, and typed
errors that name parameters (only the CLI spells them as flags)."""

from __future__ import annotations

import dataclasses
import inspect
import pickle
from datetime import timedelta

import pytest
from lightning.pytorch.strategies import DDPStrategy

import ddp_recipes.train.trainer as trainer_module
from ddp_recipes import TunedDDPStrategy, build_trainer
from ddp_recipes.config.choices import ACCELERATORS, COMM_HOOKS, LR_SCALING_RULES, PRECISION_FLAGS, RESNET_DATA
from ddp_recipes.config.cli import build_parser, parse_config
from ddp_recipes.config.plan import BatchPlan, DDPOptions, RunPlan
from ddp_recipes.config.run_config import RunConfig
from ddp_recipes.errors import CheckpointError, ConfigError, DataError, MissingDataError
from ddp_recipes.train.trainer import trainer_for
from recipes.config import ResNetConfig


def test_plan_is_resolved_once_and_frozen(monkeypatch):
    calls = []
    real = RunPlan.resolve

    def counting(**kwargs):
        calls.append(kwargs)
        return real(**kwargs)

    monkeypatch.setattr(RunPlan, "resolve", staticmethod(counting))
    cfg = RunConfig(devices=2, global_batch_size=256, accumulate_grad_batches=2, lr=0.1, lr_reference_batch=64,
                    comm_hook="bf16", num_workers=3)
    for _ in range(3):  # every derived value is read from the one plan
        assert (cfg.plan.world_size, cfg.plan.batch.per_device, cfg.plan.accumulation, cfg.plan.batch.global_batch) == \
            (2, 64, 2, 256)
        assert cfg.plan.lr == pytest.approx(0.4)  # linear: 0.1 x 256 / 64
    assert len(calls) == 1
    plan = cfg.plan
    assert isinstance(plan, RunPlan) and plan.accelerator == "cpu" and plan.num_workers == 3
    assert plan.batch == BatchPlan(64, 2, 256) and plan.ddp.comm_hook == "bf16"
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.devices = 4  # type: ignore[misc]
    assert "_plan" not in cfg.to_dict()  # summary.json's config stays the flags


def test_recipe_worker_default_lives_in_the_plan():
    assert ResNetConfig(data="synthetic").plan.num_workers == 0
    assert ResNetConfig(data="synthetic", num_workers=2).plan.num_workers == 2
    assert RunConfig().plan.num_workers == 0


def test_ddp_options_travel_as_one_object():
    cfg = parse_config(RunConfig, ["--devices", "2", "--comm-hook", "fp16", "--bucket-cap-mb", "10",
                                   "--find-unused-parameters", "--timeout-s", "60"])
    trainer = trainer_for(cfg.plan, logger=False, enable_checkpointing=False)
    strategy = trainer.strategy
    assert isinstance(strategy, TunedDDPStrategy) and strategy.comm_hook == "fp16"
    assert strategy._ddp_kwargs["bucket_cap_mb"] == 10 and strategy._ddp_kwargs["find_unused_parameters"] is True
    assert strategy._timeout == timedelta(seconds=60)
    # The same options as build_trainer's flat keywords or as one DDPOptions in a plan give the same strategy.
    options = DDPOptions(comm_hook="fp16", bucket_cap_mb=10, find_unused_parameters=True, timeout_s=60)
    for other in (trainer_for(RunPlan.resolve(devices=2, accelerator="cpu", ddp=options), logger=False,
                              enable_checkpointing=False).strategy,
                  build_trainer(devices=2, comm_hook="fp16", bucket_cap_mb=10, find_unused_parameters=True,
                                timeout_s=60, logger=False, enable_checkpointing=False).strategy):
        assert (other.comm_hook, other._ddp_kwargs, other._timeout) == \
            (strategy.comm_hook, strategy._ddp_kwargs, strategy._timeout)
    direct = TunedDDPStrategy.from_options(options, seed=3)
    assert isinstance(direct, DDPStrategy) and direct.seed == 3 and direct._ddp_kwargs["bucket_cap_mb"] == 10


def test_build_trainer_has_one_way_in():
    """build_trainer takes the flat keywords only; a resolved plan goes to trainer_for, which it ends in."""
    params = inspect.signature(build_trainer).parameters
    assert "plan" not in params and "ddp" not in params
    assert "_RUN_DEFAULTS" not in vars(trainer_module)
    with pytest.raises(ConfigError) as info:
        DDPOptions(comm_hook="int8")
    assert info.value.param == "comm_hook" and info.value.cli().startswith("--comm-hook must be one of none,")


@pytest.mark.parametrize("field, choices", [("precision", PRECISION_FLAGS), ("comm_hook", COMM_HOOKS),
                                            ("lr_scaling", LR_SCALING_RULES), ("accelerator", ACCELERATORS)])
def test_each_choice_list_is_defined_once(field, choices):
    """The CLI's choices and the config's validation are the Literal of ddp_recipes.config.choices."""
    action = next(a for a in build_parser(RunConfig)._actions if a.dest == field)
    assert tuple(action.choices) == choices
    with pytest.raises(ConfigError) as info:
        RunConfig(**{field: "nope"})
    assert info.value.param == field and ", ".join(choices) in str(info.value)


def test_recipe_choice_lists_come_from_the_same_place():
    action = next(a for a in build_parser(ResNetConfig)._actions if a.dest == "data")
    assert tuple(action.choices) == RESNET_DATA
    with pytest.raises(ConfigError, match="^data must be one of synthetic, cifar10, imagefolder"):
        ResNetConfig(data="imagenet")  # type: ignore[arg-type]


def test_errors_name_parameters_and_the_cli_spells_flags():
    err = ConfigError("{global_batch_size} 100 is not divisible by 3; change {accumulate_grad_batches}")
    assert err.param == "global_batch_size"
    assert str(err) == "global_batch_size 100 is not divisible by 3; change accumulate_grad_batches"
    assert err.cli() == "--global-batch-size 100 is not divisible by 3; change --accumulate-grad-batches"
    # Values interpolated into a message are never taken for parameters.
    odd = DataError("{data_dir} /x/{train,val}/{a b} missing")
    assert odd.cli() == "--data-dir /x/{train,val}/{a b} missing"
    # Kept across processes (spawned ranks, loader workers), with its type and parameter.
    for error in (err, odd, CheckpointError("{resume} x: bad"), MissingDataError("{data_dir} y", "data_dir")):
        back = pickle.loads(pickle.dumps(error))
        assert type(back) is type(error) and back.param == error.param and back.cli() == error.cli()
    assert isinstance(MissingDataError("x"), FileNotFoundError)  # an `except FileNotFoundError` catches it
    assert issubclass(CheckpointError, ConfigError) and issubclass(DataError, ConfigError)


def test_library_error_names_the_keyword(capsys):
    with pytest.raises(ConfigError) as info:
        build_trainer(devices=0)
    assert str(info.value) == "devices must be >= 1 (got 0)"
    with pytest.raises(SystemExit) as exit_info:
        parse_config(RunConfig, ["--devices", "0"], prog="prog")
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == "prog: error: --devices must be >= 1 (got 0)"


def test_plan_refuses_stray_keywords():
    cfg = RunConfig(batch_size=8)
    # The plan decides the limits and the precision: a stray keyword is refused, never silently preferred.
    with pytest.raises(TypeError, match="max_steps"):
        trainer_for(cfg.plan, max_steps=3, logger=False)
    with pytest.raises(TypeError, match="precision"):
        trainer_for(cfg.plan, precision="bf16-mixed", logger=False)
    # Options at their default leave the knob to the keyword; two different values are refused.
    assert TunedDDPStrategy.from_options(DDPOptions(), comm_hook="fp16").comm_hook == "fp16"
    with pytest.raises(ConfigError, match="comm_hook is set twice with different values"):
        TunedDDPStrategy.from_options(DDPOptions(comm_hook="bf16"), comm_hook="fp16")
