"""The networks the ResNet recipe trains: any torchvision classification model by name, adapted to the recipe's
flags (the CIFAR stem, dropout before the classifier, the builders' options), and pretrained weights fitted to it."""

from __future__ import annotations

import inspect

import torch
from torch import nn
from torchvision import models

from ddp_recipes.errors import ConfigError
from ddp_recipes.modules.pretrained import LoadReport, load_pretrained

# Every torchvision classification model (not detection/segmentation/video: those take other inputs).
ARCHS = tuple(models.list_models(module=models))
RESNET_FAMILY = tuple(a for a in ARCHS if a.startswith(("resnet", "resnext", "wide_resnet")))
# Builder options some models need to return plain logits in training (no auxiliary heads).
# init_weights=True is their random-weights default, said explicitly so torchvision does not warn about it.
ARCH_KWARGS = {"inception_v3": {"aux_logits": False, "init_weights": True},
               "googlenet": {"aux_logits": False, "init_weights": True}}
# What torchvision's builders change for pretrained weights (trained on inputs in [-1, 1]); their auxiliary
# heads are in the weights file but not in the network built without them, so those keys are dropped.
PRETRAINED_KWARGS = {"inception_v3": {"transform_input": True}, "googlenet": {"transform_input": True}}
AUX_HEAD_KEYS = {"inception_v3": ("AuxLogits.",), "googlenet": ("aux1.", "aux2.")}
STAGES = ("layer1", "layer2", "layer3", "layer4")
# Total downsampling of the torchvision ResNet up to layer4 (tests measure it on the real network):
# ImageNet stem = conv1 stride 2 x maxpool stride 2, CIFAR stem = none; layer2..layer4 halve again each.
STEM_STRIDE = {False: 4, True: 1}
STAGES_STRIDE = 8


def arch_features(arch: str, cifar_stem: bool, dropout: float, grad_checkpointing: bool) -> None:
    """Raise a ``ValueError`` naming the flag when ``arch`` lacks what a feature needs."""
    if arch not in ARCHS:
        raise ConfigError(f"{{arch}} must be a torchvision classification model, e.g. resnet50, resnext50_32x4d, "
                         f"wide_resnet50_2, efficientnet_b0 (torchvision.models.list_models()); got {arch!r}")
    if arch in RESNET_FAMILY:
        return
    if cifar_stem:
        raise ConfigError(f"{{cifar_stem}} replaces a ResNet's conv1/maxpool stem; {{arch}} {arch} has none "
                         "(use {no_cifar_stem}, or a ResNet-family {arch})")
    if grad_checkpointing:
        raise ConfigError(f"{{grad_checkpointing}} recomputes a ResNet's layer1..layer4 stages; {{arch}} {arch} has "
                         "no such stages (drop the flag, or use a ResNet-family {arch})")
    if dropout > 0 and "dropout" not in _builder_options(arch):
        raise ConfigError(f"{{dropout}}: {{arch}} {arch} has no dropout option in torchvision (drop the flag, or use "
                         "a model that has one, e.g. efficientnet_b0, mobilenet_v3_large, vit_b_16)")


def _builder_options(arch: str) -> set[str]:
    """Keyword options of torchvision's builder and of the model class it returns (builders pass
    ``**kwargs`` on to the class, e.g. EfficientNet's ``dropout``)."""
    builder = inspect.signature(models.get_model_builder(arch))
    options = set(builder.parameters)
    returned = builder.return_annotation  # a class, or its name under postponed annotations
    target = getattr(models, returned, None) if isinstance(returned, str) else returned
    if isinstance(target, type):
        options |= set(inspect.signature(target).parameters)
    return options


def build_arch(arch: str, num_classes: int, cifar_stem: bool = False, dropout: float = 0.0,
               pretrained: bool = False) -> nn.Module:
    """``torchvision.models.get_model(arch)`` with random weights, adapted to the recipe's flags;
    ``pretrained``: built as torchvision builds it for its weights (loaded afterwards)."""
    arch_features(arch, cifar_stem, dropout, grad_checkpointing=False)
    kwargs = {**ARCH_KWARGS.get(arch, {}), **(PRETRAINED_KWARGS.get(arch, {}) if pretrained else {})}
    if arch not in RESNET_FAMILY and dropout > 0:
        kwargs["dropout"] = dropout  # the model's own head dropout; 0 keeps torchvision's default
    model = models.get_model(arch, weights=None, num_classes=num_classes, **kwargs)
    if arch not in RESNET_FAMILY:
        return model
    if cifar_stem:
        # A 7x7/2 conv and a max-pool would leave a 32 px image 8 px wide after the stem.
        model.conv1 = nn.Conv2d(3, model.conv1.out_channels, kernel_size=3, stride=1, padding=1, bias=False)
        nn.init.kaiming_normal_(model.conv1.weight, mode="fan_out", nonlinearity="relu")  # as torchvision
        model.maxpool = nn.Identity()
    if dropout > 0:
        # Before the classifier, as in torchvision's VGG/MobileNet heads; a stage-free spot that keeps
        # grad checkpointing by stage and the ResNet layout intact.
        model.fc = nn.Sequential(nn.Dropout(dropout), model.fc)
    return model


def fit_pretrained(network: nn.Module, state: dict[str, torch.Tensor], head: set[str], name: str,
                   arch: str | None = None, copy: bool = True) -> LoadReport:
    """:func:`~ddp_recipes.modules.pretrained.load_pretrained` for a network :func:`build_arch` built (``arch``):
    the auxiliary heads of GoogLeNet / Inception v3 dropped from the file, a ResNet's ``fc.*`` read as
    ``fc.1.*`` under ``--dropout``."""
    aux = AUX_HEAD_KEYS.get(arch, ()) if arch else ()
    if aux:
        state = {k: v for k, v in state.items() if not k.startswith(aux)}
    # build_arch wraps a ResNet's fc in Sequential(Dropout, fc) for --dropout: fc.* of the file is fc.1.*.
    rename = {"fc.": "fc.1."} if "fc.weight" in state and "fc.1.weight" in network.state_dict() else None
    return load_pretrained(network, state, head, name, rename, copy=copy)
