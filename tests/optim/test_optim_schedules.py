"""The reference's optimizers, weight-decay groups and LR schedules (``--opt``, ``--norm-weight-decay``,
``--bias-weight-decay``, ``--lr-scheduler``, ``--lr-warmup-*``): classes, groups, and LR values per step
against hand-computed numbers and against torch's own per-epoch schedulers chained as the reference does."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.optim.lr_scheduler import (
    ConstantLR,
    CosineAnnealingLR,
    ExponentialLR,
    LambdaLR,
    LinearLR,
    SequentialLR,
    StepLR,
)

from ddp_recipes.config.choices import LR_SCHEDULERS, OPTIMIZERS
from ddp_recipes.config.schedule import ReferenceSchedule
from ddp_recipes.errors import ConfigError, flag
from ddp_recipes.modules.resnet import ResNetClassifier
from ddp_recipes.optim.optimizers import build_optimizer, param_groups
from ddp_recipes.optim.schedules import (
    lightning_reference_scheduler,
    reference_scheduler,
    schedule_length,
    warmup_cosine,
)
from tests.tiny_modules import TinyClassifier, classifier_loader

# ---- optimizers ------------------------------------------------------------------------------------------


def params() -> list[nn.Parameter]:
    return [nn.Parameter(torch.zeros(3))]


@pytest.mark.parametrize(("name", "cls", "expected"), [
    ("sgd", torch.optim.SGD, {"momentum": 0.8, "nesterov": False, "weight_decay": 1e-4}),
    ("sgd_nesterov", torch.optim.SGD, {"momentum": 0.8, "nesterov": True, "weight_decay": 1e-4}),
    ("rmsprop", torch.optim.RMSprop, {"momentum": 0.8, "eps": 0.0316, "alpha": 0.9, "weight_decay": 1e-4}),
    ("adamw", torch.optim.AdamW, {"weight_decay": 1e-4}),  # not AdamW's own 0.01 default
])
def test_optimizer_classes_and_settings(name, cls, expected):
    opt = build_optimizer(name, params(), lr=0.3, momentum=0.8, weight_decay=1e-4)
    assert type(opt) is cls
    assert opt.defaults["lr"] == 0.3
    for key, value in expected.items():
        assert opt.defaults[key] == value, key
    assert "momentum" not in opt.defaults or name != "adamw"
    assert set(OPTIMIZERS) == {"sgd", "sgd_nesterov", "adamw", "rmsprop"}


def test_optimizer_keeps_group_weight_decay():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    opt = build_optimizer("adamw", param_groups(model, 0.05, norm_weight_decay=0.0), lr=1e-3, weight_decay=0.05)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.05, 0.0]


@pytest.mark.parametrize(("kwargs", "param"), [({"name": "adam"}, "optimizer"), ({"lr": 0.0}, "lr"),
                                               ({"momentum": 1.0}, "momentum"),
                                               ({"weight_decay": -1.0}, "weight_decay"),
                                               ({"name": "sgd_nesterov", "momentum": 0.0}, "optimizer")])
def test_optimizer_errors_name_the_parameter(kwargs, param):
    args = {"name": "sgd", "lr": 0.1, "momentum": 0.9, "weight_decay": 0.0, **kwargs}
    with pytest.raises(ConfigError) as err:
        build_optimizer(args.pop("name"), params(), **args)
    assert err.value.param == param
    assert err.value.cli().startswith(flag(param))


# ---- weight-decay groups ---------------------------------------------------------------------------------

class Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)              # weight, bias
        self.bn = nn.BatchNorm2d(4)                 # weight, bias: a norm
        self.ln = nn.LayerNorm(4)                   # weight, bias: a norm
        self.fc = nn.Linear(4, 2)                   # weight, bias
        self.frozen = nn.Linear(2, 2)
        self.frozen.requires_grad_(False)           # never in a group


def names(model: nn.Module, groups: list[dict]) -> list[tuple[list[str], float]]:
    by_id = {id(p): n for n, p in model.named_parameters()}
    return [([by_id[id(p)] for p in g["params"]], g["weight_decay"]) for g in groups]


@pytest.mark.parametrize(("norm", "bias", "expected"), [
    (None, None, [(["conv.weight", "conv.bias", "bn.weight", "bn.bias", "ln.weight", "ln.bias", "fc.weight",
                    "fc.bias"], 0.1)]),
    (0.0, None, [(["conv.weight", "conv.bias", "fc.weight", "fc.bias"], 0.1),
                 (["bn.weight", "bn.bias", "ln.weight", "ln.bias"], 0.0)]),
    (None, 0.0, [(["conv.weight", "bn.weight", "ln.weight", "fc.weight"], 0.1),
                 (["conv.bias", "bn.bias", "ln.bias", "fc.bias"], 0.0)]),
    # The bias rule wins over the norm rule for a norm layer's bias, as in the reference.
    (0.0, 1e-3, [(["conv.weight", "fc.weight"], 0.1), (["bn.weight", "ln.weight"], 0.0),
                 (["conv.bias", "bn.bias", "ln.bias", "fc.bias"], 1e-3)]),
    # Equal norm and bias decays share one group, in parameter order.
    (0.0, 0.0, [(["conv.weight", "fc.weight"], 0.1),
                (["conv.bias", "bn.weight", "bn.bias", "ln.weight", "ln.bias", "fc.bias"], 0.0)]),
])
def test_norm_and_bias_groups(norm, bias, expected):
    model = Mixed()
    assert names(model, param_groups(model, 0.1, norm_weight_decay=norm, bias_weight_decay=bias)) == expected


@pytest.mark.parametrize("kwargs", [{}, {"cifar_stem": True, "dropout": 0.2}])
def test_reproduces_resnet_classifier_groups(kwargs):
    module = ResNetClassifier(arch="resnet18", num_classes=10, weight_decay=5e-4, **kwargs)
    today = module.param_groups()
    new = param_groups(module, 5e-4, norm_weight_decay=0.0, bias_weight_decay=0.0)
    assert [([id(p) for p in g["params"]], g["weight_decay"]) for g in new] == \
        [([id(p) for p in g["params"]], g["weight_decay"]) for g in today]


def test_group_errors_name_the_parameter():
    with pytest.raises(ConfigError) as err:
        param_groups(Mixed(), 0.1, norm_weight_decay=-1.0)
    assert err.value.param == "norm_weight_decay"


# ---- schedules: hand-computed values -----------------------------------------------------------------------

def lrs(steps: int, spe: int, total: int, bases: tuple[float, ...] = (1.0,), **kwargs) -> list[list[float]]:
    """The LR of every group at optimizer steps 0..steps, stepping the scheduler once per step."""
    opt = torch.optim.SGD([{"params": [nn.Parameter(torch.zeros(1))], "lr": b} for b in bases], lr=bases[0])
    sched = reference_scheduler(opt, spe, total, ReferenceSchedule(**kwargs))
    out = []
    for _ in range(steps + 1):
        out.append([g["lr"] for g in opt.param_groups])
        opt.step()
        sched.step()
    return out


def at(values: list[list[float]], steps: list[int], group: int = 0) -> list[float]:
    return [values[s][group] for s in steps]


def test_steplr_changes_at_epoch_boundaries():
    v = lrs(99, 10, 100, lr_scheduler="steplr", lr_step_size=2, lr_gamma=0.1)
    assert at(v, [0, 19, 20, 39, 40, 99]) == pytest.approx([1, 1, 0.1, 0.1, 0.01, 1e-4], rel=1e-12)


def test_exponentiallr_after_linear_warmup():
    v = lrs(45, 10, 100, lr_scheduler="exponentiallr", lr_gamma=0.5, lr_warmup_epochs=2, lr_warmup_method="linear",
            lr_warmup_decay=0.01)
    # Warm-up: 0.01 + 0.99 * step / 20; then 0.5 ** (epochs since the warm-up).
    assert at(v, [0, 10, 19, 20, 29, 30, 45]) == pytest.approx([0.01, 0.505, 0.9505, 1, 1, 0.5, 0.25], rel=1e-12)


def test_constant_warmup_then_steplr():
    v = lrs(20, 10, 100, lr_scheduler="steplr", lr_step_size=1, lr_gamma=0.5, lr_warmup_epochs=1,
            lr_warmup_method="constant", lr_warmup_decay=0.1)
    assert at(v, [0, 9, 10, 19, 20]) == pytest.approx([0.1, 0.1, 1.0, 1.0, 0.5], rel=1e-12)


def test_cosine_floor_is_an_absolute_lr_per_group():
    v = lrs(110, 10, 100, bases=(1.0, 0.5), lr_scheduler="cosineannealinglr", lr_min=0.1, lr_warmup_epochs=1,
            lr_warmup_method="linear", lr_warmup_decay=0.01)
    assert v[5] == pytest.approx([0.505, 0.2525], rel=1e-12)             # warm-up: a factor of each base
    assert v[10] == pytest.approx([1.0, 0.5], rel=1e-12)                 # the peak at the warm-up's end
    assert v[55] == pytest.approx([0.1 + 0.9 * 0.5, 0.1 + 0.4 * 0.5], rel=1e-12)  # halfway down
    assert v[100] == pytest.approx([0.1, 0.1], rel=1e-12)                # lr_min for both groups
    assert v[110] == pytest.approx([0.1, 0.1], rel=1e-12)                # held past the end


def test_fractional_warmup_steplr_still_changes_at_epoch_boundaries():
    # 0.5 epoch of warm-up = 5 steps; the main schedule's epochs are still the run's epochs.
    v = lrs(20, 10, 100, lr_scheduler="steplr", lr_step_size=1, lr_gamma=0.1, lr_warmup_epochs=0.5,
            lr_warmup_decay=0.2)
    assert at(v, [0, 4, 5, 9, 10, 19, 20]) == pytest.approx([0.2, 0.2, 1.0, 1.0, 0.1, 0.1, 0.01], rel=1e-12)


# ---- schedules: torch's per-epoch schedulers, chained as the reference chains them ----------------------------

def reference_epoch_lrs(name: str, epochs: int, warmup: int, method: str, decay: float, step_size: int,
                        gamma: float, lr_min: float) -> list[float]:
    """The LR of each epoch under torch's schedulers stepped once per epoch, warm-up in a SequentialLR."""
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    if name == "steplr":
        main = StepLR(opt, step_size=step_size, gamma=gamma)
    elif name == "exponentiallr":
        main = ExponentialLR(opt, gamma=gamma)
    else:
        main = CosineAnnealingLR(opt, T_max=epochs - warmup, eta_min=lr_min)
    sched = main
    if warmup:
        first = (LinearLR(opt, start_factor=decay, total_iters=warmup) if method == "linear"
                 else ConstantLR(opt, factor=decay, total_iters=warmup))
        sched = SequentialLR(opt, schedulers=[first, main], milestones=[warmup])
    out = []
    for _ in range(epochs):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


@pytest.mark.parametrize("name", LR_SCHEDULERS)
@pytest.mark.parametrize(("warmup", "method"), [(0, "linear"), (3, "linear"), (3, "constant")])
def test_matches_the_reference_at_every_epoch_boundary(name, warmup, method):
    epochs, spe = 12, 5
    settings = {"lr_step_size": 4, "lr_gamma": 0.5, "lr_min": 0.01}
    expected = reference_epoch_lrs(name, epochs, warmup, method, 0.1, settings["lr_step_size"], settings["lr_gamma"],
                                   settings["lr_min"])
    v = lrs(epochs * spe - 1, spe, epochs * spe, lr_scheduler=name, lr_warmup_epochs=warmup,
            lr_warmup_method=method, lr_warmup_decay=0.1, **settings)
    assert [v[e * spe][0] for e in range(epochs)] == pytest.approx(expected, rel=1e-9, abs=1e-12)
    if name != "cosineannealinglr":  # step-wise schedules hold their epoch's value through the epoch
        assert [v[e * spe + spe - 1][0] for e in range(warmup, epochs)] == pytest.approx(expected[warmup:], rel=1e-12)


def test_scheduler_state_resumes_exactly():
    def build():
        opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.4)
        return opt, reference_scheduler(opt, 10, 100, ReferenceSchedule(
            lr_scheduler="cosineannealinglr", lr_min=0.01, lr_warmup_epochs=1.5, lr_warmup_method="linear"))

    opt, sched = build()
    for _ in range(23):
        opt.step()
        sched.step()
    state = sched.state_dict()
    later = []
    for _ in range(5):
        opt.step()
        sched.step()
        later.append(opt.param_groups[0]["lr"])
    opt2, sched2 = build()
    sched2.load_state_dict(state)
    resumed = []
    for _ in range(5):
        opt2.step()
        sched2.step()
        resumed.append(opt2.param_groups[0]["lr"])
    assert resumed == later


# ---- validation -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("kwargs", "param"), [
    ({"lr_scheduler": "onecycle"}, "lr_scheduler"), ({"lr_step_size": 0}, "lr_step_size"),
    ({"lr_step_size": 2.5}, "lr_step_size"), ({"lr_gamma": 0.0}, "lr_gamma"), ({"lr_gamma": 1.5}, "lr_gamma"),
    ({"lr_min": -0.1}, "lr_min"), ({"lr_warmup_epochs": -1}, "lr_warmup_epochs"),
    ({"lr_warmup_method": "cosine"}, "lr_warmup_method"), ({"lr_warmup_decay": 0.0}, "lr_warmup_decay"),
    ({"lr_warmup_decay": 1.5}, "lr_warmup_decay"),
])
def test_schedule_errors_name_the_parameter(kwargs, param):
    with pytest.raises(ConfigError) as err:
        ReferenceSchedule(**kwargs)
    assert err.value.param == param
    assert err.value.cli().startswith(flag(param))


def test_gamma_message():
    with pytest.raises(ConfigError) as err:
        ReferenceSchedule(lr_gamma=2.0)
    assert err.value.cli() == "--lr-gamma must be in (0, 1] (got 2.0)"


def test_schedules_that_cannot_be_sized():
    opt = torch.optim.SGD(params(), lr=0.1)
    with pytest.raises(ConfigError) as err:
        reference_scheduler(opt, 10, 0, ReferenceSchedule(lr_scheduler="cosineannealinglr"))
    assert "--max-epochs" in err.value.cli()
    with pytest.raises(ConfigError) as err:
        reference_scheduler(opt, 0, 100, ReferenceSchedule(lr_scheduler="steplr"))
    assert err.value.param == "lr_scheduler"
    with pytest.raises(ConfigError) as err:
        reference_scheduler(opt, 0, 100, ReferenceSchedule(lr_scheduler="cosineannealinglr", lr_warmup_epochs=1))
    assert err.value.param == "lr_warmup_epochs"


# ---- in a Lightning fit ----------------------------------------------------------------------------------------

class ReferenceRecipe(TinyClassifier):
    def configure_optimizers(self):
        opt = build_optimizer("sgd", param_groups(self, 1e-4, norm_weight_decay=0.0), lr=self.hparams.lr)
        return {"optimizer": opt, "lr_scheduler": lightning_reference_scheduler(
            opt, self.trainer, ReferenceSchedule(lr_scheduler="exponentiallr", lr_gamma=0.5, lr_warmup_epochs=1,
                                                 lr_warmup_method="linear", lr_warmup_decay=0.25))}


class StepLRs(Callback):
    def __init__(self) -> None:
        self.lrs: list[float] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.lrs.append(optimizer.param_groups[0]["lr"])


def test_lightning_fit_steps_per_optimizer_step():
    record = StepLRs()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=3, accumulate_grad_batches=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[record])
    torch.manual_seed(0)
    # 16 samples / batch 4 = 4 batches, accumulated in pairs: 2 optimizer steps per epoch.
    trainer.fit(ReferenceRecipe(lr=0.2), classifier_loader(16, 4))
    factors = [0.25, 0.625, 1.0, 1.0, 0.5, 0.5]
    assert record.lrs == pytest.approx([0.2 * f for f in factors], rel=1e-12)
    assert math.isclose(trainer.lr_scheduler_configs[0].scheduler.optimizer.param_groups[1]["weight_decay"], 0.0)
    assert trainer.lr_scheduler_configs[0].interval == "step"


def test_schedule_args_refuse_what_the_chosen_schedule_does_not_read():
    from ddp_recipes.config.schedule import ScheduleArgs

    assert ScheduleArgs().decays_cosine and ScheduleArgs().reference is None
    steps = ScheduleArgs(lr_scheduler="steplr", lr_step_size=5)
    assert not steps.decays_cosine and steps.reference.lr_step_size == 5
    cases = [(dict(lr_gamma=0.5), "{lr_gamma} has no effect without {lr_scheduler}; add it or drop {lr_gamma}"),
             (dict(lr_scheduler="exponentiallr", lr_step_size=3), "{lr_step_size} has no effect without "
              "{lr_scheduler} steplr"),
             (dict(lr_scheduler="steplr", lr_warmup_decay=0.5), "{lr_warmup_decay} has no effect without "
              "{lr_scheduler} and {lr_warmup_epochs} > 0"),
             (dict(cosine=True, lr_scheduler="steplr"), "{cosine} and {lr_scheduler} are two schedules; give one"),
             (dict(lr_scheduler="steplr", lr_gamma=2.0), "{lr_gamma} must be in (0, 1] (got 2.0)")]
    for kwargs, template in cases:
        with pytest.raises(ConfigError) as err:
            ScheduleArgs(**kwargs)
        assert err.value.template.startswith(template), err.value.template


def test_optimizer_args_refuse_a_momentum_adamw_has_not():
    from ddp_recipes.config.optim import OptimizerArgs
    from ddp_recipes.optim.optimizers import optimizer_state_kind

    OptimizerArgs(optimizer="rmsprop", momentum=0.5)
    with pytest.raises(ConfigError, match="momentum has no effect without optimizer sgd, sgd_nesterov or rmsprop"):
        OptimizerArgs(optimizer="adamw", momentum=0.5)
    with pytest.raises(ConfigError, match=r"bias_weight_decay must be >= 0 \(got nan\)"):
        OptimizerArgs(bias_weight_decay=math.nan)
    assert [optimizer_state_kind(n) for n in (None, "sgd_nesterov", "adamw")] == ["sgd", "sgd", "adamw"]


def test_build_from_names_the_config_fields():
    from dataclasses import dataclass

    from ddp_recipes.config.ema import EMAArgs
    from ddp_recipes.config.run_config import build_from

    @dataclass
    class Flags:
        model_ema: bool = False
        model_ema_steps: int = 32
        model_ema_decay: float = 0.99998
        warmup_epochs: float = 0.0

    names = {"enabled": "model_ema", "decay": "model_ema_decay", "update_every": "model_ema_steps"}
    assert build_from(EMAArgs, Flags(model_ema=True, model_ema_steps=4), names).update_every == 4
    with pytest.raises(ConfigError) as err:
        build_from(EMAArgs, Flags(model_ema_steps=4), names)
    assert err.value.cli() == "--model-ema-steps has no effect without --model-ema; add it or drop --model-ema-steps"
    assert err.value.param == "model_ema_steps"
    with pytest.raises(ConfigError) as err:
        build_from(EMAArgs, Flags(model_ema=True, model_ema_decay=2.0), names)
    assert err.value.cli().startswith("--model-ema-decay must be in [0, 1]")


def test_a_schedule_states_the_run_length_its_curve_was_sized_for():
    """What ResumeState compares across a resume is a typed property of the pack's schedules, kept through the
    scheduler's state dict (a checkpoint), and None for a schedule that does not depend on the run's length."""
    opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    assert schedule_length(warmup_cosine(opt, 2, 40)) == 40
    assert schedule_length(warmup_cosine(opt, 2, 0)) is None  # warm-up only: no decay over the run
    cosine = reference_scheduler(opt, 10, 100, ReferenceSchedule(lr_scheduler="cosineannealinglr"))
    assert schedule_length(cosine) == 100
    assert schedule_length(reference_scheduler(opt, 10, 100, ReferenceSchedule(lr_scheduler="steplr"))) is None
    assert schedule_length(LambdaLR(opt, lambda step: 1.0)) is None  # a user's own
    resumed = warmup_cosine(opt, 2, 80)
    resumed.load_state_dict(warmup_cosine(opt, 2, 40).state_dict())
    assert schedule_length(resumed) == 40  # the checkpoint's: ResumeState reads this run's before the restore
