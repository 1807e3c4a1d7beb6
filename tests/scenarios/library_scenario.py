"""A user's own Lightning script on the library path, for tests/train/test_library_path.py.

``python tests/scenarios/library_scenario.py OUT EPOCHS EVERY_N_STEPS`` trains the user's own module (BatchNorm +
dropout) on the user's own map-style Dataset (torchvision ``RandomCrop`` in ``__getitem__``, drawing from
torch's global RNG as user code does) through ``DataLoader(shuffle=True, num_workers=2,
persistent_workers=True)``, on 2 CPU ranks via ``build_trainer(devices=2, ...)``, and continues with
``trainer.fit(..., ckpt_path="last")``: the same command starts the run and resumes it. Nothing of the pack
but ``build_trainer``. ``SCENARIO_STEP_S`` slows each step (no effect on the numbers) so a test can signal
it mid-run. Rank 0 writes ``OUT/result.json`` with the last validation's sample count.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402
from torchvision.transforms import v2  # noqa: E402

import ddp_recipes  # noqa: E402

TRAIN, VAL = 48, 15  # 48 / (batch 4 x 2 ranks) = 6 steps per epoch; 15 = an odd validation set


class Noise(Dataset):
    def __init__(self, n: int, seed: int, augment: bool) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.rand(n, 3, 12, 12, generator=g)
        self.y = torch.randint(0, 3, (n,), generator=g)
        self.crop = v2.RandomCrop(10, padding=2) if augment else v2.CenterCrop(10)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        return self.crop(self.x[i]), self.y[i]


class UserModule(L.LightningModule):
    """A user's own module, not the suite's tiny net: a convolution, 2-D BatchNorm and dropout are what the
    library path must carry exactly (their buffers and random draws)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Dropout(0.3),
                                 nn.Flatten(), nn.Linear(8 * 8 * 8, 3))

    def training_step(self, batch, batch_idx):
        step_s = float(os.environ.get("SCENARIO_STEP_S", "0"))
        if step_s:
            time.sleep(step_s)
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_seen", float(len(y)), reduce_fx="sum", sync_dist=True, batch_size=len(y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def main(out: Path, epochs: int, every_n_steps: int) -> None:
    trainer = ddp_recipes.build_trainer(
        devices=2, accelerator="cpu", seed=0, max_epochs=epochs, default_root_dir=str(out),
        checkpoint_every_n_steps=every_n_steps, callbacks=ModelCheckpoint(dirpath=out / "user"), logger=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    model = UserModule()
    train = DataLoader(Noise(TRAIN, 1, augment=True), batch_size=4, shuffle=True, num_workers=2,
                       persistent_workers=True)
    val = DataLoader(Noise(VAL, 2, augment=False), batch_size=4)
    trainer.fit(model, train, val, ckpt_path="last")
    if trainer.is_global_zero:
        (out / "result.json").write_text(json.dumps({"val_seen": float(trainer.callback_metrics["val_seen"]),
                                                     "global_step": trainer.global_step}))


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
