"""Bring your own model: a user's module and DataModule through both recipes, at 2 ranks, resumed."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from ddp_recipes.checkpointing.checkpoint import read_checkpoint
from ddp_recipes.data.mnist import load_split
from ddp_recipes.errors import ConfigError
from ddp_recipes.modules.mnist import MNISTClassifier
from ddp_recipes.train.userclass import follow_checkpoint, resolve_classes, same_class, source_file
from recipes import mnist, resnet
from tests.helpers import SHARED_DATA, raises_cli
from tests.launch import run
from tests.marks import needs_mnist

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TINY_RESNET = ["--accelerator", "cpu", "--data", "synthetic", "--image-size", "16", "--synthetic-samples", "64",
               "--synthetic-val-samples", "32", "--batch-size", "16"]



FINDS_PACK = "import importlib.util, sys; sys.exit(importlib.util.find_spec('ddp_recipes') is None)"


def _pack_installed() -> bool:
    """Whether this interpreter imports the pack with nothing but its own site-packages: the checkout's
    ``ddp_recipes.egg-info`` (left by ``make install``'s editable install) makes the distribution's metadata
    visible from the checkout on a stack where the pack is not installed (CI's second job), so metadata cannot
    tell."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    probe = subprocess.run([sys.executable, "-c", FINDS_PACK], cwd=tempfile.gettempdir(), env=env,
                           capture_output=True)
    return probe.returncode == 0


# A user's command, from the examples folder (the user's project), on a free port, with only what a user
# has: the installed pack and the working directory (no PYTHONPATH); where the pack runs from a source
# checkout, not installed (the lent GPU machine), the PYTHONPATH to it that such a user sets. It must exit 0.
USER = dict(cwd=EXAMPLES, pythonpath=not _pack_installed(), check=True)


def mnist_flags(out: Path, *extra: str) -> list[str]:
    return ["--accelerator", "cpu", "--data-dir", str(SHARED_DATA), "--no-download", "--output-dir", str(out),
            "--batch-size", "32", "--val-size", "256", *extra]


def summary_of(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


@pytest.fixture
def examples_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    monkeypatch.chdir(EXAMPLES)


# ---- a class defined in the user's own script, 2 ranks, resumed by running the script again ------------

@needs_mnist
@pytest.mark.slow  # a long multi-process run: make test-slow (keeps make test near 10 min)
def test_script_subclass_two_ranks_every_feature_then_resume(tmp_path, capsys):
    out = tmp_path / "out"
    first = run(["my_model.py", *mnist_flags(out, "--devices", "2", "--max-steps", "12", "--lr-scaling", "none",
                                             "--batch-size", "64")], quiet=False, **USER)
    assert first.stdout.count("world size") == 1, "the set-up block prints once, on rank 0"
    assert "world size       2" in first.stdout and "128 global" in first.stdout
    # DDPDiagnostics ran on the user's module: global batch 128, LR tuned for 64, no scaling, no warm-up.
    assert "[lr-not-scaled]" in first.stderr
    summary = summary_of(out)
    assert summary["model_class"] == "__main__:DropoutCNN" and summary["world_size"] == 2 and summary["steps"] == 12
    assert 0 < summary["test_acc"] <= 1
    ckpt = read_checkpoint(str(out / "checkpoints" / "last.ckpt"))
    assert ckpt["ddp_recipes"]["model_class"] == "__main__:DropoutCNN"
    assert ckpt["hyper_parameters"]["dropout"] == 0.25 and ckpt["hyper_parameters"]["width"] == 16
    assert ckpt["state_dict"]["model.0.weight"].shape == (16, 1, 3, 3)  # the user's network, not the MLP

    # The recipe alone cannot import a class from a script: one line says how to resume it.
    with pytest.raises(SystemExit) as exit_info:
        mnist.main(mnist_flags(out, "--resume", "auto"))
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and err.count("\n") == 0
    assert "__main__:DropoutCNN" in err and "run that script again" in err

    # Running the script again resumes the same class, at 2 ranks, from step 12.
    run(["my_model.py", *mnist_flags(out, "--devices", "2", "--max-steps", "20", "--lr-scaling", "none",
                                     "--batch-size", "64", "--resume", "auto")], **USER)
    resumed = summary_of(out)
    assert resumed["steps"] == 20 and resumed["resumed_from"].endswith("last.ckpt")
    assert resumed["model_class"] == "__main__:DropoutCNN"
    final = read_checkpoint(str(out / "final.ckpt"))
    assert final["state_dict"]["model.0.weight"].shape == (16, 1, 3, 3) and final["global_step"] == 20


@pytest.mark.slow
@needs_mnist
def test_script_subclass_under_torchrun(tmp_path):
    out = tmp_path / "out"
    run(["my_model.py", *mnist_flags(out, "--max-steps", "6")], torchrun=2, **USER)
    summary = summary_of(out)
    assert summary["model_class"] == "__main__:DropoutCNN" and summary["world_size"] == 2 and summary["steps"] == 6


# ---- by import path: --model-class and --datamodule-class, 2 ranks, resume rebuilds both ---------------

def write_npz(dest: Path, n_train: int, n_test: int) -> Path:
    """A user's own arrays: MNIST images stored as uint8 npz, a split the recipe never made."""
    dest.mkdir(parents=True, exist_ok=True)
    for name, train, count in (("train.npz", True, n_train), ("test.npz", False, n_test)):
        x, y = load_split(SHARED_DATA, train=train)
        x = ((x - x.min()) / (x.max() - x.min()) * 255).round().to(torch.uint8)
        # The last images of the split, not the first ones the recipe's own tests use.
        np.savez(dest / name, x=x[-count:].numpy(), y=y[-count:].numpy())
    return dest


@needs_mnist
@pytest.mark.slow  # a long multi-process run: make test-slow (keeps make test near 10 min)
def test_import_paths_two_ranks_then_resume_rebuilds_both_classes(tmp_path, monkeypatch):
    # 400 images, 40 held out by the DataModule: 180 per rank, 12 batches of 16 per epoch.
    data, out = write_npz(tmp_path / "npz", 400, 301), tmp_path / "out"
    common = ["--accelerator", "cpu", "--data-dir", str(data), "--output-dir", str(out), "--global-batch-size", "32",
              "--checkpoint-every-n-steps", "5"]
    run(["-m", "recipes.mnist", *common, "--devices", "2", "--model-class", "my_model:DropoutCNN",
         "--datamodule-class", "my_data:NpzDataModule", "--max-steps", "14"], **USER)
    summary = summary_of(out)
    assert summary["model_class"] == "my_model:DropoutCNN"
    assert summary["datamodule_class"] == "my_data:NpzDataModule"
    assert summary["world_size"] == 2 and summary["global_batch_size"] == 32
    assert "test_acc" in summary  # the user's test split, sharded exactly
    assert (out / "checkpoints" / "best.ckpt").exists()  # the user's validation split drives best.ckpt
    # No class flags: the checkpoint's record rebuilds both classes (here in one process: the rebuild is
    # the same on every rank, and a resize from 2 ranks is a supported resume).
    monkeypatch.syspath_prepend(str(EXAMPLES))
    monkeypatch.chdir(EXAMPLES)
    monkeypatch.setenv("PYTHONWARNINGS", "ignore")
    mnist.main([*common, "--devices", "1", "--max-steps", "18", "--resume", "auto"])
    resumed = summary_of(out)
    assert resumed["steps"] == 18
    assert resumed["model_class"] == "my_model:DropoutCNN"
    assert resumed["datamodule_class"] == "my_data:NpzDataModule"


def test_resnet_hooks_optimizer_loss_metrics_keep_scaling_and_schedule(tmp_path, examples_on_path):
    """AdamW from build_optimizer still gets the scaled LR and the warm-up/cosine schedule."""
    from my_resnet import AdamWResNet

    out = tmp_path / "out"
    # Global batch 16 from base LR 1e-3 at batch 8, linear: peak 2e-3; 4 batches per epoch, 1-epoch warm-up.
    summary = resnet.main([*TINY_RESNET, "--output-dir", str(out), "--lr", "1e-3", "--lr-reference-batch", "8",
                           "--max-epochs", "2", "--warmup-epochs", "1", "--cosine"], model_cls=AdamWResNet)
    assert summary["model_class"] == "my_resnet:AdamWResNet"
    assert {"test_acc", "test_acc5", "test_f1"} <= set(summary)
    ckpt = read_checkpoint(str(out / "checkpoints" / "last.ckpt"))
    groups = ckpt["optimizer_states"][0]["param_groups"]
    assert "betas" in groups[0], "AdamW's state, not SGD's"
    assert [g["weight_decay"] for g in groups] == [5e-4, 0.0]  # param_groups() of the base still applies
    assert ckpt["lr_schedulers"][0]["base_lrs"] == pytest.approx([2e-3, 2e-3])
    # 8 steps = 4 warm-up + 4 cosine: the LR after the last step is the cosine's value at step 8 of 8.
    steps, warm = 8, 4
    expected = 2e-3 * 0.5 * (1 + math.cos(math.pi * (steps - warm) / (steps - warm)))
    assert groups[0]["lr"] == pytest.approx(expected, abs=1e-9)


def test_optimizer_that_ignores_the_scaled_lr_is_named(tmp_path, recwarn):
    class FixedLR(MNISTClassifier):
        def build_optimizer(self, param_groups):
            return torch.optim.SGD(param_groups, lr=0.5)

    model = FixedLR(lr=0.02)
    # No warm-up, no cosine: the schedule needs nothing of the trainer but its step counts.
    model.trainer = type("T", (), {"estimated_stepping_batches": 10, "num_training_batches": 10,
                                   "accumulate_grad_batches": 1})()
    optimizer = model.configure_optimizers()
    assert optimizer.param_groups[0]["lr"] == 0.5
    assert any("build_optimizer() put no parameter group at self.hparams.lr" in str(w.message) for w in recwarn)


def test_subclass_monitor_drives_best_checkpoint(tmp_path):
    from ddp_recipes.config.run_config import RunConfig
    from ddp_recipes.train.checkpoints import checkpoint_callbacks

    class LossMonitored(MNISTClassifier):
        monitor = "val_loss"

    best = checkpoint_callbacks(RunConfig(output_dir=str(tmp_path)), has_val=True, model_class=LossMonitored)[-1]
    assert best.monitor == "val_loss" and best.mode == "min"

    class Typo(MNISTClassifier):
        monitor = "val_accuracy"

    with pytest.raises(ConfigError, match="monitor is 'val_accuracy'"):
        Typo()

    class LossMetric(MNISTClassifier):
        def build_metrics(self):
            return {**super().build_metrics(), "loss": MeanMetricLike()}

    with pytest.raises(ConfigError, match="named 'loss'"):
        LossMetric()


class MeanMetricLike(torch.nn.Module):
    pass


class ReqArg(MNISTClassifier):
    def __init__(self, hidden: int, **kwargs) -> None:
        super().__init__(**kwargs)


class NoKwargs(MNISTClassifier):
    def __init__(self, hidden: int = 64) -> None:
        super().__init__()


@pytest.mark.parametrize(("cls", "needle"), [(ReqArg, "requires hidden"), (NoKwargs, "does not take arch")])
def test_model_class_the_recipe_cannot_construct_fails_in_one_line(tmp_path, capsys, cls, needle):
    with pytest.raises(SystemExit) as exit_info:
        mnist.main(["--accelerator", "cpu", "--output-dir", str(tmp_path / "out")], model_cls=cls)
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and needle in err and "--model-class" in err and err.count("\n") == 0
    assert not (tmp_path / "out").exists()


def test_module_that_raises_on_import_fails_in_one_line(tmp_path, capsys, monkeypatch):
    (tmp_path / "raiser.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for spec, needle in (("raiser:Net", "RuntimeError: boom at import"), (".relative:Net", "absolute import path")):
        with pytest.raises(SystemExit):
            mnist.main(["--accelerator", "cpu", "--output-dir", str(tmp_path / "out"), "--model-class", spec])
        err = capsys.readouterr().err.strip()
        assert needle in err and err.count("\n") == 0


def test_batch_of_a_batch_sampler_loader_is_read_from_the_sampler(tmp_path, capsys):
    import lightning as L
    from torch.utils.data import BatchSampler, DataLoader, RandomSampler, TensorDataset

    from ddp_recipes.data.samplers import loader_batch_size

    data = TensorDataset(torch.randn(256, 1, 28, 28), torch.randint(0, 10, (256,)))

    class Sampled(L.LightningDataModule):
        def __init__(self, batch_size: int, **kwargs) -> None:  # **kwargs: takes every offered argument
            super().__init__()
            self.batch_size, self.actual = batch_size, kwargs.get("actual", batch_size)

        def train_dataloader(self):
            return DataLoader(data, batch_sampler=BatchSampler(RandomSampler(data), self.actual, False))

    loader = Sampled(32).train_dataloader()
    assert loader.batch_size is None and loader_batch_size(loader) == 32
    # Lightning's DDP re-creation of such a loader sets DataLoader.batch_size to 1: the sampler still says 32.
    assert loader_batch_size(type("Recreated", (), {"batch_size": 1, "batch_sampler": loader.batch_sampler})()) == 32
    summary = mnist.main(["--accelerator", "cpu", "--output-dir", str(tmp_path / "ok"), "--batch-size", "32",
                          "--max-steps", "2"], datamodule_cls=Sampled)
    assert summary["steps"] == 2

    class Wrong(Sampled):
        def __init__(self, batch_size: int, **kwargs) -> None:
            super().__init__(batch_size, actual=16)

    with pytest.raises(SystemExit):
        mnist.main(["--accelerator", "cpu", "--output-dir", str(tmp_path / "bad"), "--batch-size", "32",
                    "--max-steps", "2"], datamodule_cls=Wrong)
    assert "batch_size 16 but the run plans 32" in capsys.readouterr().err


# ---- bad input: one line naming the flag, exit 2 ----------------------------------------------------

class NotAModule:
    pass


class NoBatchSize(torch.nn.Module):
    pass


@pytest.mark.parametrize(("flags", "needle"), [
    (["--model-class", "my_model.DropoutCNN"], "package.module:ClassName"),
    (["--model-class", "no_such_module_xyz:Net"], "cannot import no_such_module_xyz"),
    (["--model-class", "my_model:NoSuchNet"], "has no 'NoSuchNet'"),
    (["--model-class", "my_resnet:AdamWResNet"], "does not subclass ddp_recipes.modules.mnist.MNISTClassifier"),
    (["--model-class", "my_model:sys"], "not a class"),
    (["--datamodule-class", "my_model:DropoutCNN"], "does not subclass lightning"),
    (["--model-class", "__main__:Net"], "defined in a script"),
])
def test_bad_class_flags_fail_in_one_line(tmp_path, capsys, examples_on_path, flags, needle):
    with pytest.raises(SystemExit) as exit_info:
        mnist.main(["--accelerator", "cpu", "--output-dir", str(tmp_path / "out"), *flags])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and needle in err and flags[0] in err
    assert not (tmp_path / "out").exists(), "nothing is written before the flags are accepted"


def test_python_class_errors(tmp_path, capsys, examples_on_path):
    from my_model import DropoutCNN

    for kwargs, needle in (({"model_cls": NotAModule}, "model_cls"),
                           ({"datamodule_cls": NoBatchSize}, "datamodule_cls")):
        with pytest.raises(SystemExit):
            mnist.main(["--accelerator", "cpu", "--output-dir", str(tmp_path)], **kwargs)
        assert needle in capsys.readouterr().err
    with pytest.raises(SystemExit):  # the flag and the argument must agree
        mnist.main(["--accelerator", "cpu", "--model-class", "my_model:DropoutCNN"], model_cls=MNISTClassifier)
    assert "name different classes" in capsys.readouterr().err
    assert resolve_classes(MNISTClassifier, DropoutCNN, model_spec="my_model:DropoutCNN").model is DropoutCNN


def test_datamodule_without_batch_size_or_with_unknown_required_arg(tmp_path, capsys):
    import lightning as L

    class NoBatch(L.LightningDataModule):
        def __init__(self, data_dir: str) -> None:
            super().__init__()

    class NeedsToken(L.LightningDataModule):
        def __init__(self, batch_size: int, token: str) -> None:
            super().__init__()

    for cls, needle in ((NoBatch, "must take batch_size"), (NeedsToken, "requires token")):
        with pytest.raises(SystemExit):
            mnist.main(["--accelerator", "cpu", "--output-dir", str(tmp_path)], datamodule_cls=cls)
        err = capsys.readouterr().err.strip()
        assert needle in err and "--datamodule-class" in err and err.count("\n") == 0


def test_resnet_image_size_must_be_the_user_datas(tmp_path, capsys):
    import lightning as L

    class Photos(L.LightningDataModule):
        num_classes = 5

        def __init__(self, batch_size: int) -> None:
            super().__init__()
            self.image_size = 224  # the stem and the input check follow --image-size: a mismatch is named

    with pytest.raises(SystemExit):
        resnet.main([*TINY_RESNET, "--output-dir", str(tmp_path)], datamodule_cls=Photos)
    err = capsys.readouterr().err.strip()
    assert "--image-size 16 but Photos.image_size is 224; pass --image-size 224" in err and err.count("\n") == 0


# ---- the resume rules, on checkpoint records ----------------------------------------------------------

def test_follow_checkpoint_rules(examples_on_path):
    from my_model import DropoutCNN

    def record(model, datamodule=None):
        return {"ddp_recipes": {"model_class": model, "datamodule_class": datamodule}}

    plain = resolve_classes(MNISTClassifier)
    # A recorded importable class is imported when none is given.
    assert follow_checkpoint(plain, record("my_model:DropoutCNN"), "c.ckpt").model is DropoutCNN
    followed = follow_checkpoint(plain, record("ddp_recipes.modules.mnist:MNISTClassifier", "my_data:NpzDataModule"),
                                 "c.ckpt")
    assert followed.model is None and followed.datamodule.__name__ == "NpzDataModule"
    # A given class must be the recorded one; a script's class matches by name.
    given = resolve_classes(MNISTClassifier, DropoutCNN)
    assert follow_checkpoint(given, record("__main__:DropoutCNN"), "c.ckpt").model is DropoutCNN
    with raises_cli(ConfigError, match="trained with ddp_recipes.modules.mnist:MNISTClassifier .* drop --model-class"):
        follow_checkpoint(given, record("ddp_recipes.modules.mnist:MNISTClassifier"), "c.ckpt")
    with pytest.raises(ConfigError, match="another recipe"):
        follow_checkpoint(plain, record("ddp_recipes.modules.resnet:ResNetClassifier"), "c.ckpt")
    with raises_cli(ConfigError, match="drop --datamodule-class"):
        follow_checkpoint(resolve_classes(MNISTClassifier, datamodule_cls=followed.datamodule),
                          record("ddp_recipes.modules.mnist:MNISTClassifier"), "c.ckpt")
    # Checkpoints written before classes were recorded are not checked.
    assert follow_checkpoint(given, {"state_dict": {}}, "old.ckpt") is given
    assert not same_class("other:DropoutCNN", DropoutCNN)
    # A script's class (__main__:Name) matches by name *and* defining file: not another script's namesake.
    here = source_file(DropoutCNN)
    assert same_class("__main__:DropoutCNN", DropoutCNN, here)
    assert not same_class("__main__:DropoutCNN", DropoutCNN, "/elsewhere/other_script.py")
    elsewhere = {"ddp_recipes": {"model_class": "__main__:DropoutCNN", "model_file": "/elsewhere/other_script.py"}}
    with pytest.raises(ConfigError, match="trained with __main__:DropoutCNN"):
        follow_checkpoint(given, elsewhere, "c.ckpt")
    # Another recipe's checkpoint says so, also when a class is given.
    with pytest.raises(ConfigError, match="another recipe"):
        follow_checkpoint(given, record("ddp_recipes.modules.resnet:ResNetClassifier"), "c.ckpt")


# ---- --arch: the torchvision model zoo ---------------------------------------------------------------

def test_every_resnet_family_arch_builds_with_the_recipe_features():
    from ddp_recipes.modules.architectures import RESNET_FAMILY, build_arch

    assert {"resnet18", "resnet152", "resnext50_32x4d", "resnext101_64x4d", "wide_resnet50_2"} <= set(RESNET_FAMILY)
    for arch in RESNET_FAMILY:
        with torch.device("meta"):  # shapes only: no 60M-parameter allocations
            model = build_arch(arch, num_classes=7, cifar_stem=True, dropout=0.1)
            out = model.eval()(torch.empty(2, 3, 16, 16))
        assert out.shape == (2, 7) and model.conv1.stride == (1, 1), arch
        assert isinstance(model.fc[0], torch.nn.Dropout)


@pytest.mark.parametrize(("flags", "needle"), [
    (["--arch", "efficientnet_b0", "--cifar-stem"], "--cifar-stem"),
    (["--arch", "vit_b_16", "--image-size", "224", "--grad-checkpointing"], "--grad-checkpointing"),
    (["--arch", "convnext_tiny", "--dropout", "0.2"], "--dropout"),
    (["--arch", "vit_b_16", "--image-size", "32"], "does not fit --arch vit_b_16"),
    (["--arch", "resnet_9000"], "torchvision classification model"),
])
def test_arch_feature_errors(tmp_path, capsys, flags, needle):
    with pytest.raises(SystemExit) as exit_info:
        resnet.main([*TINY_RESNET, "--output-dir", str(tmp_path), *flags])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and err.count("\n") == 0


def test_other_torchvision_model_trains(tmp_path):
    summary = resnet.main([*TINY_RESNET, "--image-size", "32", "--arch", "mobilenet_v3_small", "--dropout", "0.3",
                           "--max-steps", "2", "--output-dir", str(tmp_path)])
    assert summary["arch"] == "mobilenet_v3_small" and summary["steps"] == 2
    hp = read_checkpoint(str(tmp_path / "checkpoints" / "last.ckpt"))["hyper_parameters"]
    assert hp["arch"] == "mobilenet_v3_small" and hp["cifar_stem"] is False and hp["dropout"] == 0.3
