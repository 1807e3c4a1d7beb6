"""The inputs a new user meets in the hour after the first run, each refused in one line before any rank starts:
a plain Lightning checkpoint of another model, a one-class or empty-class image folder, a folder too small for
the ranks, a read-only place to write. Exit 2, the line printed once (at 2 ranks too, under torchrun too), naming
the flag or the file and a fix the recipe takes, and nothing left behind."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import lightning as L
import pytest
import torch
from torch import nn

from ddp_recipes.data.mnist import MNISTDataModule
from ddp_recipes.modules.resnet import ResNetClassifier
from recipes import mnist, resnet
from tests.helpers import MNIST_CPU, RESNET_TINY, SHARED_DATA, cpu_trainer, files_of, write_jpeg_tree
from tests.launch import launch_env, run

ERROR = "error: "
LAUNCHED = "Initializing distributed"  # Lightning's line once a rank's process group starts


class Mine(L.LightningModule):
    """A user's own LightningModule, trained with plain Lightning: its weights are ``net.*``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, 8), nn.ReLU(), nn.Linear(8, 10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.fixture(scope="module")
def plain_ckpt(tmp_path_factory):
    """A checkpoint ``trainer.save_checkpoint`` wrote for a user's own model (no pack record, no hyper-parameters)."""
    from torch.utils.data import DataLoader, TensorDataset

    trainer = cpu_trainer(max_steps=1)
    data = TensorDataset(torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,)))
    trainer.fit(Mine(), DataLoader(data, batch_size=4))
    path = tmp_path_factory.mktemp("plain") / "mine.ckpt"
    trainer.save_checkpoint(path)
    return path


def refused_once(proc: subprocess.CompletedProcess) -> str:
    """The one error line of a refused subprocess run: exit 2, printed once, no traceback, no rank started."""
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output[-3000:]
    lines = [line for line in proc.stderr.splitlines() if ERROR in line]
    assert len(lines) == 1 and output.count(lines[0]) == 1, output[-3000:]
    assert "Traceback" not in output and LAUNCHED not in output, output[-3000:]
    return lines[0]


def refusal(main, argv: list[str], capsys) -> str:
    """The one error line of a refused in-process run (``main(argv)`` must exit 2 and print exactly one)."""
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == 2
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if ERROR in line]
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err[-3000:]
    return lines[0]


# ---- a checkpoint of another model ---------------------------------------------------------------------------

def test_a_plain_lightning_checkpoint_is_one_line_before_the_ranks_start(tmp_path, plain_ckpt):
    out = tmp_path / "out"
    before = plain_ckpt.read_bytes()
    proc = run(["-m", "recipes.resnet", *RESNET_TINY, "--devices", "2", "--max-steps", "2", "--resume", str(plain_ckpt),
                "--output-dir", str(out)], timeout=300)
    line = refused_once(proc)
    assert f"--resume {plain_ckpt} does not hold the network this run builds" in line
    assert "names start with 'net.'" in line and "ResNetClassifier has" in line and "'model.'" in line
    assert "missing: model.conv1.weight" in line and "unexpected: net.1.weight" in line
    assert "--resume none" in line and "checkpoints/last.ckpt" in line
    assert not out.exists() and plain_ckpt.read_bytes() == before


def test_a_plain_lightning_checkpoint_in_the_mnist_recipe(tmp_path, plain_ckpt, capsys):
    out = tmp_path / "out"
    line = refusal(mnist.main, [*MNIST_CPU, "--max-steps", "2", "--resume", str(plain_ckpt), "--output-dir", str(out)],
                   capsys)
    assert "does not hold the network this run builds" in line and "MNISTClassifier" in line
    assert "'net.'" in line and "'model.'" in line and "--resume none" in line
    assert not out.exists()


class TinyNet(ResNetClassifier):
    """A user's ``--model-class``: its own network."""

    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, self.hparams.num_classes))


def test_a_plain_checkpoint_against_a_model_class_names_the_subclass(tmp_path, plain_ckpt, capsys):
    line = refusal(lambda argv: resnet.main(argv, model_cls=TinyNet),
                   [*RESNET_TINY, "--max-steps", "2", "--resume", str(plain_ckpt), "--output-dir", str(tmp_path / "o")],
                   capsys)
    assert "this run's TinyNet has 2 starting with 'model.'" in line and "unexpected: net.1.weight" in line
    assert not (tmp_path / "o").exists()


def test_a_checkpoint_without_a_record_of_another_shape_names_the_flags(tmp_path, capsys):
    """The recipe's own network saved without its hyper-parameters (as a script's save_checkpoint of the module
    would): the names match, the head's shape does not; the flags that shape it are the fix."""
    first = tmp_path / "first"
    resnet.main([*RESNET_TINY, "--max-steps", "1", "--output-dir", str(first), "--logger", "none"])
    state = torch.load(first / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    bare = tmp_path / "bare.ckpt"
    torch.save({"state_dict": state["state_dict"], "epoch": 0, "global_step": 1}, bare)
    line = refusal(resnet.main, [*RESNET_TINY, "--num-classes", "5", "--max-steps", "2", "--resume", str(bare),
                                 "--output-dir", str(tmp_path / "o")], capsys)
    assert "model.fc.weight [10, 512] in the file, [5, 512] here" in line
    assert "--arch, --num-classes or --cifar-stem" in line
    assert not (tmp_path / "o").exists()


# ---- image folders that cannot train ----------------------------------------------------------------------------

def _folder(tmp_path, case: str):
    root = tmp_path / case
    if case == "one_class":
        write_jpeg_tree(root, 4, 2, side=16, classes=1)
    elif case == "empty_class":
        write_jpeg_tree(root, 4, 2, side=16, classes=2)
        for split in ("train", "val"):
            (root / split / "c2").mkdir()
    else:  # 2 validation images
        write_jpeg_tree(root, 2, 1, side=16, classes=2)
    return root


FOLDER_CASES = {
    "one_class": ("2", "holds 1 class (c0): a classifier needs 2 or more; add a folder of images per class"),
    "empty_class": ("2", "the class folder train/c2 holds no image file (.jpg"),
    "too_small": ("3", "the validation set has 2 sample(s) for 3 ranks"),
}


@pytest.mark.parametrize("case", FOLDER_CASES)
def test_an_image_folder_that_cannot_train_is_one_line_before_the_ranks_start(tmp_path, case):
    devices, needle = FOLDER_CASES[case]
    root, out = _folder(tmp_path, case), tmp_path / "out"
    before = files_of(root)
    proc = run(["-m", "recipes.resnet", "--accelerator", "cpu", "--data", "imagefolder", "--data-dir", str(root),
                "--image-size", "16", "--batch-size", "1", "--max-steps", "2", "--devices", devices,
                "--output-dir", str(out)], timeout=300)
    line = refused_once(proc)
    assert needle in line and ("--data-dir" in line or "--devices" in line), line
    if case == "too_small":  # a fix this recipe takes: its folder, or fewer ranks (it has no --val-size)
        assert f"put at least 3 images in {root / 'val'}" in line and "or use fewer --devices" in line
        assert "--val-size" not in line
    assert not out.exists() and files_of(root) == before


def test_a_datamodule_subclass_of_the_folder_is_checked_before_launch(tmp_path, capsys):
    from ddp_recipes.data.images import ImageFolderDataModule

    class Photos(ImageFolderDataModule):  # a user's subclass that keeps the pack's setup
        pass

    root = _folder(tmp_path, "empty_class")
    line = refusal(lambda argv: resnet.main(argv, datamodule_cls=Photos),
                   ["--accelerator", "cpu", "--data-dir", str(root), "--image-size", "16", "--batch-size", "1",
                    "--max-steps", "2", "--output-dir", str(tmp_path / "o")], capsys)
    assert "the class folder train/c2 holds no image file" in line and "--data-dir" in line
    assert not (tmp_path / "o").exists()


def test_num_classes_one_is_refused_before_the_network_is_built(tmp_path, capsys):
    line = refusal(resnet.main, [*RESNET_TINY, "--num-classes", "1", "--max-steps", "1",
                                 "--output-dir", str(tmp_path / "o")], capsys)
    assert "--num-classes 1: a classifier needs 2 or more classes" in line
    assert not (tmp_path / "o").exists()


def test_synthetic_validation_smaller_than_the_ranks_names_the_recipes_flag(tmp_path):
    proc = run(["-m", "recipes.resnet", *RESNET_TINY, "--synthetic-val-samples", "1", "--devices", "2",
                "--max-steps", "1", "--output-dir", str(tmp_path / "o")], timeout=300)
    line = refused_once(proc)
    assert "pass --synthetic-val-samples 2 or more, or use fewer --devices" in line
    assert not (tmp_path / "o").exists()


@pytest.mark.skipif(not SHARED_DATA.exists(), reason="needs the shared mini-MNIST")
def test_mnist_validation_smaller_than_the_ranks_under_torchrun_is_printed_once(tmp_path):
    """torchrun runs the recipe's checks in every process: the node's first prints the line, the other exits 2."""
    proc = run(["-m", "recipes.mnist", *MNIST_CPU, "--val-size", "1", "--max-steps", "1",
                "--output-dir", str(tmp_path / "o")], torchrun=2, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-3000:]
    lines = [line for line in output.splitlines() if "recipes.mnist: error:" in line]
    assert len(lines) == 1, output[-3000:]
    assert "the validation set has 1 sample(s) for 2 ranks" in lines[0] and "pass --val-size 2 or more" in lines[0]
    assert not (tmp_path / "o").exists()


class OneValidationImage(MNISTDataModule):
    """A user's DataModule whose own ``setup`` holds out 1 validation image: unknown before the ranks start."""

    def setup(self, stage: str | None = None) -> None:
        self.val_size = 1
        super().setup(stage)


@pytest.mark.slow  # 2 ranks started and stopped (about 20 s here)
@pytest.mark.skipif(not SHARED_DATA.exists(), reason="needs the shared mini-MNIST")
def test_a_validation_set_found_too_small_in_the_ranks_is_printed_once(tmp_path):
    """Every rank knows the sizes and stops alike; rank 0 prints the line."""
    proc = run(["-m", "recipes.mnist", *MNIST_CPU, "--devices", "2", "--max-steps", "1", "--timeout-s", "120",
                "--datamodule-class", f"{__name__}:OneValidationImage", "--output-dir", str(tmp_path / "o")],
               timeout=200)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output[-3000:]
    lines = [line for line in output.splitlines() if "recipes.mnist: error:" in line]
    assert len(lines) == 1 and "the validation set has 1 sample(s) for 2 ranks" in lines[0], output[-3000:]
    assert "Traceback" not in output


# ---- a place that cannot be written ------------------------------------------------------------------------------

def _read_only(folder) -> list[str] | None:
    """A command prefix that runs its command with ``folder`` mounted read-only (a private mount namespace: a
    genuinely read-only place, which even root cannot write), or None where the system allows no such mount."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return None
    script = 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && cd "$0" && exec "$@"'
    probe = subprocess.run([unshare, "-rm", "sh", "-c", script + ' 2>/dev/null', str(folder), "sh", "-c",
                            "! touch probe 2>/dev/null"], capture_output=True)
    return [unshare, "-rm", "sh", "-c", script, str(folder)] if probe.returncode == 0 else None


@pytest.mark.parametrize("recipe", ["mnist", "resnet"])
def test_a_read_only_working_directory_without_output_dir_names_the_flag(tmp_path, recipe):
    prefix = _read_only(tmp_path)
    if prefix is None:
        pytest.skip("no read-only mount can be made here (unshare -rm refused): nothing to test against")
    args = MNIST_CPU if recipe == "mnist" else RESNET_TINY
    proc = subprocess.run([*prefix, sys.executable, "-m", f"recipes.{recipe}", *args, "--devices", "2",
                           "--max-steps", "1"], capture_output=True, text=True, env=launch_env(), timeout=300)
    line = refused_once(proc)
    assert f"no --output-dir given, and the default runs/{recipe}/version_0 cannot be made under {tmp_path}" in line
    assert "Read-only file system" in line and "pass --output-dir DIR on a writable disk" in line
    assert list(tmp_path.iterdir()) == []


def test_an_output_dir_without_write_permission_is_one_line(tmp_path, capsys):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        if os.access(locked, os.W_OK):
            pytest.skip("this process writes through a folder's permissions (root): a read-only mount is tested "
                        "above")
        line = refusal(mnist.main, [*MNIST_CPU, "--max-steps", "1", "--output-dir", str(locked / "run")], capsys)
        assert f"--output-dir {locked / 'run'} is not writable (Permission denied)" in line
        assert list(locked.iterdir()) == []
    finally:
        locked.chmod(0o755)


def test_build_trainer_refuses_a_checkpoint_folder_it_cannot_write_before_any_rank_starts(tmp_path):
    """The library path: ``build_trainer`` in a read-only working directory (Lightning's default_root_dir) is one
    ``ConfigError`` naming ``default_root_dir`` when the Trainer is built, not an ``OSError`` on rank 0 at fit."""
    prefix = _read_only(tmp_path)
    if prefix is None:
        pytest.skip("no read-only mount can be made here (unshare -rm refused): nothing to test against")
    script = ("from ddp_recipes import build_trainer\n"
              "build_trainer(accelerator='cpu', devices=2, max_steps=1, logger=False)\n"
              "print('built')\n")
    proc = subprocess.run([*prefix, sys.executable, "-c", script], capture_output=True, text=True, env=launch_env(),
                          timeout=300)
    assert proc.returncode == 1 and "built" not in proc.stdout, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last == (f"ddp_recipes.errors.ConfigError: default_root_dir: the checkpoint folder {tmp_path}/checkpoints "
                    f"cannot be written (read-only file system at {tmp_path}); pass a writable default_root_dir")
    assert list(tmp_path.iterdir()) == []


class WithSetupLayer(ResNetClassifier):
    """A user's subclass that builds a layer in ``setup`` (which Lightning runs before it restores a checkpoint)."""

    def setup(self, stage):
        if not hasattr(self, "head2"):
            self.head2 = nn.Linear(4, 4)


def test_a_subclass_that_builds_layers_in_setup_keeps_its_own_checkpoint():
    """The check before launch builds the module without its ``setup`` (no trainer, no data there): a class that
    overrides it is left to the load, never refused for the layers only ``setup`` makes."""
    from ddp_recipes.checkpointing.state_match import check_state_fits, meta_module

    built = WithSetupLayer(arch="resnet18", num_classes=10, cifar_stem=True)
    built.setup("fit")
    checkpoint = {"state_dict": built.state_dict()}
    module = meta_module(lambda: WithSetupLayer(arch="resnet18", num_classes=10, cifar_stem=True))
    check_state_fits(checkpoint, "last.ckpt", module, ResNetClassifier, "{arch}")  # no CheckpointError
