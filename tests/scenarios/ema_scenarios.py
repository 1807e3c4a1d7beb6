"""A tiny ImageClassifier for the EMA tests, and their 2-rank run: ``python tests/scenarios/ema_scenarios.py OUT``.

Lightning's launcher re-runs this command line for rank 1; every rank writes ``OUT/rank<r>.pt`` with its
averaged network, its model and the metrics it logged.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from ddp_recipes.modules.classifier import ImageClassifier  # noqa: E402

FEATURES, CLASSES = 8, 3


class TinyClassifier(ImageClassifier):
    """Linear -> BatchNorm -> ReLU -> Linear: parameters, float buffers and an integer buffer to average."""

    def __init__(self, lr: float = 0.2, momentum: float = 0.9, warmup_epochs: float = 0.0, cosine: bool = False,
                 num_classes: int = CLASSES, width: int = 16) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = self.build_model()
        self.init_metrics()

    def build_model(self) -> nn.Module:
        width = self.hparams.width
        return nn.Sequential(nn.Linear(FEATURES, width), nn.BatchNorm1d(width), nn.ReLU(),
                             nn.Linear(width, self.hparams.num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


def data(n: int, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, FEATURES, generator=g)
    y = (x[:, :CLASSES].argmax(1) + (x[:, CLASSES] > 0.5).long()) % CLASSES
    return TensorDataset(x, y)


def loader(n: int, batch: int, seed: int = 0) -> DataLoader:
    return DataLoader(data(n, seed), batch_size=batch, shuffle=False)


def main() -> None:
    from ddp_recipes import build_trainer
    from ddp_recipes.optim.ema import ModelEMA

    out = Path(sys.argv[1])
    ema = ModelEMA(decay=0.7, update_every=2, warmup_epochs=0.5)
    trainer = build_trainer(devices=2, accelerator="cpu", seed=7, max_epochs=2, callbacks=[ema], logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            num_sanity_val_steps=0)
    torch.manual_seed(0)
    module = TinyClassifier()
    # 64 samples, 8 per rank per batch: 4 optimizer steps per epoch; validation: 16 samples per rank.
    trainer.fit(module, train_dataloaders=loader(64, 8), val_dataloaders=loader(32, 8, seed=1))
    out.mkdir(parents=True, exist_ok=True)
    network = ema.network
    torch.save({"ema": {k: v.detach().clone() for k, v in network.state_dict().items()},
                "ema_requires_grad": any(p.requires_grad for p in network.parameters()),
                "n_averaged": ema.n_averaged,
                "model": {k: v.detach().clone() for k, v in module.model.state_dict().items()},
                "module_keys": sorted(module.state_dict()),
                "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
                "global_step": trainer.global_step},
               out / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main()
