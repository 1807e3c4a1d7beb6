"""What the ResNet recipe's network can take, checked before any process starts (on the meta device: no memory,
milliseconds): input sizes, a weights file, a checkpoint's state, the flags a user's subclass would ignore."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from ddp_recipes.checkpointing.checkpoint import check_compatible
from ddp_recipes.checkpointing.state_match import check_state_fits, meta_module
from ddp_recipes.errors import ConfigError, DataError, lit
from ddp_recipes.modules.architectures import ARCHS, RESNET_FAMILY, build_arch, fit_pretrained
from ddp_recipes.modules.finetuning import BackboneFineTuning, default_backbone
from ddp_recipes.modules.pretrained import LoadReport, PretrainedWeights, head_keys, read_weights
from ddp_recipes.modules.resnet import ResNetClassifier
from ddp_recipes.optim.optimizers import optimizer_state_kind

# The settings that lay out the optimizer's state (its kind and parameter groups), with the value a checkpoint
# that does not record one was trained with.
OPTIMIZER_STATE_DEFAULTS = {"norm_weight_decay": 0.0, "bias_weight_decay": 0.0, "freeze_backbone": False,
                            "backbone_lr_mult": 1.0, "unfreeze_at_epoch": None}


def own_network(cls: type[ResNetClassifier]) -> bool:
    """Whether ``cls`` builds the recipe's network and backbone (so they can be checked before the run)."""
    return (cls.build_model is ResNetClassifier.build_model
            and cls.backbone_modules is BackboneFineTuning.backbone_modules)


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
    """Raise a ``ValueError`` naming the flags when ``arch`` cannot take ``image_size`` px images: other models than
    ResNets are traced once on the meta device (one that cannot be built there is not checked)."""
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


def check_network_fits(cls: type[ResNetClassifier], arch: str, num_classes: int, sizes: Iterable[int],
                       cifar_stem: bool, dropout: float, weights: PretrainedWeights | None) -> None:
    """The recipe's network (when ``cls`` builds it) against every input side it meets, and a local
    ``weights`` file against it (a file that is no state dict or would run code fails for any ``cls``)."""
    if cls.build_model is ResNetClassifier.build_model:
        for size in sorted(set(sizes)):
            check_arch_input(arch, num_classes, size, cifar_stem, dropout)
    if weights is not None and weights.path is not None:
        if own_network(cls):
            check_weights_fit(arch, num_classes, cifar_stem, dropout, weights)
        else:
            read_weights(weights)


def check_resumed_network(checkpoint: dict[str, Any], path: str, arch: str, num_classes: int, cifar_stem: bool,
                          dropout: float) -> None:
    """The network of ``checkpoint`` (at ``path``) must be the one the run builds: architecture, classes, stem
    and dropout."""
    check_compatible(checkpoint, path, {"arch": arch, "num_classes": num_classes, "cifar_stem": cifar_stem,
                                        "dropout": dropout}, accepted={"arch": ARCHS})


def check_resumed_state(checkpoint: dict[str, Any], path: str, build: Callable[[], ResNetClassifier]) -> None:
    """The weights of ``checkpoint`` (at ``path``) against the names and shapes of the module ``build`` makes
    (built on the meta device): a plain Lightning checkpoint of another model is one line, not a traceback per
    rank after the launch."""
    module = meta_module(build)
    if module is not None:
        check_state_fits(checkpoint, path, module, ResNetClassifier, "{arch}, {num_classes} or {cifar_stem}")


def check_optimizer_state(checkpoint: dict[str, Any], path: str, settings: Mapping[str, Any]) -> None:
    """The optimizer state of ``checkpoint`` (at ``path``) must fit the run's optimizer and parameter groups
    (``settings``: the module's hyper-parameters); SGD with or without Nesterov keep the same state."""
    saved = dict(checkpoint.get("hyper_parameters") or {})
    saved["optimizer"] = optimizer_state_kind(saved.get("optimizer"))
    expected = {"optimizer": optimizer_state_kind(settings.get("optimizer")),
                **{name: settings.get(name, default) for name, default in OPTIMIZER_STATE_DEFAULTS.items()}}
    check_compatible({"hyper_parameters": saved}, path, expected, defaults=OPTIMIZER_STATE_DEFAULTS)


def check_class_count(cls: type[ResNetClassifier], num_classes: int, datamodule: object, given: bool) -> None:
    """Refuse fewer than 2 classes before any process starts (``MulticlassAccuracy`` would, on every rank),
    naming where the count came from. A subclass with its own ``build_metrics()`` decides."""
    if num_classes >= 2 or cls.build_metrics is not ResNetClassifier.build_metrics:
        return
    if given:
        raise ConfigError(f"{{num_classes}} {num_classes}: a classifier needs 2 or more classes; pass {{num_classes}} "
                          "2 or more, or leave it out to take the data's")
    names = getattr(datamodule, "class_names", None)
    data_dir = getattr(datamodule, "data_dir", None)
    found = f" ({', '.join(map(str, names[:3]))})" if names else ""
    if data_dir is not None:
        raise DataError(f"{{data_dir}} {lit(data_dir)} holds {num_classes} class{lit(found)}: a classifier needs 2 or "
                        "more; add a folder of images per class under its train/ and val/", "data_dir")
    raise DataError(f"{type(datamodule).__name__}.num_classes is {num_classes}: a classifier needs 2 or more classes; "
                    "give the data 2 or more, or pass {num_classes}")


def check_overrides(cls: type[ResNetClassifier], optimizer: str, mixing: list[str], num_classes: int) -> None:
    """Refuse the flags a subclass ``cls`` would ignore or break: ``mixing`` (the MixUp/CutMix parameters given)
    with a ``loss()`` that takes no class-probability targets or fewer than 2 classes, and an ``optimizer`` that
    an overridden ``build_optimizer()`` does not read."""
    name = f"{cls.__module__}:{cls.__qualname__}"  # as --model-class names it
    if mixing and not cls.takes_soft_targets():
        raise ConfigError(f"{{{mixing[0]}}} gives loss() class-probability targets, but {name} "
                          "overrides loss() without soft_targets = True; make it take them (F.cross_entropy does) "
                          f"and set soft_targets = True on the class, or drop {{{mixing[0]}}}", mixing[0])
    if optimizer != "sgd" and cls.build_optimizer is not ResNetClassifier.build_optimizer:
        raise ConfigError(f"{{optimizer}} has no effect: {name} overrides "
                          "build_optimizer(); read self.hparams.optimizer there or drop {optimizer}")
    if num_classes < 2 and mixing:
        raise ConfigError(f"{{{mixing[0]}}} mixes labels of 2 or more classes (the data has {num_classes})",
                          mixing[0])
