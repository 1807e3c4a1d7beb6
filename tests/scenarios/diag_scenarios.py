"""Runs for the DDPDiagnostics tests: ``python tests/scenarios/diag_scenarios.py {bad,clean} OUT [--devices N]``.

Lightning's launcher re-runs this command line for rank 1. Every rank writes ``OUT/rank<r>.json`` with the
diagnostics' findings and the checks that ran.

* ``bad`` makes every CPU-detectable mistake at once: a DistributedSampler(num_replicas=1) whose set_epoch
  does nothing (unsharded data, the same order every epoch), BatchNorm at batch 4 without sync, a head that
  never gets a gradient (with find_unused_parameters=True so DDP lets it pass), global batch 8 against a
  reference of 64 with no LR scaling or warm-up, and rank 1 shifting a bias after its first step (its
  weights drift from rank 0's and its loss runs away).
* ``clean`` is the same model done right: Lightning's sampler, sync BatchNorm, every parameter used, linear
  LR scaling. It must produce no finding.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from ddp_recipes import build_trainer  # noqa: E402
from ddp_recipes.train.diagnostics import DDPDiagnostics  # noqa: E402
from tests.tiny_modules import TinyNet  # noqa: E402

N_SAMPLES, N_FEATURES, N_CLASSES = 64, 16, 4


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(N_SAMPLES, N_FEATURES, generator=g)
    return TensorDataset(x, x[:, :N_CLASSES].argmax(1))


class FrozenEpochSampler(DistributedSampler):
    """The classic bug: a shuffling sampler whose epoch never advances, so every epoch has one order."""

    def set_epoch(self, epoch: int) -> None:
        pass


class Net(TinyNet):
    """The suite's tiny net with BatchNorm; ``drift``: rank 1 edits a weight outside DDP after its first step."""

    def __init__(self, unused_head: bool, drift: bool) -> None:
        super().__init__(N_FEATURES, N_CLASSES, 32, batchnorm=True, activation="tanh", aux_head=unused_head, lr=0.05)
        self.drift = drift

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        if self.drift and self.global_rank == 1 and self.global_step == 1:
            with torch.no_grad():  # a weight edit outside DDP, on one rank only
                self.body[-1].bias[0] += 20.0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("scenario", choices=["bad", "clean"])
    p.add_argument("out")
    p.add_argument("--devices", type=int, default=2)
    args = p.parse_args()
    bad = args.scenario == "bad"
    batch = 4 if bad else 8
    trainer = build_trainer(
        devices=args.devices, accelerator="cpu", seed=7, sync_batchnorm=not bad, find_unused_parameters=bad,
        lr_scaling="none" if bad else "linear", warmup_epochs=0, reference_batch=64,
        global_batch=batch * args.devices, max_epochs=2, limit_train_batches=4, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )
    data = dataset()
    if bad:
        sampler = FrozenEpochSampler(data, num_replicas=1, rank=0, shuffle=True, seed=7)
        loader = DataLoader(data, batch_size=batch, sampler=sampler)
    else:
        loader = DataLoader(data, batch_size=batch, shuffle=True)
    trainer.fit(Net(unused_head=bad, drift=bad), loader)
    diag = next(c for c in trainer.callbacks if isinstance(c, DDPDiagnostics))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(
        {"findings": diag.findings, "checked": sorted(diag.checked), "world_size": trainer.world_size}))


if __name__ == "__main__":
    main()
