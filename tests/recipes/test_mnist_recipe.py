"""recipes.mnist end to end: 1 and 2 processes on the real mini-MNIST, exact evaluation, bad input."""

from __future__ import annotations

import json

import pytest
import torch

from ddp_recipes.data.mnist import load_split
from ddp_recipes.modules.mnist import MNISTClassifier
from recipes import mnist
from tests.helpers import SHARED_DATA, assert_same_weights, write_mnist_subset
from tests.launch import run
from tests.marks import needs_mnist

pytestmark = needs_mnist

SUMMARY_KEYS = {"world_size", "global_batch_size", "epochs", "steps", "fit_seconds", "train_samples_per_sec",
                "test_acc", "final_train_loss", "torch_version", "lightning_version"}


def test_one_device_smoke(tmp_path):
    summary = mnist.main(["--data-dir", str(SHARED_DATA), "--output-dir", str(tmp_path), "--accelerator", "cpu",
                          "--max-steps", "40", "--no-download", "--seed", "3"])
    written = json.loads((tmp_path / "summary.json").read_text())
    assert SUMMARY_KEYS <= set(written)
    assert written["world_size"] == 1 and written["global_batch_size"] == 64 and written["steps"] == 40
    assert written["train_samples_per_sec"] > 0 and written["fit_seconds"] > 0
    assert 0.5 < written["test_acc"] <= 1.0  # 40 SGD steps of the MLP already learn most of MNIST
    assert written["final_train_loss"] < 2.3  # below chance-level cross-entropy, ln(10)
    assert summary["test_acc"] == written["test_acc"]
    assert list((tmp_path / "logs").rglob("metrics.csv")), "CSVLogger metrics missing"


def test_two_devices_exact_evaluation_on_odd_test_set(tmp_path):
    """2 ranks, 1,001 test images: every image counts once, so DDP accuracy == 1-process accuracy."""
    data = write_mnist_subset(tmp_path / "data", n_train=2000, n_test=1001)
    out = tmp_path / "out"
    proc = run(["-m", "recipes.mnist", "--devices", "2", "--accelerator", "cpu", "--data-dir", str(data),
                "--output-dir", str(out), "--max-steps", "30", "--batch-size", "32", "--no-download"], check=True)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["global_batch_size"] == 64 and summary["steps"] == 30
    assert proc.stdout.count("world size") == 1, "the setup block must print once, on rank 0"

    model = MNISTClassifier.load_from_checkpoint(out / "final.ckpt", map_location="cpu").eval()
    images, labels = load_split(data, train=False)
    with torch.no_grad():
        correct = (model(images).argmax(1) == labels).sum().item()
    assert len(labels) == 1001
    assert summary["test_acc"] == pytest.approx(correct / 1001, abs=1e-6)


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--devices", "0"], "--devices"),
        (["--batch-size", "0"], "--batch-size"),
        (["--devices", "2", "--global-batch-size", "100", "--accumulate-grad-batches", "3"], "--global-batch-size"),
        (["--precision", "fp8"], "--precision"),
        (["--arch", "transformer"], "--arch"),
        (["--lr", "-1"], "--lr"),
    ],
)
def test_bad_flags_fail_with_one_line(tmp_path, capsys, args, flag):
    with pytest.raises(SystemExit) as exc:
        mnist.main(["--output-dir", str(tmp_path / "out"), *args])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert flag in err[-1]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("download", [False, True])
def test_missing_or_empty_data_dir(tmp_path, capsys, monkeypatch, download):
    import urllib.request

    def offline(*args, **kwargs):
        raise OSError("network is unreachable")

    monkeypatch.setattr(urllib.request, "urlopen", offline)  # this machine is offline anyway; make it fast
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SystemExit) as exc:
        mnist.main(["--data-dir", str(empty), "--output-dir", str(tmp_path / "out"), "--accelerator", "cpu",
                    "--max-steps", "2"] + ([] if download else ["--no-download"]))
    assert exc.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--data-dir" in last and str(empty) in last
    assert not (tmp_path / "out" / "summary.json").exists()


def test_same_seed_same_weights(tmp_path):
    """The reproducibility contract: same seed, world size and flags give the same weights on CPU."""
    for name in ("a", "b"):
        mnist.main(["--data-dir", str(SHARED_DATA), "--output-dir", str(tmp_path / name), "--accelerator", "cpu",
                    "--max-steps", "30", "--no-download", "--seed", "11"])
    assert_same_weights(tmp_path / "a" / "final.ckpt", tmp_path / "b" / "final.ckpt")


def _five_epoch_default(tmp_path, devices: int) -> dict:
    out = tmp_path / f"d{devices}"
    run(["-m", "recipes.mnist", "--devices", str(devices), "--accelerator", "cpu", "--data-dir", str(SHARED_DATA),
         "--output-dir", str(out), "--no-download"], timeout=900, check=True)
    return json.loads((out / "summary.json").read_text())


@pytest.mark.slow
def test_five_epoch_default_accuracy_one_device(tmp_path):
    """The issue's bar: the write-up's own script reaches 0.9475 on this split at 1 process. Slow (about a
    minute on 2 cores); the fast suite's bar is tests/modules/test_mnist_module.py: one MLP epoch > 0.85 test accuracy
    (a broken data path, loss or optimizer stays near 0.1; one healthy epoch measured 0.9+ here)."""
    summary = _five_epoch_default(tmp_path, 1)
    assert summary["epochs"] == 5 and summary["global_batch_size"] == 64
    assert summary["test_acc"] >= 0.945


@pytest.mark.slow
def test_five_epoch_default_accuracy_two_devices(tmp_path):
    summary = _five_epoch_default(tmp_path, 2)
    assert summary["world_size"] == 2 and summary["global_batch_size"] == 128
    assert summary["test_acc"] >= 0.945


@pytest.mark.slow  # a long multi-process run: make test-slow (keeps make test near 10 min)
def test_validation_set_smaller_than_the_world_is_refused_before_launch(tmp_path):
    """1 validation sample, 2 ranks: exact sharding would leave rank 1 empty. Refused in one line before any rank
    starts (the ranks' own check, for a DataModule of the user's: tests/recipes/test_refused_inputs.py)."""
    data = write_mnist_subset(tmp_path / "data", 256, 16)
    proc = run(["-m", "recipes.mnist", "--accelerator", "cpu", "--devices", "2", "--data-dir", str(data),
                "--no-download", "--val-size", "1", "--max-epochs", "1", "--timeout-s", "120",
                "--output-dir", str(tmp_path / "o")], timeout=100)
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = "error: the validation set has 1 sample(s) for 2 ranks"
    assert proc.stderr.count(line) == 1 and "Traceback" not in proc.stderr and "pass --val-size 2" in proc.stderr
    assert "Initializing distributed" not in proc.stdout + proc.stderr and not (tmp_path / "o").exists()


def test_a_missing_data_dir_with_the_default_output_dir_creates_nothing(tmp_path, capsys, monkeypatch):
    """The default output dir is runs/mnist/version_N under the working directory: a run refused for its data
    leaves neither version_N nor the runs/mnist it made (nor the missing folder's MNIST/raw)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()  # a folder the user had: it stays
    with pytest.raises(SystemExit) as exc:
        mnist.main(["--data-dir", "nope", "--accelerator", "cpu", "--max-steps", "2", "--no-download"])
    assert exc.value.code == 2
    assert "--data-dir" in capsys.readouterr().err.strip().splitlines()[-1]
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == ["runs"]


def test_a_refused_run_after_a_good_one_in_the_same_process_removes_only_its_own_folders(tmp_path, capsys,
                                                                                         monkeypatch):
    """A notebook or a sweep: a good run in one folder, then a refused one in another, where the user's own
    runs/ is empty. The refused run removes what it made, never what the good run (or the user) made."""
    first, second = tmp_path / "first", tmp_path / "second"
    (second / "runs").mkdir(parents=True)
    first.mkdir()
    monkeypatch.chdir(first)
    mnist.main(["--data-dir", str(SHARED_DATA), "--no-download", "--accelerator", "cpu", "--max-steps", "2",
                "--logger", "none"])
    assert (first / "runs" / "mnist" / "version_0" / "summary.json").exists()
    monkeypatch.chdir(second)
    with pytest.raises(SystemExit):
        mnist.main(["--data-dir", "nope", "--accelerator", "cpu", "--max-steps", "2", "--no-download"])
    assert (second / "runs").is_dir() and not list((second / "runs").iterdir())
    assert (first / "runs" / "mnist" / "version_0" / "summary.json").exists()
