"""Signals at awkward moments of a 2-rank fit, for tests/checkpointing/test_preemption_moments.py.

``python tests/scenarios/preemption_scenario.py OUT PLAN [ACCUMULATE]`` fits a small module for 2 epochs of 6 optimizer
steps on 2 CPU ranks with ``build_trainer`` (validation twice per epoch). ``PLAN`` is a comma list of
``RANK:STEP:MOMENT[:SIGNAL]``: that rank sends itself the signal (default SIGTERM) during optimizer step STEP
(the step that makes ``global_step`` STEP), at MOMENT:

* ``forward``: in ``training_step`` (before this step's gradient all-reduce);
* ``backward``: in ``on_after_backward`` (the all-reduce just done);
* ``optimizer``: in ``on_before_optimizer_step``;
* ``after-boundary``: in the module's ``on_train_batch_end``, after the pack's callbacks have checked the
  boundary (the latest moment of a step);
* ``validation``: in the first ``validation_step`` after step STEP.

With ``ACCUMULATE`` > 1 the moment is in the window's first micro-batch; a fourth argument ``no-checkpointing``
fits with ``enable_checkpointing=False`` (no ``last.ckpt``: the stop agreement alone). Launched by Lightning
(``--devices 2``), or one process per rank when SLURM's variables say so (a stand-in ``srun``). Each rank
writes ``OUT/rank<r>.json``: the step it stopped at and its exit code.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import ddp_recipes  # noqa: E402
from tests.tiny_modules import TinyNet  # noqa: E402

STEPS_PER_EPOCH, EPOCHS, BATCH = 6, 2, 4


class Signalling(TinyNet):
    """The suite's tiny net, sending the plan's signals to its own process at the plan's moments."""

    def __init__(self, plan: list[tuple[int, int, str, int]], accumulate: int) -> None:
        super().__init__(8, 2, 16, activation="relu")
        self.plan, self.accumulate = plan, accumulate
        self.micro = 0

    def _maybe_signal(self, moment: str, step: int) -> None:
        for rank, at, when, signum in self.plan:
            if rank == self.global_rank and at == step and when == moment:
                self.plan = [p for p in self.plan if p != (rank, at, when, signum)]
                os.kill(os.getpid(), signum)

    def _step_in_progress(self) -> int | None:
        """The optimizer step this micro-batch contributes to, when it is a window's first micro-batch."""
        return self.global_step + 1 if self.micro % self.accumulate == 0 else None

    def training_step(self, batch, batch_idx):
        step = self._step_in_progress()
        if step is not None:
            self._maybe_signal("forward", step)
        return super().training_step(batch, batch_idx)

    def on_after_backward(self) -> None:
        step = self._step_in_progress()
        if step is not None:
            self._maybe_signal("backward", step)
        self.micro += 1

    def on_before_optimizer_step(self, optimizer) -> None:
        self._maybe_signal("optimizer", self.global_step + 1)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self._maybe_signal("after-boundary", self.global_step)

    def validation_step(self, batch, batch_idx):
        for rank, at, when, _ in self.plan:
            if when == "validation" and rank == self.global_rank and self.global_step >= at:
                self._maybe_signal("validation", at)
        super().validation_step(batch, batch_idx)


def parse_plan(text: str) -> list[tuple[int, int, str, int]]:
    plan = []
    for item in filter(None, text.split(",")):
        rank, step, moment, *name = item.split(":")
        plan.append((int(rank), int(step), moment, int(getattr(signal, name[0] if name else "SIGTERM"))))
    return plan


def main(out: Path, plan_text: str, accumulate: int, checkpointing: bool = True) -> None:
    g = torch.Generator().manual_seed(0)
    n = 2 * BATCH * STEPS_PER_EPOCH * accumulate
    train = TensorDataset(torch.randn(n, 8, generator=g), torch.randint(0, 2, (n,), generator=g))
    val = TensorDataset(torch.randn(16, 8, generator=g), torch.randint(0, 2, (16,), generator=g))
    trainer = ddp_recipes.build_trainer(
        devices=2, accelerator="cpu", seed=0, max_epochs=EPOCHS, default_root_dir=str(out),
        accumulate_grad_batches=accumulate, val_check_interval=0.5, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, enable_checkpointing=checkpointing)
    model = Signalling(parse_plan(plan_text), accumulate)
    code = 0
    try:
        trainer.fit(model, DataLoader(train, batch_size=BATCH, shuffle=True), DataLoader(val, batch_size=BATCH))
    except SystemExit as stop:
        code = int(stop.code or 0)
        raise
    finally:
        (out / f"rank{trainer.global_rank}.json").write_text(json.dumps({"step": trainer.global_step, "code": code}))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 1,
         sys.argv[4:5] != ["no-checkpointing"])
