"""recipes.resnet end to end on synthetic data: smoke, resume, cross-world-size checkpoints, bad input."""

from __future__ import annotations

import json

import pytest
import torch

from ddp_recipes.modules.resnet import ResNetClassifier
from recipes import resnet
from tests.helpers import RESNET_TINY as TINY
from tests.helpers import CodeOnLoad, weights
from tests.launch import run

# Tiny but real: ResNet-18 with the CIFAR stem on 16 px images, 64 training images, batch 16.


def test_one_device_smoke(tmp_path):
    summary = resnet.main([*TINY, "--max-steps", "3", "--output-dir", str(tmp_path)])
    assert summary["world_size"] == 1 and summary["steps"] == 3 and summary["arch"] == "resnet18"
    assert 0 <= summary["test_acc"] <= 1 and "test_acc5" in summary
    assert (tmp_path / "checkpoints" / "last.ckpt").exists() and (tmp_path / "summary.json").exists()


@pytest.mark.slow  # a long multi-process run: make test-slow (keeps make test near 10 min)
def test_two_devices_sync_batchnorm_smoke(tmp_path):
    run(["-m", "recipes.resnet", *TINY, "--devices", "2", "--max-steps", "2", "--sync-batchnorm",
         "--output-dir", str(tmp_path)], check=True)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["global_batch_size"] == 32 and summary["steps"] == 2
    assert "test_acc" in summary
    # Checkpoints hold plain BatchNorm keys: loadable by the user's unsynced model.
    state = weights(tmp_path / "checkpoints" / "last.ckpt")
    model = ResNetClassifier(arch="resnet18", num_classes=10, cifar_stem=True)
    model.load_state_dict(state)


@pytest.mark.slow  # tests/checkpointing/test_resume.py kills and resumes at random steps in the fast set
def test_resume_continues_exactly(tmp_path):
    """2 epochs straight == 1 epoch, then --resume auto for the 2nd (constant LR: see
    docs/strategy-and-trainer.md#batch-lr-and-accumulation)."""
    common = [*TINY, "--no-cosine", "--synthetic-val-samples", "0"]
    resnet.main([*common, "--max-epochs", "2", "--output-dir", str(tmp_path / "straight")])
    resnet.main([*common, "--max-epochs", "1", "--output-dir", str(tmp_path / "split")])
    summary = resnet.main([*common, "--max-epochs", "2", "--output-dir", str(tmp_path / "split"), "--resume", "auto"])
    assert summary["resumed_from"].endswith("last.ckpt") and summary["steps"] == 8
    straight = weights(tmp_path / "straight" / "checkpoints" / "last.ckpt")
    resumed = weights(tmp_path / "split" / "checkpoints" / "last.ckpt")
    for key, value in straight.items():
        assert torch.allclose(resumed[key].float(), value.float(), rtol=1e-6, atol=1e-7), key


@pytest.mark.slow  # tests/checkpointing/test_resume.py resizes 2 -> 1 rank in the fast set
def test_checkpoints_cross_world_sizes(tmp_path):
    two = tmp_path / "two"
    run(["-m", "recipes.resnet", *TINY, "--devices", "2", "--max-epochs", "1", "--output-dir", str(two)], check=True)
    ckpt2 = two / "checkpoints" / "last.ckpt"
    summary = resnet.main([*TINY, "--max-epochs", "2", "--resume", str(ckpt2), "--output-dir", str(tmp_path / "one")])
    assert summary["world_size"] == 1 and summary["steps"] == 2 + 4  # 2 steps per epoch at 2 ranks, 4 at 1

    ckpt1 = tmp_path / "one" / "checkpoints" / "last.ckpt"
    run(["-m", "recipes.resnet", *TINY, "--devices", "2", "--max-epochs", "3", "--resume", str(ckpt1),
         "--output-dir", str(tmp_path / "back")], check=True)
    assert json.loads((tmp_path / "back" / "summary.json").read_text())["steps"] == 6 + 2


@pytest.fixture(scope="module")
def existing_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("existing")
    resnet.main([*TINY, "--max-steps", "1", "--output-dir", str(out)])
    return out


def _bad(tmp_path, existing_run, capsys, *args):
    last = existing_run / "checkpoints" / "last.ckpt"
    before = last.read_bytes()
    with pytest.raises(SystemExit) as exc:
        resnet.main([*TINY, "--max-steps", "1", "--output-dir", str(existing_run), *args])
    assert exc.value.code == 2
    assert last.read_bytes() == before, "a bad run must not touch the existing checkpoint"
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_unknown_arch(tmp_path, existing_run, capsys):
    line = _bad(tmp_path, existing_run, capsys, "--arch", "resnet_9000")
    assert "--arch" in line and "torchvision classification model" in line


def test_imagefolder_without_train_and_val(tmp_path, existing_run, capsys):
    (tmp_path / "imgs" / "train").mkdir(parents=True)
    line = _bad(tmp_path, existing_run, capsys, "--data", "imagefolder", "--data-dir", str(tmp_path / "imgs"))
    assert "train" in line and "val" in line and "--data-dir" in line


def test_corrupted_checkpoint(tmp_path, existing_run, capsys):
    broken = tmp_path / "broken.ckpt"
    broken.write_bytes((existing_run / "checkpoints" / "last.ckpt").read_bytes()[:5000])
    line = _bad(tmp_path, existing_run, capsys, "--resume", str(broken))
    assert "--resume" in line and "cut or damaged checkpoint" in line


def test_checkpoint_of_another_architecture(tmp_path, existing_run, capsys):
    line = _bad(tmp_path, existing_run, capsys, "--resume", "auto", "--arch", "resnet34")
    assert "--arch" in line and "resnet18" in line


def test_image_too_small_for_stem(tmp_path, existing_run, capsys):
    line = _bad(tmp_path, existing_run, capsys, "--no-cifar-stem")
    assert "--image-size" in line and "--cifar-stem" in line


def test_checkpoint_that_would_run_code_is_refused(tmp_path, existing_run, capsys):
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.ckpt"
    state = torch.load(existing_run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    torch.save({**state, "extra": CodeOnLoad(str(marker))}, evil)
    line = _bad(tmp_path, existing_run, capsys, "--resume", str(evil))
    assert "--resume" in line and "refused" in line and "io.open" in line  # names what it would have run
    assert not marker.exists(), "the checkpoint's code ran"


def test_checkpoint_of_the_other_recipe(tmp_path, existing_run, capsys):
    from recipes import mnist
    from tests.helpers import SHARED_DATA

    with pytest.raises(SystemExit) as exc:
        mnist.main(["--accelerator", "cpu", "--data-dir", str(SHARED_DATA), "--no-download", "--max-steps", "1",
                    "--output-dir", str(tmp_path), "--resume", str(existing_run / "checkpoints" / "last.ckpt")])
    assert exc.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "ResNetClassifier, which this recipe does not build" in line and "another recipe" in line
    assert "pass --arch resnet18" not in line


def test_plain_data_hyperparameters_still_load(tmp_path, existing_run):
    """A user's hparams holding a Path, an argparse Namespace or numpy scalars rebuild no code: accepted."""
    import argparse
    from pathlib import Path

    import numpy as np

    from ddp_recipes.checkpointing.checkpoint import read_checkpoint

    state = torch.load(existing_run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    state["hyper_parameters"] = {**state["hyper_parameters"], "root": Path("/data"), "args": argparse.Namespace(a=1),
                                 "score": np.float64(0.5), "n": np.int64(3)}
    torch.save(state, tmp_path / "user.ckpt")
    loaded = read_checkpoint(str(tmp_path / "user.ckpt"))["hyper_parameters"]
    assert loaded["root"] == Path("/data") and loaded["args"].a == 1 and loaded["score"] == 0.5
