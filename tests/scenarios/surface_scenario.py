"""A user's script around ``recipes.mnist.main``: a stateful callback of its own (``main(callbacks=...)``) and
Trainer settings (``main(trainer_kwargs=...)``), as docs/bring-your-own-model.md shows.

    python tests/scenarios/surface_scenario.py --devices 2 --accelerator cpu --output-dir OUT ...

Each rank writes ``OUT/tally-<run>-rank<r>.json`` at the end of fit: the batches its ``Tally`` counted (restored
from the checkpoint on ``--resume``), what it restored, and the Trainer settings it saw.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback

from recipes import mnist


class Tally(Callback):
    """Counts training batches; its count is checkpointed (Lightning keys it by ``state_key``)."""

    def __init__(self) -> None:
        self.batches = 0
        self.restored: int | None = None

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.batches += 1

    def state_dict(self) -> dict[str, Any]:
        return {"batches": self.batches}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.batches = self.restored = int(state["batches"])

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        facts = {"batches": self.batches, "restored": self.restored, "world_size": trainer.world_size,
                 "global_step": trainer.global_step, "strategy": type(trainer.strategy).__name__,
                 "limit_val_batches": trainer.limit_val_batches, "log_every_n_steps": trainer.log_every_n_steps,
                 "own_callbacks": sum(isinstance(c, Tally) for c in trainer.callbacks)}
        run = os.environ.get("SURFACE_RUN", "run")
        Path(trainer.default_root_dir, f"tally-{run}-rank{trainer.global_rank}.json").write_text(json.dumps(facts))


if __name__ == "__main__":
    mnist.main(sys.argv[1:], callbacks=[Tally()], trainer_kwargs={"limit_val_batches": 2})
