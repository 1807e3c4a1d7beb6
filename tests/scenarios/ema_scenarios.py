"""The EMA tests' 2-rank run of the tiny ImageClassifier: ``python tests/scenarios/ema_scenarios.py OUT``.

Lightning's launcher re-runs this command line for rank 1; every rank writes ``OUT/rank<r>.pt`` with its
averaged network, its model and the metrics it logged.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.tiny_modules import TinyClassifier, classifier_loader  # noqa: E402


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
    trainer.fit(module, train_dataloaders=classifier_loader(64, 8), val_dataloaders=classifier_loader(32, 8, seed=1))
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
