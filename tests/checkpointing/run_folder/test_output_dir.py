"""The default output dir is a new ``version_N`` for each run, ``--resume auto`` continues the newest that holds
a run, and a run refused before it wrote anything leaves no ``version_N`` behind."""

from __future__ import annotations

from pathlib import Path

import pytest

from recipes import mnist
from tests.helpers import MNIST_CPU, SHARED_DATA, last_ckpt
from tests.launch import saved_step
from tests.marks import needs_mnist


@needs_mnist
def test_default_output_dirs_never_collide(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    first = mnist.main([*MNIST_CPU, "--max-steps", "2"])
    second = mnist.main([*MNIST_CPU, "--max-steps", "3"])
    runs = tmp_path / "runs" / "mnist"
    assert first["config"]["output_dir"] == str(Path("runs/mnist/version_0"))
    assert second["config"]["output_dir"] == str(Path("runs/mnist/version_1"))
    assert saved_step(last_ckpt(runs / "version_0")) == 2 and saved_step(last_ckpt(runs / "version_1")) == 3
    capsys.readouterr()
    resumed = mnist.main([*MNIST_CPU, "--max-steps", "5", "--resume", "auto"])  # the newest run continues
    assert "--resume auto: continuing the run in runs/mnist/version_1" in capsys.readouterr().out
    assert resumed["steps"] == 5 and saved_step(last_ckpt(runs / "version_0")) == 2
    (runs / "version_2").mkdir()  # another run started a moment ago (its folder is taken, even empty)
    assert mnist.main([*MNIST_CPU, "--max-steps", "1"])["config"]["output_dir"] == str(Path("runs/mnist/version_3"))


@needs_mnist
def test_bad_input_into_the_default_output_dir_leaves_no_version_folder(tmp_path, monkeypatch, capsys):
    """Without --output-dir the run's folder is runs/mnist/version_N, made before the input is checked; a
    refused run removes it again (and takes no N): nothing written."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        mnist.main(["--accelerator", "cpu", "--data-dir", str(SHARED_DATA), "--no-download", "--val-size", "99999"])
    assert info.value.code == 2 and "--val-size" in capsys.readouterr().err
    assert not any((tmp_path / "runs" / "mnist").glob("version_*")), list((tmp_path / "runs").rglob("*"))
