"""ResNetClassifier: architectures, stems and their size bounds, grad checkpointing, channels-last,
weight-decay groups, and a short 1-device fit on synthetic images. Tiny images keep it fast on CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from lightning import seed_everything
from torch import nn

from ddp_recipes.data.images import SyntheticImageDataModule
from ddp_recipes.modules import resnet as resnet_mod
from ddp_recipes.modules.resnet import ResNetClassifier
from tests.helpers import cli_text, cpu_trainer, raises_cli


def _layer4_side(model: nn.Module, image_size: int, device: str = "cpu") -> int:
    """Side of layer4's output map for a square input of ``image_size``."""
    seen = {}

    def hook(mod: nn.Module, inp: tuple, out: torch.Tensor) -> None:
        seen["side"] = out.shape[-1]

    handle = model.layer4.register_forward_hook(hook)
    try:
        model.eval()
        with torch.no_grad():
            model(torch.zeros(1, 3, image_size, image_size, device=device))
    finally:
        handle.remove()
    return seen["side"]


# torchvision's published 1000-class counts, with the fc resized to 10 classes.
@pytest.mark.parametrize("arch, params, fc_in", [("resnet18", 11_689_512, 512), ("resnet34", 21_797_672, 512),
                                                 ("resnet50", 25_557_032, 2048)])
def test_build_model_per_arch(arch, params, fc_in):
    with torch.device("meta"):  # shapes only: no 25M-parameter init on the CPU
        module = ResNetClassifier(arch=arch, num_classes=10)
    fc_delta = (fc_in * 1000 + 1000) - (fc_in * 10 + 10)
    assert sum(p.numel() for p in module.model.parameters()) == params - fc_delta
    assert module.model.fc.out_features == 10
    assert module.hparams.arch == arch


def test_unknown_arch_names_flag():
    with raises_cli(ValueError, match=r"--arch must be a torchvision classification model.*got 'x'"):
        ResNetClassifier(arch="x")


class _TinyNet(ResNetClassifier):
    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                             nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, self.hparams.num_classes))


def test_build_model_override_is_used():
    module = _TinyNet(num_classes=3)
    assert isinstance(module.model, nn.Sequential)
    assert module(torch.randn(2, 3, 8, 8)).shape == (2, 3)
    assert "acc5" not in module.val_metrics and "acc5" not in module.test_metrics  # top-5 of 3 classes: skipped
    decayed = {id(p) for p in module.param_groups()[0]["params"]}
    assert decayed == {id(module.model[0].weight), id(module.model[5].weight)}


def test_grad_checkpointing_needs_resnet_layout():
    with raises_cli(ValueError, match="--grad-checkpointing needs a torchvision-style ResNet"):
        _TinyNet(grad_checkpointing=True)


def test_cifar_stem_shapes():
    module = ResNetClassifier(cifar_stem=True, num_classes=10)
    conv1 = module.model.conv1
    assert (conv1.kernel_size, conv1.stride, conv1.padding) == ((3, 3), (1, 1), (1, 1))
    assert isinstance(module.model.maxpool, nn.Identity)
    assert _layer4_side(module.model, 32) == 4  # 32 / 8
    assert _layer4_side(ResNetClassifier().model, 32) == 1  # 32 / 32 with the ImageNet stem
    assert module(torch.randn(2, 3, 16, 16)).shape == (2, 10)


@pytest.mark.parametrize("cifar_stem, expected", [(False, 32), (True, 8)])
def test_check_image_size_bounds_match_network(cifar_stem, expected):
    with torch.device("meta"):
        model = ResNetClassifier(cifar_stem=cifar_stem).model
    # The network's real downsampling: measured, not assumed (meta tensors: shapes without compute).
    stride = 256 // _layer4_side(model, 256, device="meta")
    assert ResNetClassifier.min_image_size(cifar_stem) == stride == expected
    assert _layer4_side(model, stride, device="meta") == 1
    ResNetClassifier.check_image_size(stride, cifar_stem)
    with raises_cli(ValueError, match="--image-size") as info:
        ResNetClassifier.check_image_size(stride - 1, cifar_stem)
    assert "--cifar-stem" in cli_text(info.value) and "\n" not in str(info.value)


def test_fit_rejects_too_small_images():
    dm = SyntheticImageDataModule(num_samples=8, image_size=16, batch_size=4)
    with raises_cli(ValueError, match="--image-size 16 is too small .*--cifar-stem"):
        cpu_trainer(max_steps=1).fit(ResNetClassifier(), dm)


def _loss_and_grads(module: ResNetClassifier, x: torch.Tensor, y: torch.Tensor):
    module.train()
    module.zero_grad()
    loss = F.cross_entropy(module(x), y)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in module.named_parameters()}


def test_grad_checkpointing_matches_plain(monkeypatch):
    calls = []
    real = resnet_mod.checkpoint
    monkeypatch.setattr(resnet_mod, "checkpoint", lambda *a, **k: calls.append(1) or real(*a, **k))
    torch.manual_seed(0)
    plain = ResNetClassifier(cifar_stem=True)
    ckpt = ResNetClassifier(cifar_stem=True, grad_checkpointing=True)
    ckpt.load_state_dict(plain.state_dict())
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,))

    loss_p, grads_p = _loss_and_grads(plain, x, y)
    assert not calls
    loss_c, grads_c = _loss_and_grads(ckpt, x, y)
    assert len(calls) == 4  # one per stage

    torch.testing.assert_close(loss_c, loss_p, rtol=1e-5, atol=0)
    for name, grad in grads_p.items():
        torch.testing.assert_close(grads_c[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    # The recompute in backward must not step BatchNorm's running statistics a second time.
    for name, buf in plain.state_dict().items():
        torch.testing.assert_close(ckpt.state_dict()[name], buf, rtol=0, atol=0, msg=name)
    ckpt.eval()  # no checkpointing (and no recompute) outside training
    with torch.no_grad():
        ckpt(x)
    assert len(calls) == 4


def test_channels_last_forward_matches_plain():
    torch.manual_seed(0)
    plain = ResNetClassifier(cifar_stem=True)
    fast = ResNetClassifier(cifar_stem=True, channels_last=True)
    fast.load_state_dict(plain.state_dict())
    assert fast.model.conv1.weight.is_contiguous(memory_format=torch.channels_last)
    # NHWC kernels sum in another order: equal up to float rounding. 16 px keeps layer4 at 2x2, so the
    # train-mode BatchNorm there does not normalize over 2 values and amplify that rounding.
    x = torch.randn(2, 3, 16, 16)
    for train in (False, True):
        plain.train(train), fast.train(train)
        with torch.no_grad():
            torch.testing.assert_close(fast(x), plain(x), rtol=1e-5, atol=1e-5)


def test_weight_decay_groups_skip_bn_and_bias():
    module = ResNetClassifier(weight_decay=1e-3)
    decay_group, no_decay_group = module.param_groups()
    assert (decay_group["weight_decay"], no_decay_group["weight_decay"]) == (1e-3, 0.0)
    decayed = {id(p) for p in decay_group["params"]}
    not_decayed = {id(p) for p in no_decay_group["params"]}
    assert decayed.isdisjoint(not_decayed)
    for mod in module.modules():
        own = {id(p) for p in mod.parameters(recurse=False)}
        if isinstance(mod, nn.BatchNorm2d):
            assert own <= not_decayed
        elif isinstance(mod, nn.Conv2d | nn.Linear):
            assert id(mod.weight) in decayed
            if mod.bias is not None:
                assert id(mod.bias) in not_decayed
    assert decayed | not_decayed == {id(p) for p in module.parameters()}


def test_fit_on_synthetic_data():
    seed_everything(0, verbose=False)
    dm = SyntheticImageDataModule(num_samples=12, image_size=32, batch_size=4, val_samples=8)
    model = ResNetClassifier(num_classes=10, lr=0.05, nesterov=True)  # ImageNet stem: 1x1 at layer4
    trainer = cpu_trainer(max_steps=3, log_every_n_steps=1)  # train_loss is logged at the logger cadence
    trainer.fit(model, dm)
    assert trainer.global_step == 3
    metrics = trainer.callback_metrics
    for name in ("train_loss", "train_loss_epoch", "val_loss", "val_acc", "val_acc5"):
        assert torch.isfinite(metrics[name]), name
    optimizer = trainer.optimizers[0]
    assert [g["weight_decay"] for g in optimizer.param_groups] == [5e-4, 0.0]
    assert optimizer.param_groups[0]["nesterov"]
    # cosine=True over max_steps=3: the LR is annealing.
    assert optimizer.param_groups[0]["lr"] < 0.05
    (result,) = trainer.test(model, dm, verbose=False)
    assert {"test_loss", "test_acc", "test_acc5"} <= result.keys()
    assert 0.0 <= result["test_acc"] <= result["test_acc5"] <= 1.0


def test_grad_checkpointing_compiles_and_matches_eager():
    """dynamo refuses a lambda ``context_fn`` (issue #20, item 7); compiled, the BN stats still step once."""
    torch.manual_seed(0)
    eager = ResNetClassifier(cifar_stem=True, grad_checkpointing=True)
    compiled = ResNetClassifier(cifar_stem=True, grad_checkpointing=True)
    compiled.load_state_dict(eager.state_dict())
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,))
    torch._dynamo.reset()
    loss_e, grads_e = _loss_and_grads(eager, x, y)
    compiled.train()
    loss_c = F.cross_entropy(torch.compile(compiled, backend="aot_eager", fullgraph=True)(x), y)
    loss_c.backward()
    grads_c = {n: p.grad for n, p in compiled.named_parameters()}
    torch.testing.assert_close(loss_c.detach(), loss_e, rtol=1e-4, atol=1e-6)
    for name, grad in grads_e.items():
        torch.testing.assert_close(grads_c[name], grad, rtol=1e-4, atol=1e-5, msg=name)
    for name, buf in eager.state_dict().items():
        torch.testing.assert_close(compiled.state_dict()[name], buf, rtol=1e-5, atol=1e-6, msg=name)
