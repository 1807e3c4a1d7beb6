"""A normal 2-rank recipe run prints the pack's lines once and in its own words: none of Lightning's adverts,
deprecations it causes, or messages naming Trainer arguments the recipe owns; no source line under a warning;
counters in summary.json summed over the ranks (issue #40.6, #40.8)."""

from __future__ import annotations

import json

from PIL import Image

from tests.helpers import write_jpeg_tree
from tests.launch import run

NOISE = ("LeafSpec", "💡", "litlogger", "litmodels", "Total Flops", "Trainer(log_every_n_steps",
         "Skipping setting a default", "rank_zero_warn(")


def test_a_two_rank_run_says_each_thing_once_in_its_own_words(tmp_path):
    root = write_jpeg_tree(tmp_path / "imgs", per_class=8, val_per_class=2, side=24)
    for i in range(8):  # one class all PNG named .jpg: nvJPEG refuses them, the CPU decodes them (both ranks)
        Image.new("RGB", (24, 24), (200, 10 * i, 10)).save(root / "train" / "c1" / f"{i}.png")
        (root / "train" / "c1" / f"{i}.jpg").unlink()
    out = tmp_path / "out"
    done = run(["-m", "recipes.resnet", "--accelerator", "cpu", "--devices", "2", "--data", "imagefolder",
                "--data-dir", str(root), "--image-size", "16", "--batch-size", "2", "--num-workers", "0",
                "--decode", "gpu", "--max-epochs", "1", "--log-every-n-steps", "9", "--output-dir", str(out)],
               timeout=600, check=True, quiet=False)
    text = done.stdout + done.stderr
    assert not [word for word in NOISE if word in text], text[-4000:]
    assert "--log-every-n-steps 9 is more than the 4 training batch(es) of an epoch" in text
    assert text.count("are not named .jpg/.jpeg") == 1
    lines = [line.strip() for line in text.splitlines() if "warn" in line.lower() and line.strip()]
    assert len(lines) == len(set(lines)), lines  # no line twice
    decode = json.loads((out / "summary.json").read_text())["decode"]
    assert decode["cpu_fallbacks"] >= 8  # every training PNG, whichever rank trained it (rank 0 alone: ~4)


def test_the_quick_start_on_synthetic_data_says_its_labels_are_random_and_nothing_else(tmp_path):
    """The README's ResNet quick start (fewer steps): its default logging interval against a short synthetic
    epoch is the recipe's own choice, so no warning about it; and one line says the labels are random, so
    nobody reads its accuracy as a result."""
    done = run(["-m", "recipes.resnet", "--devices", "1", "--data", "synthetic", "--max-steps", "2",
                "--accelerator", "cpu", "--synthetic-samples", "64", "--synthetic-val-samples", "32",
                "--batch-size", "16", "--output-dir", str(tmp_path / "out")], timeout=600, check=True, quiet=False)
    text = done.stdout + done.stderr
    assert "--log-every-n-steps" not in text, text[-4000:]
    data = [line for line in text.splitlines() if line.startswith("data ")]
    assert len(data) == 1 and "random labels" in data[0] and "chance (10%)" in data[0], text[-4000:]
