"""Experiment tracking against the real back-ends, 2 gloo ranks: TensorBoard event files read back with
tensorboard's own reader, CSV rows, W&B offline run folders, a real ``mlflow server`` (SQLite store) queried
for params, metrics and the run id; one tracker run per job across SIGTERM and ``--resume auto``."""

from __future__ import annotations

import csv
import importlib.util
import json
import signal
import sys
import urllib.request
from pathlib import Path

import pytest

from ddp_recipes.errors import ConfigError
from ddp_recipes.train.callbacks import ThroughputMeter
from recipes import mnist
from tests.helpers import SHARED_DATA, free_port, raises_cli, write_mnist_subset
from tests.launch import run, saved_step, start
from tests.marks import needs_mnist

pytestmark = needs_mnist
# The trackers' packages are extras (the lent GPU machine has neither): their tests skip, naming the extra.
needs_mlflow = pytest.mark.skipif(importlib.util.find_spec("mlflow") is None,
                                  reason="needs mlflow: pip install -e '.[mlflow]' (or the dev extra)")
needs_wandb = pytest.mark.skipif(importlib.util.find_spec("wandb") is None,
                                 reason="needs wandb: pip install -e '.[wandb]' (or the dev extra)")

MNIST = ["-m", "recipes.mnist"]
LIVE = {"train/samples_per_sec", "train/device/samples_per_sec", "train/step_time", "train/input_wait_fraction",
        "train/lr"}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_mnist_subset(tmp_path_factory.mktemp("mnist"), n_train=1024, n_test=128)


def args(data: Path, out: Path, *extra: str) -> list[str]:
    # 1024 images / (32 per device x 2 ranks) = 16 steps per epoch.
    return ["--devices", "2", "--accelerator", "cpu", "--data-dir", str(data), "--no-download", "--batch-size", "32",
            "--output-dir", str(out), "--log-every-n-steps", "2", *extra]


def scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of a TensorBoard run folder, as tensorboard reads it: tag -> [(step, value)]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def hparams(folder: Path) -> dict[str, object]:
    """The HParams session a TensorBoard run folder holds (what the HParams tab shows)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    acc = EventAccumulator(str(folder))
    acc.Reload()
    found: dict[str, object] = {}
    for content in acc.PluginTagToContent("hparams").values():
        data = plugin_data_pb2.HParamsPluginData.FromString(content)
        if data.HasField("session_start_info"):
            for key, value in data.session_start_info.hparams.items():
                found[key] = getattr(value, value.WhichOneof("kind"))
    return found


def csv_rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def wandb_runs(out: Path) -> list[str]:
    """The W&B run ids of the offline run folders under ``out`` (one folder per process that ran)."""
    folders = sorted((out / "wandb").glob("offline-run-*"))
    for folder in folders:
        assert (folder / f"run-{folder.name.rsplit('-', 1)[1]}.wandb").is_file(), f"no run file in {folder}"
    return [folder.name.rsplit("-", 1)[1] for folder in folders]


def assert_steps_continue(points: list[tuple[int, float]], resumed_at: int) -> None:
    steps = [s for s, _ in points]
    assert steps == sorted(set(steps)), f"steps restart or repeat: {steps}"
    assert steps[0] < resumed_at < steps[-1], steps


@pytest.mark.slow  # a long multi-process run: make test-slow (keeps make test near 10 min)
def test_two_ranks_log_once_and_resume_continues_the_same_tracker_runs(data, tmp_path):
    """csv + tensorboard, 2 ranks: one run in each; the continued run (``--resume auto`` with more steps) logs
    into the same version folders, its steps after the checkpoint's. The continuation runs in this process
    on 1 device at the same global batch (a second 2-rank launch would double the test's time; the slow
    SIGTERM tests below resume at 2 ranks, W&B's run folders and id included: its service costs seconds
    per process)."""
    out = tmp_path / "run"
    trackers = ["--logger", "csv,tensorboard"]
    run([*MNIST, *args(data, out, "--max-steps", "6", *trackers)], timeout=300, check=True)
    first = json.loads((out / "summary.json").read_text())["trackers"]
    assert first["csv"]["version"] == first["tensorboard"]["version"] == 0
    tb = out / "tensorboard" / "version_0"
    seen = scalars(tb)
    assert LIVE <= set(seen), sorted(seen)
    assert [s for s, _ in seen["train/samples_per_sec"]] == [1, 3, 5]  # every 2 steps, at train_loss's steps
    assert all(v > 0 for _, v in seen["train/samples_per_sec"]) and seen["train/lr"][0][1] == pytest.approx(0.01)
    assert all(0 <= v <= 1 for _, v in seen["train/input_wait_fraction"])
    params = hparams(tb)
    assert params["config/batch_size"] == 32 and params["plan/batch/global_batch"] == 64
    assert params["config/logger"] == "csv,tensorboard" and "config/resume" not in params

    mnist.main([*args(data, out, "--max-steps", "10", *trackers, "--resume", "auto"), "--devices", "1",
                "--batch-size", "64"])
    again = json.loads((out / "summary.json").read_text())["trackers"]
    assert again["csv"]["version"] == again["tensorboard"]["version"] == 0
    assert sorted(p.name for p in (out / "tensorboard").iterdir()) == ["version_0"]
    assert sorted(p.name for p in (out / "logs").iterdir()) == ["version_0"]
    seen = scalars(tb)
    assert [s for s, _ in seen["train/samples_per_sec"]] == [1, 3, 5, 7, 9]
    assert_steps_continue(seen["train_loss"], resumed_at=6)
    rows = [r for r in csv_rows(out / "logs" / "version_0" / "metrics.csv") if r["train_loss"]]
    assert [int(r["step"]) for r in rows] == [1, 3, 5, 7, 9]  # the first run's rows kept, the new ones after


def test_resume_from_another_output_dir_leaves_that_dirs_runs_alone(data, tmp_path, capsys):
    """``--resume PATH`` to a checkpoint of another output dir: into a dir that holds another run it is refused
    (continuing there would cut that run's version folder of the same number at the checkpoint's step); into a
    new dir it starts a new version there, with a warning, and neither dir's runs change."""
    def argv(out: Path, *extra: str) -> list[str]:
        return [*args(data, out, "--logger", "csv,tensorboard", *extra), "--devices", "1", "--batch-size", "64"]

    other, there, fresh = tmp_path / "other", tmp_path / "there", tmp_path / "fresh"
    mnist.main(argv(other, "--max-steps", "8"))
    before = (other / "logs" / "version_0" / "metrics.csv").read_text()
    tb_before = scalars(other / "tensorboard" / "version_0")
    mnist.main(argv(there, "--max-steps", "4"))
    there_before = (there / "logs" / "version_0" / "metrics.csv").read_text()
    capsys.readouterr()
    with pytest.raises(SystemExit) as refused:
        mnist.main(argv(other, "--max-steps", "6", "--resume", str(there / "final.ckpt")))
    assert refused.value.code == 2 and "would mix two runs" in capsys.readouterr().err
    with pytest.warns(UserWarning, match="outside --output-dir"):
        mnist.main(argv(fresh, "--max-steps", "6", "--resume", str(there / "final.ckpt")))
    assert (other / "logs" / "version_0" / "metrics.csv").read_text() == before
    assert scalars(other / "tensorboard" / "version_0") == tb_before
    assert (there / "logs" / "version_0" / "metrics.csv").read_text() == there_before
    trackers = json.loads((fresh / "summary.json").read_text())["trackers"]
    assert trackers["csv"]["version"] == trackers["tensorboard"]["version"] == 0
    assert [int(r["step"]) for r in csv_rows(fresh / "logs" / "version_0" / "metrics.csv") if r["train_loss"]] == [5]


def test_resumed_at_an_epoch_end_logs_at_the_steps_of_the_run_never_stopped(tmp_path):
    """A run that stopped at an epoch's end (``--max-steps`` reached there; a SIGTERM during the epoch's last
    validation saves the same checkpoint) and continued with ``--resume auto``: Lightning restarted the step
    it logs at one ahead, so every later point (loss, validation, live metrics) was one step late, one more
    per such resume. Now at the steps of the run never stopped (1 device, 6 steps per epoch)."""
    data = write_mnist_subset(tmp_path / "mnist", n_train=256, n_test=64)

    def argv(out: Path, *extra: str) -> list[str]:
        return [*args(data, out, "--val-size", "64", *extra), "--devices", "1"]

    def points(out: Path) -> dict[str, list[int]]:
        rows = csv_rows(out / "logs" / "version_0" / "metrics.csv")
        return {key: [int(r["step"]) for r in rows if r.get(key)] for key in ("train_loss", "val_acc",
                                                                              "train/samples_per_sec")}

    mnist.main(argv(tmp_path / "resumed", "--max-steps", "6"))
    mnist.main(argv(tmp_path / "resumed", "--max-steps", "15", "--resume", "auto"))
    mnist.main(argv(tmp_path / "straight", "--max-steps", "15"))
    assert points(tmp_path / "straight")["val_acc"] == [5, 11]
    assert points(tmp_path / "resumed") == points(tmp_path / "straight")


def test_bad_tracker_flags_fail_in_one_line(tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    cases = [(["--logger", "neptune"], "--logger must be none or a comma-separated list"),
             (["--logger", "csv,csv"], "--logger names a tracker twice"),
             (["--log-every-n-steps", "-1"], "--log-every-n-steps must be >= 0"),
             (["--experiment", " "], "--experiment is empty")]
    monkeypatch.setitem(sys.modules, "mlflow", None)  # as if the mlflow extra were not installed
    cases.append((["--logger", "csv,mlflow", "--data-dir", str(SHARED_DATA), "--no-download"],
                  "--logger mlflow needs the mlflow package: pip install 'mlflow>=3.17' (the pack's mlflow extra)"))
    for argv, message in cases:
        with pytest.raises(SystemExit) as exc:
            mnist.main(["--output-dir", str(out), "--accelerator", "cpu", *argv])
        assert exc.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
        assert not out.exists()  # nothing written, nothing started


def test_a_file_url_output_dir_keeps_mlflows_default_store_in_it(tmp_path):
    """``--output-dir file:///...`` is a local folder (the checkpoints and summary strip the prefix): MLflow's
    default store was refused as if it were a bucket."""
    from ddp_recipes.train.tracking import mlflow_uri
    from recipes import mnist

    cfg = mnist.MNISTConfig(output_dir=f"file://{tmp_path}/run", accelerator="cpu", logger="mlflow")
    assert mlflow_uri(cfg) == f"sqlite:///{tmp_path}/run/mlflow.db"


def _tracked(loggers: dict) -> dict:
    """A checkpoint whose run logged to ``loggers`` (TrackerRun's record)."""
    return {"global_step": 4, "callbacks": {"TrackerRun": {"loggers": loggers}}}


def test_resume_with_other_trackers_fails_clearly(tmp_path):
    from ddp_recipes.train.tracking import build_loggers

    cfg = mnist.MNISTConfig(output_dir=str(tmp_path), accelerator="cpu")
    with pytest.raises(ConfigError) as err:
        build_loggers(cfg, _tracked({"csv": {"version": 0}, "wandb": {"id": "abc", "project": "mnist"}}))
    assert err.value.cli() == ("--logger csv but the checkpoint's run logged to csv,wandb: pass --logger csv,wandb "
                               "to continue its tracker run(s), or start a new run without --resume")


@needs_mlflow
def test_resume_into_another_mlflow_store_fails_clearly(tmp_path):
    from ddp_recipes.train.tracking import build_loggers

    cfg = mnist.MNISTConfig(output_dir=str(tmp_path), accelerator="cpu", logger="mlflow",
                            tracking_uri="http://127.0.0.1:1")
    with raises_cli(ConfigError,
                    match="^--tracking-uri http://127.0.0.1:1 is not where the checkpoint's MLflow run r1"):
        build_loggers(cfg, _tracked({"mlflow": {"run_id": "r1", "tracking_uri": "http://127.0.0.1:2"}}))


@needs_wandb
def test_resume_into_another_wandb_project_fails_clearly(tmp_path):
    from ddp_recipes.train.tracking import build_loggers

    cfg = mnist.MNISTConfig(output_dir=str(tmp_path), accelerator="cpu", logger="wandb", wandb_project="other")
    with raises_cli(ConfigError, match="^--wandb-project other but the checkpoint's W&B run abc is in mnist"):
        build_loggers(cfg, _tracked({"wandb": {"id": "abc", "project": "mnist"}}))
    # A checkpoint that records no tracker run (written before they were recorded) starts new ones.
    assert build_loggers(cfg, {"global_step": 4, "callbacks": {}})


class _KnownPeak(ThroughputMeter):
    """The meter on a device whose dense peak is known (no CPU's is): what a GPU run reports."""

    def on_train_start(self, trainer, pl_module) -> None:
        super().on_train_start(trainer, pl_module)
        if trainer.is_global_zero:
            self._peak = 10**12


def test_live_metrics_carry_flops_and_mfu_where_the_peak_is_known(tmp_path):
    import torch
    from lightning.pytorch.loggers import CSVLogger
    from torch.utils.data import DataLoader

    from ddp_recipes.data.samplers import TensorBatchDataset, keep_batch
    from ddp_recipes.modules.mnist import MNISTClassifier
    from ddp_recipes.train.perf import training_flops_per_sample
    from ddp_recipes.train.trainer import build_trainer

    meter = _KnownPeak(flops_per_sample=lambda x: training_flops_per_sample(MNISTClassifier, x))
    trainer = build_trainer(accelerator="cpu", devices=1, max_steps=8, logger=CSVLogger(tmp_path, name="logs"),
                            log_every_n_steps=4, callbacks=[meter], enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    data = TensorBatchDataset(torch.randn(256, 1, 28, 28), torch.randint(0, 10, (256,)))
    trainer.fit(MNISTClassifier(), DataLoader(data, batch_size=16, collate_fn=keep_batch))
    rows = [r for r in csv_rows(tmp_path / "logs" / "version_0" / "metrics.csv") if r["train/device/mfu"]]
    assert [int(r["step"]) for r in rows] == [3, 7]
    assert meter.flops_per_sample == training_flops_per_sample(MNISTClassifier, meter.example) > 0
    for row in rows:
        device = float(row["train/device/flops_per_sec"])
        assert device == pytest.approx(meter.flops_per_sample * float(row["train/device/samples_per_sec"]))
        assert float(row["train/device/mfu"]) == pytest.approx(device / 1e12)
        assert float(row["train/step_time"]) > 0 and float(row["train/lr"]) == pytest.approx(0.01)


def test_live_lr_is_the_steps_own_and_the_heads_in_a_fine_tuning_split(tmp_path):
    """``train/lr`` during warm-up is the LR the logged step ran at (what Lightning's LearningRateMonitor logs
    at that step; it was the next step's: the step schedule moves on before the batch ends), and with a
    backbone / head split (``backbone_lr_mult``) it is the head's, the run's ``--lr`` (it was the first group's,
    the backbone's); the backbone's is ``train/lr/backbone``."""
    import torch
    from lightning.pytorch.callbacks import LearningRateMonitor
    from lightning.pytorch.loggers import CSVLogger
    from torch.utils.data import DataLoader

    from ddp_recipes.data.samplers import TensorBatchDataset, keep_batch
    from ddp_recipes.modules.mnist import MNISTClassifier
    from ddp_recipes.train.trainer import build_trainer

    model = MNISTClassifier(warmup_epochs=1.0)
    model.hparams["backbone_lr_mult"] = 0.1
    trainer = build_trainer(accelerator="cpu", devices=1, max_steps=8, logger=CSVLogger(tmp_path, name="logs"),
                            log_every_n_steps=2, callbacks=[ThroughputMeter(), LearningRateMonitor("step")],
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            default_root_dir=tmp_path)
    data = TensorBatchDataset(torch.randn(256, 1, 28, 28), torch.randint(0, 10, (256,)))
    trainer.fit(model, DataLoader(data, batch_size=16, collate_fn=keep_batch))
    by_step: dict[int, dict[str, float]] = {}
    for row in csv_rows(tmp_path / "logs" / "version_0" / "metrics.csv"):
        by_step.setdefault(int(row["step"]), {}).update({k: float(v) for k, v in row.items() if v and k != "step"})
    logged = sorted(s for s, row in by_step.items() if "train/lr" in row)
    assert logged == [1, 3, 5, 7]
    for step in logged:
        row = by_step[step]
        assert row["train/lr"] == pytest.approx(row["lr-SGD/head"]), (step, row)
        assert row["train/lr/backbone"] == pytest.approx(row["lr-SGD/backbone"]) == pytest.approx(0.1 * row["train/lr"])
        assert "train/lr/head" not in row and "train/lr/pg1" not in row
    assert by_step[1]["train/lr"] < by_step[7]["train/lr"] < 0.01  # still warming up


def sigterm_then_resume(argv: list[str], out: Path) -> int:
    """Run ``argv``, SIGTERM its launcher once a checkpoint past step 4 exists, resume with ``--resume auto``
    to the end; returns the step the preempted run saved."""
    last = out / "checkpoints" / "last.ckpt"
    proc = start([*MNIST, *argv])
    proc.wait_for_step(last, 4, timeout=240)
    proc.signal(signal.SIGTERM)
    done = proc.finish(timeout=120)
    assert done.returncode == 128 + signal.SIGTERM, done.stderr[-3000:]
    saved = saved_step(last)
    run([*MNIST, *argv, "--resume", "auto"], timeout=300, check=True)
    return saved


def logged_losses(saved: int) -> list[int]:
    """The steps ``train_loss`` is logged at (every 2 steps, up to 60) across a preemption at step ``saved``:
    the preempted run stops inside the end of that step, before Lightning hands the step's loss to the
    loggers, so when it was a logging step that one point is missing."""
    return [step for step in range(1, 60, 2) if step != saved - 1]


# A run long enough to be stopped mid-way: 4 images per device, 128 steps per epoch at 2 ranks.
LONG = ["--batch-size", "4", "--max-steps", "60", "--checkpoint-every-n-steps", "4"]


@pytest.mark.slow
@needs_wandb
def test_sigterm_and_resume_continue_tensorboard_csv_and_wandb_runs(data, tmp_path):
    out = tmp_path / "run"
    argv = [*args(data, out, *LONG), "--logger", "tensorboard,csv,wandb", "--wandb-offline"]
    saved = sigterm_then_resume(argv, out)
    assert 4 <= saved < 60
    ids = wandb_runs(out)
    assert len(ids) == 2 and len(set(ids)) == 1  # the preempted process's folder and the resumed one's: one run
    seen = scalars(out / "tensorboard" / "version_0")
    assert_steps_continue(seen["train/samples_per_sec"], resumed_at=saved)
    assert seen["train/samples_per_sec"][-1][0] == 59
    rows = [int(r["step"]) for r in csv_rows(out / "logs" / "version_0" / "metrics.csv") if r["train_loss"]]
    assert rows == logged_losses(saved)
    # A new run without --resume is a new tracker run, in its own output dir (the run's is refused: it holds a run).
    again = [*MNIST, *args(data, out, "--max-steps", "2"), "--logger", "tensorboard,csv,wandb", "--wandb-offline"]
    assert run(again, timeout=300).returncode == 2
    other = tmp_path / "other"
    run([*MNIST, *args(data, other, "--max-steps", "2"), "--logger", "tensorboard,csv,wandb", "--wandb-offline"],
        timeout=300, check=True)
    fresh = json.loads((other / "summary.json").read_text())["trackers"]
    assert fresh["csv"]["version"] == fresh["tensorboard"]["version"] == 0 and fresh["wandb"]["id"] != ids[0]


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """A real MLflow tracking server on 127.0.0.1 with a SQLite backend store; its URI."""
    root = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    proc = start(["-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
                  "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
                  "--default-artifact-root", (root / "artifacts").as_uri()], log=root / "server.log")
    uri = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    try:
        proc.wait_until(healthy, timeout=180, what="the MLflow server answering", poll_s=0.5)
        yield uri
    finally:
        proc.kill()  # the server and its workers; nothing of it is read afterwards
        proc.finish(timeout=30)


@pytest.mark.slow
@needs_mlflow
def test_mlflow_server_one_run_across_sigterm_and_resume(data, mlflow_server, tmp_path):
    from mlflow.tracking import MlflowClient

    out = tmp_path / "run"
    argv = [*args(data, out, *LONG), "--logger", "mlflow", "--tracking-uri", mlflow_server,
            "--experiment", "tracking-test", "--run-name", "preempted"]
    saved = sigterm_then_resume(argv, out)
    client = MlflowClient(mlflow_server)
    experiment = client.get_experiment_by_name("tracking-test")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1, [r.info.run_id for r in runs]  # 2 ranks, 2 processes in a row: one run
    found = runs[0]
    assert found.info.run_id == json.loads((out / "summary.json").read_text())["trackers"]["mlflow"]["run_id"]
    assert found.info.status == "FINISHED" and found.info.run_name == "preempted"
    params = found.data.params
    assert params["config/devices"] == "2" and params["plan/batch/global_batch"] == "8"
    assert params["config/logger"] == "mlflow" and "config/resume" not in params
    history = client.get_metric_history(found.info.run_id, "train/samples_per_sec")
    assert_steps_continue(sorted((m.step, m.value) for m in history), resumed_at=saved)
    losses = sorted(m.step for m in client.get_metric_history(found.info.run_id, "train_loss"))
    assert losses == logged_losses(saved)
    assert {"train/step_time", "train/input_wait_fraction", "train/lr", "test_acc"} <= set(found.data.metrics)
    # Without --resume, another output dir starts a new run in the experiment (the same one is refused: it holds a run).
    run([*MNIST, *args(data, tmp_path / "other", "--max-steps", "2"), "--logger", "mlflow", "--tracking-uri",
         mlflow_server, "--experiment", "tracking-test"], timeout=300, check=True)
    assert len(client.search_runs([experiment.experiment_id])) == 2
