"""A user's own LightningCLI script, with nothing of the pack in it: the pack's module, DataModule and strategy
come in by name on the command line (docs/strategy-and-trainer.md#lightningcli).

    python tests/scenarios/lightning_cli_scenario.py fit --model ddp_recipes.MNISTClassifier \\
        --data ddp_recipes.MNISTDataModule \\
        --trainer.strategy tuned_ddp --trainer.devices 2 --trainer.accelerator cpu \\
        --trainer.callbacks+=tests.scenarios.lightning_cli_scenario.SameWeights --trainer.default_root_dir OUT ...

``SameWeights`` writes ``OUT/ranks.json`` on rank 0 at the end of fit: the strategy in use, the DDP settings
it passed to DistributedDataParallel, and how far the ranks' parameters are apart (DDP: not at all).
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.cli import LightningCLI


def _flat(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).float().cpu() for p in module.parameters()])


class SameWeights(Callback):
    """Compares every rank's parameters with rank 0's after fit, and with the weights fit started from."""

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.start = _flat(pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        final = _flat(pl_module)
        gathered = [torch.empty_like(final) for _ in range(trainer.world_size)]
        dist.all_gather(gathered, final)
        if trainer.is_global_zero:
            ddp_model = trainer.strategy.model
            facts = {"strategy": type(trainer.strategy).__name__, "world_size": trainer.world_size,
                     "backend": dist.get_backend(), "global_step": trainer.global_step,
                     "rank_max_abs_diff": max(float((g - gathered[0]).abs().max()) for g in gathered),
                     "moved_from_start": float((final - self.start).abs().max()),
                     "gradient_as_bucket_view": bool(ddp_model.gradient_as_bucket_view),
                     "comm_hook": ddp_model._get_ddp_logging_data().get("comm_hook")}
            Path(trainer.default_root_dir, "ranks.json").write_text(json.dumps(facts))


if __name__ == "__main__":
    LightningCLI(save_config_kwargs={"overwrite": True})
