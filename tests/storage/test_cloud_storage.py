"""``--output-dir`` on object storage against a real S3 API (moto's server on 127.0.0.1, s3fs as the client).

Fast, in-process cases: the object-then-manifest rule that ``--resume auto`` reads, a killed upload and a
damaged object, a store answering 503 for a while, a missing bucket, a missing client package. The 2-rank
SIGTERM / killed-upload resumes from the bucket, bit for bit, are in tests/storage/test_cloud_resume.py (slow).
"""

from __future__ import annotations

import fractions
import json
import sys

import pytest
import torch

from tests.helpers import SHARED_DATA
from tests.marks import needs_mnist
from tests.s3server import object_upload
from tests.tiny_modules import TinyNet

MNIST = ["--accelerator", "cpu", "--data-dir", str(SHARED_DATA), "--no-download", "--batch-size", "64",
         "--no-diagnostics"]


def checkpoint(step: int, epoch: int) -> dict:
    return {"state_dict": {"w": torch.full((3,), float(step))}, "global_step": step, "epoch": epoch}


def test_auto_takes_the_newest_complete_checkpoint_from_the_manifests(s3, tmp_path, monkeypatch):
    from ddp_recipes.checkpointing.checkpoint import AtomicCheckpointIO, read_checkpoint
    from ddp_recipes.checkpointing.run_folder.resume import resolve_resume
    from ddp_recipes.errors import CheckpointError
    from tests.helpers import newest_checkpoint

    monkeypatch.chdir(tmp_path)
    run = s3.bucket("rule") + "/run"
    io = AtomicCheckpointIO()
    assert newest_checkpoint(run) is None
    io.save_checkpoint(checkpoint(4, 0), f"{run}/checkpoints/best.ckpt")
    io.save_checkpoint(checkpoint(6, 1), f"{run}/checkpoints/last.ckpt")
    io.save_checkpoint(checkpoint(8, 1), f"{run}/checkpoints/last.ckpt")
    keys = s3.keys("rule")
    objects = [k for k in keys if "/objects/" in k]
    assert [k for k in keys if k not in objects] == ["run/checkpoints/best.ckpt.manifest.json",
                                                     "run/checkpoints/last.ckpt.manifest.json"]
    assert len(objects) == 2 and any("last-00000008-" in k for k in objects)  # the step-6 object went
    manifest = json.loads(s3.client().get_object(Bucket="rule", Key="run/checkpoints/last.ckpt.manifest.json")
                          ["Body"].read())
    assert manifest["global_step"] == 8 and manifest["object"].startswith("objects/last-00000008-")

    # An upload killed before its manifest, on a store that shows partial objects: newer, named by nobody.
    s3.client().put_object(Bucket="rule", Key="run/checkpoints/objects/last-00000010-0badf00d.ckpt", Body=b"PK\x03")
    # A manifest whose object is not the recorded size (cut, or replaced by hand): skipped with a warning.
    s3.client().put_object(Bucket="rule", Key="run/checkpoints/other.ckpt.manifest.json",
                           Body=json.dumps({**manifest, "name": "other.ckpt", "global_step": 12, "bytes": 1}))
    with pytest.warns(UserWarning, match=r"--resume auto: skipping .*other\.ckpt\.manifest\.json: its object"):
        found = newest_checkpoint(run)
    assert found == f"{run}/checkpoints/last.ckpt"
    assert read_checkpoint(found)["global_step"] == 8
    assert read_checkpoint(f"{run}/checkpoints/last.ckpt.manifest.json")["global_step"] == 8  # either spelling

    # The store's copy changed after its manifest was written: the sha256 check refuses it.
    best = json.loads(s3.client().get_object(Bucket="rule", Key="run/checkpoints/best.ckpt.manifest.json")
                      ["Body"].read())
    key = f"run/checkpoints/{best['object']}"
    body = bytearray(s3.client().get_object(Bucket="rule", Key=key)["Body"].read())
    body[-30] ^= 0xFF
    s3.client().put_object(Bucket="rule", Key=key, Body=bytes(body))
    with pytest.raises(CheckpointError, match="does not match its manifest's sha256"):
        read_checkpoint(f"{run}/checkpoints/best.ckpt")

    # --resume URL: the name it was saved under, or nothing there (one line naming --resume).
    assert resolve_resume(f"{run}/checkpoints/last.ckpt") == f"{run}/checkpoints/last.ckpt"
    with pytest.raises(CheckpointError, match=r"^resume s3://rule/run/checkpoints/nope\.ckpt: no such checkpoint"):
        resolve_resume(f"{run}/checkpoints/nope.ckpt")
    # From a URL too, a checkpoint that names a Python object is refused before any of it runs.
    io.save_checkpoint({**checkpoint(9, 1), "extra": fractions.Fraction(1, 3)}, f"{run}/elsewhere/odd.ckpt")
    with pytest.raises(CheckpointError, match=r"holds Python objects.*fractions\.Fraction"):
        read_checkpoint(f"{run}/elsewhere/odd.ckpt")

    io.remove_checkpoint(f"{run}/checkpoints/best.ckpt")  # ModelCheckpoint's top-k rotation
    assert not [k for k in s3.keys("rule") if "best" in k]
    assert list(tmp_path.iterdir()) == []  # nothing beside the run, no local "s3:" folder


@needs_mnist
def test_a_run_on_a_bucket_rides_out_503s_and_resumes_from_it(s3, tmp_path, monkeypatch, capsys):
    """The store answers 503 to 3 requests from the first checkpoint upload: retried, reported in one line,
    the run goes on; everything it writes is in the bucket; ``--resume auto`` continues from there."""
    from ddp_recipes.storage import retry
    from recipes import mnist

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(retry, "BASE_DELAY_S", 0.01)
    out = s3.bucket("flaky") + "/run"
    s3.fail(3, after=object_upload)
    mnist.main([*MNIST, "--max-steps", "3", "--checkpoint-every-n-steps", "2", "--output-dir", out])
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if line.startswith("storage: ")]
    assert len(s3.faults.failed) == 3 and len(said) == 2, err[-2000:]
    assert "upload of s3://flaky/run/checkpoints/objects/last-00000002-" in said[0]
    assert "retrying with backoff" in said[0]
    assert "done after 4 attempts" in said[1]
    keys = s3.keys("flaky")
    assert "run/summary.json" in keys and "run/checkpoints/last.ckpt.manifest.json" in keys
    assert any(k.startswith("run/logs/") and k.endswith("metrics.csv") for k in keys)
    assert list(tmp_path.iterdir()) == []  # no local "s3:" folder, no stray files

    summary = mnist.main([*MNIST, "--max-steps", "5", "--checkpoint-every-n-steps", "2", "--output-dir", out,
                          "--resume", "auto"])
    assert summary["resumed_from"] == f"{out}/checkpoints/last.ckpt" and summary["steps"] == 5
    stored = json.loads(s3.client().get_object(Bucket="flaky", Key="run/summary.json")["Body"].read())
    assert stored["steps"] == 5


@needs_mnist
def test_the_csv_logs_on_a_bucket_ride_out_503s_too(s3, tmp_path, monkeypatch, capsys):
    """Lightning's CSVLogger writes metrics.csv (and hparams.yaml) through fsspec on every flush, past the
    pack's retries: one 503 on a log write killed the run. Each flush is now one whole-file upload, retried."""
    import csv
    import io

    from ddp_recipes.storage import retry
    from recipes import mnist

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(retry, "BASE_DELAY_S", 0.01)
    out = s3.bucket("flaky-logs") + "/run"
    s3.fail(3, after=lambda method, path: method == "PUT" and path.endswith("/metrics.csv"))
    summary = mnist.main([*MNIST, "--max-steps", "4", "--log-every-n-steps", "1", "--output-dir", out])
    assert summary["steps"] == 4 and len(s3.faults.failed) == 3
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("storage: ")]
    assert any("metrics.csv" in line and "retrying with backoff" in line for line in said), said
    body = s3.client().get_object(Bucket="flaky-logs", Key="run/logs/version_0/metrics.csv")["Body"].read().decode()
    steps = sorted({int(row["step"]) for row in csv.DictReader(io.StringIO(body)) if row.get("train_loss")})
    assert steps == [0, 1, 2, 3], body[:500]


def test_a_store_that_stays_down_fails_in_one_line(s3, monkeypatch):
    from ddp_recipes.storage import retry

    monkeypatch.setattr(retry, "BASE_DELAY_S", 0.01)
    url = s3.bucket("down") + "/x.json"
    s3.fail(100)
    try:
        with pytest.raises(retry.StorageError) as info:
            retry.retrying("upload of " + url, lambda: retry.filesystem(url)[0].pipe_file(url, b"{}"), attempts=3)
    finally:
        s3.reset_faults()
    line = info.value.cli()
    assert line.startswith("--output-dir: upload of s3://down/x.json failed after 3 attempts (")
    assert "\n" not in str(info.value)


def test_retries_are_reported_once_per_job_not_once_per_rank(s3, monkeypatch, capsys):
    """Every rank reads the store (the resume check, the download): a store down for a while must not print
    the retry line in every one of 16 ranks. Rank 0 reports; a rank that gives up still fails loudly."""
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    from ddp_recipes.storage import retry
    from ddp_recipes.storage.store import put_bytes

    monkeypatch.setattr(retry, "BASE_DELAY_S", 0.01)
    url = s3.bucket("ranks") + "/x.json"
    for rank, lines in ((1, 0), (0, 2)):
        monkeypatch.setattr(rank_zero_only, "rank", rank)
        s3.fail(2)
        put_bytes(url, b"{}")
        said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("storage: ")]
        assert len(said) == lines and len(s3.faults.failed) == 2, (rank, said)
    monkeypatch.setattr(rank_zero_only, "rank", 1)
    s3.fail(100)
    try:
        with pytest.raises(retry.StorageError, match="failed after 3 attempts"):
            retry.retrying("upload of " + url, lambda: retry.filesystem(url)[0].pipe_file(url, b"{}"), attempts=3)
    finally:
        s3.reset_faults()


@pytest.mark.parametrize("resume", ["none", "auto"])
def test_a_missing_bucket_is_one_line_naming_the_flag_and_exit_2(s3, tmp_path, monkeypatch, capsys, resume):
    from recipes import resnet

    monkeypatch.chdir(tmp_path)
    before = s3.buckets()
    with pytest.raises(SystemExit) as info:
        resnet.main(["--accelerator", "cpu", "--data", "synthetic", "--max-steps", "2", "--output-dir",
                     "s3://no-such-bucket/run", "--resume", resume])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["python -m recipes.resnet: error: --output-dir s3://no-such-bucket/run: bucket no-such-bucket "
                   "does not exist; create it or pass another --output-dir"]
    assert s3.buckets() == before  # not created on the way (fsspec's open() would)
    assert list(tmp_path.iterdir()) == []


def _refused_line(s3, capsys, argv: list[str]) -> str:
    """The one error line of a recipe run while the server checks credentials (the fake keys are refused)."""
    from recipes import resnet

    with s3.checking_credentials(), pytest.raises(SystemExit) as info:
        resnet.main(["--accelerator", "cpu", "--data", "synthetic", "--max-steps", "2", *argv])
    assert info.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    return line


def test_refused_credentials_fail_before_training_naming_the_flag(s3, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    s3.bucket("locked")
    line = _refused_line(s3, capsys, ["--output-dir", "s3://locked/run", "--resume", "auto"])
    assert line.startswith("python -m recipes.resnet: error: --output-dir s3://locked/run: access denied (")
    assert "check the credentials" in line and line.endswith("or pass another --output-dir")


def test_a_refused_resume_url_names_resume_not_output_dir(s3, tmp_path, monkeypatch, capsys):
    """``--resume s3://...`` with a local ``--output-dir``: a refused read is about ``--resume``."""
    monkeypatch.chdir(tmp_path)
    s3.bucket("locked-resume")
    line = _refused_line(s3, capsys, ["--output-dir", str(tmp_path / "out"), "--resume",
                                      "s3://locked-resume/run/checkpoints/last.ckpt"])
    assert line.startswith("python -m recipes.resnet: error: --resume: lookup of "
                           "s3://locked-resume/run/checkpoints/"), line
    assert "--output-dir" not in line


def test_a_missing_client_package_names_the_extra(monkeypatch):
    import fsspec  # noqa: F401 (loads fsspec.registry)

    from ddp_recipes.errors import ConfigError
    from ddp_recipes.storage.retry import filesystem

    monkeypatch.setitem(sys.modules, "s3fs", None)  # as if s3fs were not installed
    monkeypatch.delitem(sys.modules["fsspec.registry"]._registry, "s3", raising=False)
    with pytest.raises(ConfigError) as info:
        filesystem("s3://bucket/run")
    assert info.value.cli() == ("--output-dir s3://bucket/run needs s3fs, which is not installed: "
                                "pip install 's3fs>=2026.9' (the pack's cloud extra)")


def test_urls_join_like_paths_and_stay_plain_strings_in_checkpoints():
    import pickle

    from ddp_recipes.storage import Url, is_url, location

    out = location("s3://bucket/run")
    assert isinstance(out, Url) and out / "checkpoints" / "last.ckpt" == "s3://bucket/run/checkpoints/last.ckpt"
    assert (out / "checkpoints").parent == out and (out / "x").name == "x"
    assert not is_url("runs/x") and not is_url("file:///tmp/x") and is_url("gs://b/p") and is_url("memory://x")
    assert str(location("file:///tmp/x")) == "/tmp/x"
    assert type(str(out)) is str and b"Url" not in pickle.dumps(str(out))


def test_build_trainer_on_a_bucket_continues_with_ckpt_path_last(s3, tmp_path, monkeypatch):
    """A user's script: ``default_root_dir`` a URL, ``fit(ckpt_path="last")`` finds the bucket's newest."""
    from torch.utils.data import DataLoader, TensorDataset

    from ddp_recipes import build_trainer

    monkeypatch.chdir(tmp_path)
    root = s3.bucket("library") + "/run"
    data = TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))

    def fit(max_steps: int) -> tuple[int, str | None]:
        trainer = build_trainer(devices=1, accelerator="cpu", seed=0, max_steps=max_steps, default_root_dir=root,
                                logger=False, enable_progress_bar=False, enable_model_summary=False,
                                checkpoint_every_n_steps=2, diagnostics=False)
        trainer.fit(TinyNet(), DataLoader(data, batch_size=8), ckpt_path="last")
        return trainer.global_step, trainer.ckpt_path

    assert fit(2) == (2, None) and "run/checkpoints/last.ckpt.manifest.json" in s3.keys("library")
    assert fit(5) == (5, f"{root}/checkpoints/last.ckpt")
    entry = json.loads(s3.client().get_object(Bucket="library", Key="run/checkpoints/last.ckpt.manifest.json")
                       ["Body"].read())
    assert entry["global_step"] == 5
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("how", ["--wandb-offline", "WANDB_MODE=offline"])
def test_an_offline_wandb_run_on_a_bucket_is_refused_before_anything_is_written(s3, tmp_path, monkeypatch, capsys, how):
    """An offline W&B run is a local folder: with a URL output dir it went to ./s3:/bucket/... in the cwd."""
    pytest.importorskip("wandb")
    from recipes import resnet

    monkeypatch.chdir(tmp_path)
    out = s3.bucket("wandb-offline") + "/run"
    extra = [how] if how.startswith("--") else []
    if not extra:
        monkeypatch.setenv("WANDB_MODE", "offline")
    with pytest.raises(SystemExit) as info:
        resnet.main(["--accelerator", "cpu", "--data", "synthetic", "--max-steps", "2", "--output-dir", out,
                     "--logger", "csv,wandb", *extra])
    assert info.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("python -m recipes.resnet: error: --logger wandb offline with --output-dir "
                           "s3://wandb-offline/run")
    assert "--wandb-offline" in line
    assert list(tmp_path.iterdir()) == []
    assert s3.keys("wandb-offline") == []


def test_an_online_wandb_run_on_a_bucket_stages_its_files_outside_the_working_directory(s3, tmp_path, monkeypatch):
    """Online, W&B streams to its server and only stages files locally: not in a ./s3: folder of the cwd."""
    pytest.importorskip("wandb")
    from ddp_recipes.storage.store import cache_dir
    from ddp_recipes.train.tracking import build_loggers
    from recipes.config import ResNetConfig

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("WANDB_DIR", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    cfg = ResNetConfig(accelerator="cpu", data="synthetic", output_dir="s3://wandb-online/run", logger="wandb")
    (logger,) = build_loggers(cfg)
    assert logger.save_dir is not None and not logger.save_dir.startswith("s3:")
    assert logger.save_dir.startswith(str(cache_dir()))
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "staging"))
    (logger,) = build_loggers(cfg)
    assert logger.save_dir == str(tmp_path / "staging")


def test_a_url_checkpoint_is_never_unpickled_even_when_the_caller_asks(s3):
    """``trainer.fit/test(ckpt_path=URL, weights_only=False)`` reaches the checkpoint IO with False: a file from
    a store must still not run code."""
    import pickle

    from ddp_recipes.checkpointing.checkpoint import AtomicCheckpointIO

    run = s3.bucket("unpickle") + "/run"
    io = AtomicCheckpointIO()
    io.save_checkpoint({**checkpoint(3, 0), "extra": fractions.Fraction(1, 3)}, f"{run}/odd.ckpt")
    with pytest.raises(pickle.UnpicklingError, match="fractions.Fraction"):
        io.load_checkpoint(f"{run}/odd.ckpt", weights_only=False)
    io.save_checkpoint(checkpoint(4, 0), f"{run}/plain.ckpt")
    assert io.load_checkpoint(f"{run}/plain.ckpt", weights_only=False)["global_step"] == 4


def test_a_users_model_checkpoint_on_a_bucket_keeps_every_checkpoint_it_keeps_locally(s3, tmp_path, monkeypatch):
    """On a URL the name (``epoch=0.ckpt``) is a manifest and an object: Lightning's version counter asked
    its filesystem whether the name exists, saw nothing, and overwrote ``epoch=0.ckpt`` instead of writing
    ``epoch=0-v1.ckpt``: of 3 checkpoints ``save_top_k=-1`` kept 1."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    from ddp_recipes import build_trainer

    monkeypatch.chdir(tmp_path)
    data = TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))

    def kept(root: str) -> list[str]:
        mine = ModelCheckpoint(dirpath=f"{root}/mine", filename="{epoch}", every_n_train_steps=2, save_top_k=-1,
                               monitor="step", mode="max")
        trainer = build_trainer(devices=1, accelerator="cpu", seed=0, max_steps=6, default_root_dir=root,
                                logger=False, enable_progress_bar=False, enable_model_summary=False,
                                diagnostics=False, callbacks=[mine])
        trainer.fit(TinyNet(), DataLoader(data, batch_size=8))
        return sorted(path.rsplit("/", 1)[-1] for path in mine.best_k_models)

    local = kept(str(tmp_path / "local"))
    assert local == ["epoch=0-v1.ckpt", "epoch=0-v2.ckpt", "epoch=0.ckpt"]
    assert kept(s3.bucket("versions") + "/run") == local
    manifests = [k.removeprefix("run/mine/") for k in s3.keys("versions", "run/mine/") if k.endswith(".manifest.json")]
    assert manifests == [f"{name}.manifest.json" for name in local]
