"""A user's Lightning script run a second time, for tests/checkpointing/test_second_run.py (2 gloo ranks,
build_trainer).

``python tests/scenarios/second_run_scenario.py MODE OUT STEPS``:

* ``nodes``: each rank works in its own folder, ``OUT/node<LOCAL_RANK>``, with the same relative
  ``default_root_dir`` (``run``): two nodes whose disks hold different files at the same path. The script
  fits with ``ckpt_path="last"`` up to STEPS and rank 0 writes ``OUT/result.json``.
* ``stream``: an IterableDataset of 64 samples that does not split by rank, batch 4, one epoch; every rank
  writes ``OUT/seen<rank>.json`` (its global step and the sample ids it trained on).
* ``prebuilt``: the model is built before ``build_trainer(seed=0)``, as most Lightning scripts do; rank 0
  saves the trained weights to ``OUT/weights.pt``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from torch.utils.data import DataLoader, IterableDataset, TensorDataset  # noqa: E402

import ddp_recipes  # noqa: E402
from tests.tiny_modules import TinyNet  # noqa: E402


class Net(TinyNet):
    """The suite's tiny net, keeping the ids of the samples it trained on."""

    def __init__(self) -> None:
        super().__init__(4, 2, 16, activation="relu")
        self.seen: list[int] = []

    def training_step(self, batch, batch_idx):
        self.seen += batch[2].tolist()
        return super().training_step(batch, batch_idx)


def data(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 4, generator=g), torch.randint(0, 2, (n,), generator=g), torch.arange(n)


class Stream(IterableDataset):
    """The same 64 samples in the same order on every rank (it does not read the rank)."""

    def __iter__(self):
        x, y, ids = data(64)
        for i in range(64):
            yield x[i], y[i], ids[i]


def trainer(out: str, **kwargs):
    return ddp_recipes.build_trainer(devices=2, accelerator="cpu", seed=0, default_root_dir=out, logger=False,
                                     enable_progress_bar=False, enable_model_summary=False, **kwargs)


def main(mode: str, out: Path, steps: int) -> None:
    if mode == "nodes":
        node = out / f"node{os.environ.get('LOCAL_RANK', '0')}"
        node.mkdir(parents=True, exist_ok=True)
        os.chdir(node)
        t = trainer("run", max_steps=steps, checkpoint_every_n_steps=1)
        t.fit(Net(), DataLoader(TensorDataset(*data(64)), batch_size=4, shuffle=True), ckpt_path="last")
        if t.is_global_zero:
            (out / "result.json").write_text(json.dumps({"global_step": t.global_step}))
    elif mode == "stream":
        t = trainer(str(out), max_epochs=1)
        model = Net()
        t.fit(model, DataLoader(Stream(), batch_size=4))
        (out / f"seen{t.global_rank}.json").write_text(json.dumps({"global_step": t.global_step, "seen": model.seen}))
    elif mode == "prebuilt":
        model = Net()  # before build_trainer: not seeded by it
        t = trainer(str(out), max_steps=steps)
        t.fit(model, DataLoader(TensorDataset(*data(64)), batch_size=4, shuffle=True))
        if t.is_global_zero:
            torch.save(model.state_dict(), out / "weights.pt")
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]))
