"""Change one thing of the ResNet recipe at a time: the optimizer, the loss, the metrics.

    python -m recipes.resnet --model-class my_resnet:AdamWResNet --data synthetic --lr 1e-3 --warmup-epochs 1

The LR the recipe scales for the global batch (``--lr-scaling``) arrives as ``self.hparams.lr``, and the
recipe's warm-up/cosine schedule is attached to whatever optimizer ``build_optimizer`` returns.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torchmetrics import Metric
from torchmetrics.classification import MulticlassF1Score

from ddp_recipes.modules.resnet import ResNetClassifier


class AdamWResNet(ResNetClassifier):
    """AdamW instead of SGD, a focal-style loss, and macro F1 next to the accuracies."""

    def __init__(self, focal_gamma: float = 1.0, **kwargs) -> None:
        super().__init__(**kwargs)

    def build_optimizer(self, param_groups: list[dict]) -> torch.optim.Optimizer:
        # param_groups() still puts no weight decay on norms and biases; each group carries its own value.
        return torch.optim.AdamW(param_groups, lr=self.hparams.lr, betas=(0.9, 0.999))

    soft_targets = True  # loss() below takes --mixup-alpha/--cutmix-alpha's class probabilities too

    def loss(self, logits: torch.Tensor, target: torch.Tensor, stage: str) -> torch.Tensor:
        if stage != "train":
            return super().loss(logits, target, stage)  # plain cross-entropy: val_loss stays comparable
        log_p = F.log_softmax(logits.float(), dim=1)
        if target.ndim == 1:  # class indices; MixUp/CutMix give class probabilities instead
            target = F.one_hot(target, logits.shape[1]).float()
        return (-(target * (1 - log_p.exp()) ** self.hparams.focal_gamma * log_p).sum(1)).mean()

    def build_metrics(self) -> dict[str, Metric]:
        metrics = super().build_metrics()  # acc (and acc5): logged as val_acc, test_acc, ...
        metrics["f1"] = MulticlassF1Score(num_classes=self.hparams.num_classes, average="macro")
        return metrics


if __name__ == "__main__":
    from recipes import resnet

    resnet.main(sys.argv[1:], model_cls=AdamWResNet)
