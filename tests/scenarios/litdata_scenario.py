"""A user's own litdata stream on the library path, for tests/train/test_litdata_path.py.

``python tests/scenarios/litdata_scenario.py OUT DATA EPOCHS [--build-early]`` trains the user's own module
(BatchNorm + dropout) on a litdata ``StreamingDataset`` (``DATA``: a local folder or an ``s3://`` URL written by
``litdata.optimize``/the pack's converter; shuffled by litdata with a seed; its images decoded in the loader
workers) through litdata's ``StreamingDataLoader(batch_size=4, num_workers=2)``, on 2 CPU ranks via
``build_trainer(devices=2, checkpoint_every_n_steps=1)``, and continues with ``trainer.fit(..., ckpt_path="last")``:
the same command starts the run and resumes it. The dataset and loader are built in ``train_dataloader()``, as
the docs say; ``--build-early`` builds them in ``__init__`` instead, before the process group exists.

``SCENARIO_CACHE`` is litdata's ``cache_dir`` (a resume on a new machine gets another one); ``SCENARIO_STEP_S``
slows each step so a test can signal it mid-run. Rank 0 writes ``OUT/result.json`` with the step count and the
paths of the samples each rank trained on in this process, in order.
"""

from __future__ import annotations

import io
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from litdata import StreamingDataLoader, StreamingDataset  # noqa: E402
from PIL import Image  # noqa: E402
from torch import nn  # noqa: E402

import ddp_recipes  # noqa: E402
from ddp_recipes.data.litdata_lib import allow_http_endpoint  # noqa: E402

allow_http_endpoint()  # the tests' S3 server is plain http, which litdata's obstore client refuses unless told


class Images(StreamingDataset):
    """The converter's samples ({"image": PNG bytes, "label", "path"}) as (image tensor, label, path)."""

    def __getitem__(self, index):
        sample = super().__getitem__(index)
        pixels = np.asarray(Image.open(io.BytesIO(sample["image"])).convert("RGB"), dtype=np.float32) / 255
        return torch.from_numpy(pixels).permute(2, 0, 1), sample["label"], sample["path"]


def stream(data: str) -> StreamingDataLoader:
    dataset = Images(data, shuffle=True, seed=7, cache_dir=os.environ.get("SCENARIO_CACHE"))
    return StreamingDataLoader(dataset, batch_size=4, num_workers=2)


class UserModule(L.LightningModule):
    def __init__(self, data: str, build_early: bool) -> None:
        super().__init__()
        self.data = data
        self.early = stream(data) if build_early else None
        self.net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Dropout(0.3),
                                 nn.Flatten(), nn.Linear(8 * 18 * 18, 2))
        self.seen: list[str] = []

    def train_dataloader(self):
        return self.early if self.early is not None else stream(self.data)

    def training_step(self, batch, batch_idx):
        step_s = float(os.environ.get("SCENARIO_STEP_S", "0"))
        if step_s:
            time.sleep(step_s)
        x, y, paths = batch
        self.seen.extend(paths)
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def main(out: Path, data: str, epochs: int, build_early: bool) -> None:
    trainer = ddp_recipes.build_trainer(
        devices=2, accelerator="cpu", seed=0, max_epochs=epochs, default_root_dir=str(out),
        checkpoint_every_n_steps=1, logger=False, enable_progress_bar=False, enable_model_summary=False)
    model = UserModule(data, build_early)
    trainer.fit(model, ckpt_path="last")
    everyone: list = [None] * trainer.world_size
    torch.distributed.all_gather_object(everyone, model.seen)
    if trainer.is_global_zero:
        (out / "result.json").write_text(json.dumps({"global_step": trainer.global_step, "seen": everyone}))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), "--build-early" in sys.argv[4:])
