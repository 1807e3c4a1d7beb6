"""Your own network, trained by the MNIST recipe with everything it adds (batch plan, LR scaling,
diagnostics, checkpoints, exact resume, summary.json).

Two ways to run it, from this folder:

    python my_model.py --devices 2 --accelerator cpu --max-epochs 2          # your script, main(model_cls=)
    python -m recipes.mnist --model-class my_model:DropoutCNN --devices 2    # the recipe, by import path

With ``--devices N`` Lightning starts each extra rank by running the same command again, so the script
calls the recipe from its ``if __name__ == "__main__":`` block, with its own command-line arguments.
"""

from __future__ import annotations

import sys

from torch import nn

from ddp_recipes.modules.mnist import MNISTClassifier


class DropoutCNN(MNISTClassifier):
    """A small CNN with dropout in place of the recipe's MLP: one method changes the network."""

    def __init__(self, dropout: float = 0.25, width: int = 16, **kwargs) -> None:
        # The recipe passes the flags it owns (lr, momentum, arch, ...) as keyword arguments; the ones
        # added here keep their defaults unless your script passes them. save_hyperparameters() in the
        # parent records both, so a checkpoint rebuilds this exact network.
        super().__init__(**kwargs)

    def build_model(self) -> nn.Module:
        # Runs inside the parent's __init__: read your arguments from self.hparams, not from attributes.
        width, p = self.hparams.width, self.hparams.dropout
        return nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),          # width x 14 x 14
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),  # 2w x 7 x 7
            nn.Flatten(), nn.Dropout(p), nn.Linear(2 * width * 7 * 7, self.hparams.num_classes),
        )


if __name__ == "__main__":
    from recipes import mnist

    mnist.main(sys.argv[1:], model_cls=DropoutCNN)
