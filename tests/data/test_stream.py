"""``--data stream``: the ResNet recipe trains from a dataset ``python -m ddp_recipes.data.convert`` wrote, in a local
folder or on a real S3 API (moto's server through tests/s3server.py; litdata, s3fs and boto3 unmocked).

The order is the pack's own (ResumableSampler, exact evaluation), over litdata's samples by index: the shards are
pure functions of (rank, world size), so several ranks are checked in one process; the same images and seed give
the very weights ``--data imagefolder`` gives. Stops and outages, continued with ``--resume auto``, are in
tests/data/test_stream_stops.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from ddp_recipes.data.resumable import ResumableSampler
from ddp_recipes.data.samplers import ExactDistributedSampler
from recipes.resnet import main as resnet
from tests.data.stream_checks import PROG, cache_folders, chunk_counter, digest
from tests.helpers import assert_same_weights, last_ckpt, refusal
from tests.launch import start
from tests.marks import needs_litdata

pytestmark = needs_litdata


def datamodule(data_dir: str | Path, **kwargs):
    from ddp_recipes.data.stream import StreamImageDataModule

    dm = StreamImageDataModule(data_dir, batch_size=4, image_size=16, num_workers=0, **kwargs)
    dm.check_layout()
    dm.setup("fit")
    return dm


def paths(split, indices) -> list[str]:
    return [split[i]["path"] for i in indices]


@pytest.mark.parametrize("where", ["local", "s3"])
def test_every_rank_shard_is_the_epoch_once_and_evaluation_is_exact(where, request):
    dm = datamodule(request.getfixturevalue(f"{where}_stream"))
    train, val = dm.train_set.split, dm.val_set.split
    assert (len(train), len(val), dm.num_classes, dm.train_size) == (48, 12, 2, 48)
    for epoch in (0, 1):
        shards = []
        for rank in range(2):
            sampler = ResumableSampler(dm.train_set, num_replicas=2, rank=rank, seed=0)
            sampler.set_epoch(epoch)
            shards.append(paths(train, list(sampler)))
        assert sorted(shards[0] + shards[1]) == sorted(paths(train, range(48))) and len(set(shards[0])) == 24
    val_shards = [paths(val, ExactDistributedSampler(dm.val_set, num_replicas=3, rank=r)) for r in range(3)]
    assert sorted(sum(val_shards, [])) == sorted(paths(val, range(12)))  # each once, no padding
    # Resumed at another world size after 20 samples of epoch 1: the epoch's other 28, each once.
    order = ResumableSampler(dm.train_set, num_replicas=2, rank=0, seed=0)
    order.set_epoch(1)
    consumed = paths(train, order.epoch_order()[:20])
    rest = []
    for rank in range(3):
        sampler = ResumableSampler(dm.train_set, num_replicas=3, rank=rank, seed=0)
        sampler.resume_at(1, 20)
        sampler.set_epoch(1)
        rest += paths(train, list(sampler))
    remaining = set(paths(train, range(48))) - set(consumed)
    assert sorted(p for p in rest if p in remaining) == sorted(remaining)  # each remaining sample once
    padding = [p for p in rest if p not in remaining]
    assert padding == consumed[:len(padding)] and len(padding) < 3  # equal shards: the epoch's head, as for a folder


def test_loader_workers_open_the_bucket_themselves(s3_stream):
    dm = datamodule(s3_stream, decode="cpu")
    sampler = ResumableSampler(dm.train_set, num_replicas=1, rank=0, seed=0)
    loader = torch.utils.data.DataLoader(dm.train_set.split, sampler=sampler, batch_size=8, num_workers=2,
                                         collate_fn=lambda batch: [s["path"] for s in batch])
    seen = [p for batch in loader for p in batch]
    assert dm.train_set.split._dataset is None  # opened in the workers only (never pickled open)
    assert sorted(seen) == sorted(paths(dm.train_set.split, range(48))) and len(set(seen)) == 48
    assert dm.cache is not None and dm.cache.is_dir()


# A rank's view of the stream, through the pack's classes: opened, read whole (train, then val) once both are ready.
READER = """
import sys, time
from pathlib import Path
from ddp_recipes.data.stream import StreamImageDataModule
from tests.data.stream_checks import digest
dm = StreamImageDataModule(sys.argv[1], batch_size=4, image_size=16, num_workers=0)
dm.setup("fit")
ready = Path(sys.argv[2])
(ready / sys.argv[3]).touch()
while len(list(ready.iterdir())) < 2:  # both open before either reads: they race for the same chunks
    time.sleep(0.01)
print("read", digest(dm), flush=True)
print("cache", dm.cache, flush=True)
"""


def test_two_processes_on_a_node_download_each_chunk_once_and_leave_no_cache(s3_stream, local_stream, s3, tmp_path):
    """Both read every sample at once through one node folder: each chunk fetched once, every byte right (no
    half-downloaded chunk read), and the folder gone after both exit."""
    cache, ready = tmp_path / "cache", tmp_path / "ready"
    ready.mkdir()
    chunk_gets = chunk_counter(s3, s3_stream)
    readers = [start(["-c", READER, s3_stream, ready, str(n)], env={"DDP_RECIPES_CACHE_DIR": str(cache)},
                     port=False) for n in range(2)]
    outputs = [r.finish(timeout=300, check=True).stdout for r in readers]
    assert [out.split("read ", 1)[1].split()[0] for out in outputs] == [digest(datamodule(local_stream))] * 2
    folders = {Path(out.split("cache ", 1)[1].strip()) for out in outputs}
    gets, chunks = chunk_gets()
    assert sorted(gets) == chunks, f"{len(gets)} chunk GETs for the {len(chunks)} chunks: not once each"
    assert len(folders) == 1 and folders.pop().parent == cache / "stream"
    assert cache_folders(cache) == [], "the node's cache outlived its readers"


def test_the_gpu_decode_path_reads_the_streams_bytes(local_stream, images):
    dm = datamodule(local_stream, decode="gpu")
    data, label, draws, name = dm.train_set[0]
    assert data == (images / name).read_bytes() and label == 0 and draws is not None
    assert dm.val_set[0][2] is None


RUN = ["--accelerator", "cpu", "--image-size", "16", "--min-crop-scale", "0.3", "--batch-size", "4",
       "--num-workers", "1", "--dropout", "0.3", "--lr", "0.05", "--warmup-epochs", "0.5", "--max-epochs", "1"]


@pytest.fixture(scope="module")
def folder_run(images, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("folder_run")
    resnet([*RUN, "--data", "imagefolder", "--data-dir", str(images), "--output-dir", str(out)])
    return last_ckpt(out)


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_stream_run_ends_with_the_weights_of_the_folder_run(where, request, folder_run, tmp_path):
    """Same files, same order (the converter keeps ImageFolder's), same per-sample seeds: bit for bit."""
    data_dir = str(request.getfixturevalue(f"{where}_stream"))
    summary = resnet([*RUN, "--data", "stream", "--data-dir", data_dir, "--output-dir", str(tmp_path)])
    assert summary["steps"] == 12 and "test_acc" in summary
    assert_same_weights(folder_run, last_ckpt(tmp_path))


def test_decode_gpu_on_a_stream_ends_with_the_weights_of_decode_gpu_on_the_folder(local_stream, images, tmp_path,
                                                                                   image_library):
    """``--decode gpu``'s path (workers hand over bytes and draws; the decoder runs in the training process), here on
    the CPU: the stream feeds EncodedImageFolder the same bytes the folder's files hold."""
    runs = {}
    for data, data_dir in (("imagefolder", images), ("stream", local_stream)):
        resnet([*RUN, "--decode", "gpu", "--data", data, "--data-dir", str(data_dir), "--output-dir",
                str(tmp_path / data)])
        runs[data] = last_ckpt(tmp_path / data)
    assert_same_weights(runs["imagefolder"], runs["stream"])


def refused(argv: list[str], capsys) -> str:
    return refusal(resnet, argv, capsys, PROG)


def stream_argv(data_dir: str, out: Path) -> list[str]:
    return ["--accelerator", "cpu", "--devices", "2", "--data", "stream", "--data-dir", data_dir, "--output-dir",
            str(out)]


def test_a_missing_bucket_is_one_line_naming_data_dir(s3, tmp_path, capsys):
    line = refused(stream_argv("s3://no-such-bucket/x", tmp_path / "out"), capsys)
    assert line.startswith("--data-dir s3://no-such-bucket/x: bucket no-such-bucket does not exist"), line
    assert not (tmp_path / "out").exists()  # before anything, any rank


def test_a_url_or_folder_without_a_dataset_is_one_line_naming_data_dir(s3, tmp_path, capsys):
    s3.bucket("empty")
    line = refused(stream_argv("s3://empty/nothing", tmp_path / "out"), capsys)
    assert line.startswith("--data-dir s3://empty/nothing holds no dataset written by the converter (no "
                           "classes.json); convert an ImageFolder there first: python -m ddp_recipes.data.convert"), \
        line
    (tmp_path / "folder").mkdir()
    line = refused(stream_argv(str(tmp_path / "folder"), tmp_path / "out"), capsys)
    assert "holds no dataset written by the converter (no classes.json)" in line
    line = refused(stream_argv(str(tmp_path / "nowhere"), tmp_path / "out"), capsys)
    assert line.startswith(f"--data-dir {tmp_path / 'nowhere'} does not exist"), line
    assert not (tmp_path / "out").exists()


def test_a_stream_missing_a_chunk_is_one_line_naming_data_dir(local_stream, tmp_path, capsys):
    """A chunk gone (a lifecycle rule, a partial sync) is found before launch, not as litdata's wait timeout
    on a cache path mid-epoch."""

    broken = tmp_path / "broken"
    shutil.copytree(local_stream, broken)
    lost = sorted((broken / "train").glob("chunk-*.bin"))[0]
    lost.unlink()
    line = refused(stream_argv(str(broken), tmp_path / "out"), capsys)
    assert line.startswith(f"--data-dir {broken}: train/index.json names 1 chunk(s) that are missing or cut short "
                           f"({lost.name}); rerun python -m ddp_recipes.data.convert"), line
    assert not (tmp_path / "out").exists()
    # A chunk cut short (a copy stopped midway) too: mid-epoch it was litdata's wait timeout, named an outage.
    shutil.copy2(local_stream / "train" / lost.name, lost)
    cut = sorted((broken / "train").glob("chunk-*.bin"))[-1]
    whole = cut.stat().st_size
    cut.write_bytes(cut.read_bytes()[:100])
    line = refused(stream_argv(str(broken), tmp_path / "out"), capsys)
    assert f"names 1 chunk(s) that are missing or cut short ({cut.name} (100 of {whole} bytes))" in line, line


def test_refused_credentials_are_one_line_naming_data_dir(s3_stream, s3, tmp_path, capsys):
    with s3.checking_credentials():
        line = refused(stream_argv(s3_stream, tmp_path / "out"), capsys)
    assert line.startswith(f"--data-dir {s3_stream}: access denied"), line
    assert "credentials" in line and not (tmp_path / "out").exists()


def test_no_credentials_at_all_is_one_line_naming_data_dir(s3_stream, s3, tmp_path, capsys, monkeypatch):
    import s3fs

    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    s3fs.S3FileSystem.clear_instance_cache()  # fsspec keeps the filesystem it made with the keys
    try:
        with s3.checking_credentials():
            line = refused(stream_argv(s3_stream, tmp_path / "out"), capsys)
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
    assert line.startswith(f"--data-dir {s3_stream}: "), line
    assert "credentials" in line and not (tmp_path / "out").exists()

