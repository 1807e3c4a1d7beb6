"""Small silent-wrong corners, each pinned: unbounded schedules, dict batches, like-for-like bench baselines,
the stem rule, synthetic-data workers, per-rank seeds only after set-up."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ddp_recipes.bench.harness import baselines, workload
from ddp_recipes.optim.schedules import lightning_scheduler
from ddp_recipes.train.diagnostic_rules import batch_size_of


def test_schedule_of_an_unbounded_fit_is_warmup_then_constant():
    """max_epochs=-1 without max_steps: Lightning's estimated_stepping_batches is inf (used to raise
    OverflowError in int()); the schedule warms up and then holds the peak LR."""
    from types import SimpleNamespace

    trainer = SimpleNamespace(estimated_stepping_batches=float("inf"), num_training_batches=2,
                              accumulate_grad_batches=1)
    optimizer = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1)
    sched = lightning_scheduler(optimizer, trainer, warmup_epochs=1, cosine=True)["scheduler"]
    assert [sched.lr_lambdas[0](s) for s in (0, 1, 2, 10**9)] == [0.5, 1.0, 1.0, 1.0]


@pytest.mark.parametrize(("batch", "size"), [
    ((torch.zeros(5, 3), torch.zeros(5)), 5),
    ({"image": torch.zeros(7, 3, 4, 4), "label": torch.zeros(7), "id": torch.zeros(7)}, 7),  # not 3 keys
    ([{"x": torch.zeros(2, 1)}], 2),
    (torch.zeros(4, 2), 4),
    ({"input_ids": [[1, 2, 3], [4, 5, 6]], "label": torch.zeros(2)}, 2),  # a collator without return_tensors
    ((["a", "bb", "ccc", "dddd"], torch.zeros(4)), 4),  # not len("a")
])
def test_throughput_counts_samples_not_keys(batch, size):
    assert batch_size_of(batch) == size


def test_bench_baselines_run_the_packs_precision():
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    ctx, scaler = baselines.mixed_precision("16-mixed", gpu)
    assert ctx.fast_dtype == torch.float16 and isinstance(scaler, torch.amp.GradScaler)
    ctx, scaler = baselines.mixed_precision("16-mixed", cpu)  # the pack switches to bf16-mixed on CPU
    assert ctx.fast_dtype == torch.bfloat16 and scaler is None
    ctx, scaler = baselines.mixed_precision("bf16-mixed", cpu)
    assert ctx.fast_dtype == torch.bfloat16 and scaler is None
    assert baselines.mixed_precision("32-true", cpu)[1] is None


@pytest.mark.parametrize(("size", "stem"), [(32, True), (63, True), (64, False), (224, False)])
def test_bench_uses_the_recipes_stem_rule(size, stem):
    from recipes.config import ResNetConfig

    assert workload.build_module(workload.Workload(image_size=size)).hparams.cifar_stem is stem
    assert ResNetConfig(image_size=size).cifar_stem is stem


def test_synthetic_data_honours_num_workers():
    from recipes.config import ResNetConfig
    from recipes.resnet import build_datamodule

    assert build_datamodule(ResNetConfig(data="synthetic", num_workers=2)).num_workers == 2
    assert build_datamodule(ResNetConfig(data="synthetic")).num_workers == 0
