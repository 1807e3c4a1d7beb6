"""What the ResNet recipe's network can take, checked before any process starts: the input size an
architecture accepts and the fit of a local weights file, both on the meta device (no memory, milliseconds)."""

from __future__ import annotations

import torch

from ddp_recipes.errors import ConfigError
from ddp_recipes.modules.classifier import ImageClassifier, default_backbone
from ddp_recipes.modules.pretrained import LoadReport, PretrainedWeights, head_keys, read_weights
from ddp_recipes.modules.resnet import RESNET_FAMILY, ResNetClassifier, build_arch, fit_pretrained


def own_network(cls: type[ResNetClassifier]) -> bool:
    """Whether ``cls`` builds the recipe's network and backbone (so they can be checked before the run)."""
    return cls.build_model is ResNetClassifier.build_model and cls.backbone_modules is ImageClassifier.backbone_modules


def check_weights_fit(arch: str, num_classes: int, cifar_stem: bool, dropout: float,
                      weights: PretrainedWeights) -> LoadReport:
    """The keys and shapes of a local weights file against the recipe's network, built on the meta device (no
    memory, milliseconds): a file that does not fit fails before any process starts."""
    state = read_weights(weights)
    with torch.device("meta"):
        network = build_arch(arch, num_classes, cifar_stem, dropout, pretrained=True)
    return fit_pretrained(network, state, head_keys(network, default_backbone(network)), weights.name, arch, copy=False)


def check_arch_input(arch: str, num_classes: int, image_size: int, cifar_stem: bool = False,
                     dropout: float = 0.0) -> None:
    """Raise a ``ValueError`` naming the flags when ``arch`` cannot take ``image_size`` px images.

    ResNets pad their way through any size (:meth:`ResNetClassifier.check_image_size` says which sizes
    are useful); other models are traced once on the meta device, which checks every shape in
    milliseconds without allocating weights. A model that cannot be built there is not checked.
    """
    if arch in RESNET_FAMILY:
        ResNetClassifier.check_image_size(image_size, cifar_stem)
        return
    try:
        with torch.device("meta"):
            model = build_arch(arch, num_classes, cifar_stem, dropout).eval()
    except (RuntimeError, NotImplementedError):  # e.g. RegNet computes its widths with tensor data
        return
    try:
        with torch.device("meta"), torch.no_grad():
            model(torch.empty(1, 3, image_size, image_size))
    except (RuntimeError, ValueError, AssertionError) as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"{{image_size}} {image_size} does not fit {{arch}} {arch} ({reason}); pick an image size "
                         "the model takes (e.g. 224)") from None
