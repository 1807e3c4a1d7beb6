"""Counts the collectives of every training step at 2 ranks, for tests/cross_cutting/test_step_collectives.py.

``python tests/scenarios/collective_scenario.py OUT MODE`` fits the MNIST module (the CNN: BatchNorm buffers, so DDP
broadcasts buffers every forward as well as all-reducing gradient buckets) for 2 epochs of 8 steps on 2
CPU ranks, with

* ``pack``: the MNIST recipe's path (``run_fit_test``, the recipe's checkpoint callbacks, ``build_trainer``'s
  callbacks, logger and progress bar);
* ``plain``: ``L.Trainer(strategy="ddp")`` on the same module and tensors, with the same logger cadence,
  progress bar and a ModelCheckpoint;
* ``pack-no-checkpointing``: ``build_trainer(enable_checkpointing=False)`` on the same module and loaders: no
  ``last.ckpt`` callback, so the stop agreement stands alone;
* ``pack-per-step-vote``: the pack plus a callback that does what the pack's preemption vote used to do
  (an asynchronous all-reduce of a flag on a gloo group of its own at every step): the count must see it.

Each rank writes ``OUT/MODE-rank<r>.json``: one row for every whole loop iteration (one training batch's start to
the next one's), counted by the bench's own counter (``benchmarks/account/step_counts.py`` ``StepCounts``): the
collectives issued on every process group (``issued``: each group's sequence number, which counts what DDP's C++
reducer issues too), the groups that exist, which ``torch.distributed`` functions Python called, the host reads
of tensor values, whether the logger wrote at it and what closed it (``spans``: a step, an epoch end, the fit's
end).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, TQDMProgressBar  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from benchmarks.account.step_counts import StepCounts, compact  # noqa: E402

BATCH, STEPS_PER_EPOCH, EPOCHS = 8, 8, 2


class Recorder(StepCounts):
    """Every iteration of the fit, written to ``OUT/MODE-rank<r>.json`` at its end."""

    def __init__(self, out: Path, mode: str) -> None:
        super().__init__()
        self.out, self.mode = out, mode

    def on_train_end(self, trainer, pl_module) -> None:
        super().on_train_end(trainer, pl_module)
        (self.out / f"{self.mode}-rank{trainer.global_rank}.json").write_text(json.dumps(compact(self.rows), indent=1))


class PerStepVote(Callback):
    """The regression the count must catch: a per-step asynchronous all-reduce on a second gloo group."""

    def on_train_start(self, trainer, pl_module) -> None:
        self.group = dist.new_group(backend="gloo")
        self.pending = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.pending is not None:
            self.pending.wait()
        self.pending = dist.all_reduce(torch.zeros(1), group=self.group, async_op=True)

    def on_train_end(self, trainer, pl_module) -> None:
        if self.pending is not None:
            self.pending.wait()


def tensors() -> tuple[Any, Any]:
    from ddp_recipes.data.samplers import TensorBatchDataset

    n, val = 2 * BATCH * STEPS_PER_EPOCH, 2 * BATCH
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n + val, 1, 28, 28, generator=g), torch.randint(0, 10, (n + val,), generator=g)
    return TensorBatchDataset(x[:n], y[:n]), TensorBatchDataset(x[n:], y[n:])


def main(out: Path, mode: str) -> None:
    from ddp_recipes.modules.mnist import MNISTClassifier

    counter = Recorder(out, mode)
    train, val = tensors()
    if mode == "plain":
        L.seed_everything(0, verbose=False)
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=EPOCHS, default_root_dir=out,
                            logger=CSVLogger(out / "plain", name="logs"), log_every_n_steps=10,
                            callbacks=[TQDMProgressBar(refresh_rate=20), ModelCheckpoint(dirpath=out / "plain"),
                                       counter],
                            enable_model_summary=False, num_sanity_val_steps=0)
        from ddp_recipes.data.samplers import keep_batch

        trainer.fit(MNISTClassifier(arch="cnn"),
                    DataLoader(train, batch_size=BATCH, shuffle=True, collate_fn=keep_batch),
                    DataLoader(val, batch_size=BATCH, collate_fn=keep_batch))
        return
    if mode == "pack-no-checkpointing":
        from ddp_recipes import build_trainer
        from ddp_recipes.data.samplers import keep_batch

        trainer = build_trainer(accelerator="cpu", devices=2, seed=0, max_epochs=EPOCHS, default_root_dir=out / mode,
                                logger=CSVLogger(out / mode, name="logs"), log_every_n_steps=10,
                                enable_checkpointing=False, callbacks=[counter], num_sanity_val_steps=0)
        trainer.fit(MNISTClassifier(arch="cnn"),
                    DataLoader(train, batch_size=BATCH, shuffle=True, collate_fn=keep_batch),
                    DataLoader(val, batch_size=BATCH, collate_fn=keep_batch))
        return
    from ddp_recipes.config.run_config import RunConfig
    from ddp_recipes.train.checkpoints import checkpoint_callbacks
    from ddp_recipes.train.run import run_fit_test
    from tests.tiny_modules import TensorDataModule

    cfg = RunConfig(devices=2, accelerator="cpu", max_epochs=EPOCHS, batch_size=BATCH, output_dir=str(out / mode),
                    num_workers=0)
    extra = [PerStepVote()] if mode == "pack-per-step-vote" else []
    data = TensorDataModule(train, val, BATCH, cfg.seed)
    run_fit_test(cfg, lambda: MNISTClassifier(arch="cnn", lr=cfg.plan.lr), data,
                 callbacks=[*checkpoint_callbacks(cfg, True, MNISTClassifier), *extra, counter],
                 test=False, save_final=False)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
