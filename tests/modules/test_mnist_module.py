"""MNISTClassifier: architectures, the build_model() extension point, and a short real fit on CPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ddp_recipes.data.mnist import MNISTDataModule
from ddp_recipes.modules.mnist import MNISTClassifier
from tests.helpers import cpu_trainer, raises_cli


@pytest.mark.parametrize("arch", ["mlp", "cnn"])
def test_archs_give_logits(arch):
    model = MNISTClassifier(arch=arch)
    assert model(torch.randn(3, 1, 28, 28)).shape == (3, 10)
    assert model.hparams.arch == arch


def test_unknown_arch_names_flag():
    with raises_cli(ValueError, match=r"--arch must be one of mlp, cnn \(got 'resnet'\)"):
        MNISTClassifier(arch="resnet")


class LinearClassifier(MNISTClassifier):
    """What a user writes to swap the network: one override."""

    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, self.hparams.num_classes))


def test_subclass_build_model_is_trained(mnist_dir):
    model = LinearClassifier(lr=0.05)
    before = model.model[1].weight.detach().clone()
    trainer = cpu_trainer(max_steps=3, log_every_n_steps=1)
    trainer.fit(model, datamodule=MNISTDataModule(mnist_dir, batch_size=32, download=False))
    assert trainer.global_step == 3
    net = trainer.lightning_module.model
    assert isinstance(net[1], nn.Linear) and len(net) == 2  # the subclass's network, not the MLP
    assert not torch.equal(before, net[1].weight)
    assert "train_loss" in trainer.callback_metrics  # logged at the logger's cadence (every step here)


def test_mlp_one_epoch_reaches_accuracy(mnist_dir):
    torch.manual_seed(0)
    dm = MNISTDataModule(mnist_dir, batch_size=64, val_size=1000, download=False)
    # Warm-up + cosine through the schedules helper, as the recipes configure it.
    model = MNISTClassifier(arch="mlp", lr=0.05, warmup_epochs=0.2, cosine=True)
    trainer = cpu_trainer(max_epochs=1, num_sanity_val_steps=0)
    trainer.fit(model, datamodule=dm)
    assert trainer.callback_metrics["val_acc"] > 0.85
    assert {"train_loss", "train_loss_epoch", "val_loss"} <= set(trainer.callback_metrics)
    assert trainer.lr_scheduler_configs[0].interval == "step"
    (result,) = trainer.test(model, datamodule=dm, verbose=False)
    assert result["test_acc"] > 0.85 and result["test_loss"] < 0.6
