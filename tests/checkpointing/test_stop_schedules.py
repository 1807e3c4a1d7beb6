"""Stops one after another, each resumed with ``--resume auto``: the run ends at its limit, bit-identical to the
uninterrupted one (issue #43).

The schedule that failed: a SIGTERM agreed at an epoch's last step, the resumed run killed two steps into
the next epoch, then resumed again. Lightning 2.6 restored the first checkpoint with the next epoch never
opened, so the second checkpoint read "no epoch in progress" and the last run trained that whole epoch again
(26 steps where 3 epochs x 8 imply 24). ``open_next_epoch`` fixes it; ``RunPosition`` fails such a run at its
first batch instead of letting it train.

2 gloo ranks, ResNet-18 on 16 px crops of a JPEG folder (random crops in 1 loader worker per rank), a
checkpoint at every step. Faults come from tests/scenarios/reliability_scenarios.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import assert_same_weights, write_jpeg_tree
from tests.launch import run

ROOT = Path(__file__).resolve().parents[2]
SCENARIO = ROOT / "tests" / "scenarios" / "reliability_scenarios.py"
# 64 train images / (4 per device x 2 ranks) = 8 steps per epoch; 3 epochs = 24 steps.
STEPS_PER_EPOCH, EPOCHS = 8, 3
CLEAN = dict(drop_prefixes=("TORCHELASTIC_", "REL_", "SLURM_"), drop=("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                                     "MASTER_ADDR"), threads=1)


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    return write_jpeg_tree(tmp_path_factory.mktemp("jpegs"), per_class=32, val_per_class=4, side=20)


def flags(images: Path, out: Path, *extra: str) -> list[str]:
    return ["--accelerator", "cpu", "--data", "imagefolder", "--data-dir", str(images), "--image-size", "16",
            "--min-crop-scale", "0.3", "--batch-size", "4", "--num-workers", "1", "--lr", "0.05", "--no-cosine",
            "--devices", "2", "--max-epochs", str(EPOCHS), "--checkpoint-every-n-steps", "1", "--timeout-s", "30",
            "--output-dir", str(out), *extra]


def saved(out: Path) -> dict:
    ckpt = torch.load(out / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    return {"step": ckpt["global_step"], "epoch": ckpt["epoch"]}


@pytest.mark.slow  # 4 two-rank runs
def test_sigterm_at_an_epochs_last_step_then_a_lost_rank_resumes_exactly(images, tmp_path):
    straight = tmp_path / "straight"
    run(["-m", "recipes.resnet", *flags(images, straight)], timeout=600, check=True, **CLEAN)
    out = tmp_path / "split"
    # SIGTERM to rank 1 during step 15: agreed at the next boundary, step 16, epoch 1's last.
    term = run([SCENARIO, "resnet", *flags(images, out)], timeout=600, **CLEAN,
               env=dict(REL_FAULT="term", REL_STEP="14", REL_MARKER=str(tmp_path / "term")))
    assert term.returncode == 143, term.stdout[-3000:] + term.stderr[-3000:]
    assert saved(out)["step"] == 2 * STEPS_PER_EPOCH
    # Resumed there; rank 1 dies at the start of step 19 (the last checkpoint: step 18, epoch 2's second).
    crash = run([SCENARIO, "resnet", *flags(images, out, "--resume", "auto")], timeout=600, **CLEAN,
                env=dict(REL_FAULT="crash", REL_STEP="18", REL_MARKER=str(tmp_path / "crash")))
    assert crash.returncode != 0 and saved(out)["step"] == 18, crash.stderr[-3000:]
    done = run(["-m", "recipes.resnet", *flags(images, out, "--resume", "auto")], timeout=600, **CLEAN)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == EPOCHS * STEPS_PER_EPOCH, summary["steps"]
    assert_same_weights(out / "checkpoints" / "last.ckpt", straight / "checkpoints" / "last.ckpt")
