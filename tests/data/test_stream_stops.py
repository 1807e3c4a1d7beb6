"""``--data stream`` from a bucket, stopped and continued: a store outage mid-epoch, SIGTERM, a killed rank, a killed
job, each continued with ``--resume auto`` on a machine with an empty cache (moto's S3 server through tests/s3server.py;
litdata, obstore, boto3 and s3fs unmocked).

The stream here holds one sample per chunk (each image is over the 1 KiB chunk size), so a process's first read of a
sample is one GET of its own: the server's request log says which samples a run read, and an outage armed at the
n-th chunk request fails a read mid-epoch. The uninterrupted 2-rank run every stopped one must end equal to is one
module fixture.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch

from ddp_recipes.data.convert import main as convert
from ddp_recipes.data.resumable import ResumableSampler
from tests.data.stream_checks import PROG
from tests.helpers import assert_same_weights, last_ckpt
from tests.launch import ROOT, saved_step, start
from tests.marks import needs_litdata
from tests.resume_scenario import CAPTURED_STEP_LIMIT_S, RESNET, args

pytestmark = needs_litdata
CHAOS = ROOT / "tests" / "scenarios" / "chaos_scenario.py"
SEED = 42  # the recipe's default --seed: the order a run's samples come in
STEPS_PER_EPOCH = 6  # 48 images / (4 per device x 2 ranks)


@pytest.fixture(scope="module")
def stream(images, s3, tmp_path_factory) -> str:
    url = f"{s3.bucket('stops')}/one"
    assert convert([str(images), url, "--chunk-bytes", "1KiB", "--workers", "1", "--staging",
                    str(tmp_path_factory.mktemp("staging"))]) == 0
    return url


def chunk_of_sample(s3, split: str) -> dict[str, int]:
    """``{chunk file: the sample it holds}`` from the split's index.json (one sample per chunk here)."""
    index = json.loads(s3.client().get_object(Bucket="stops", Key=f"one/{split}/index.json")["Body"].read())
    assert all(chunk["chunk_size"] == 1 for chunk in index["chunks"]), "a chunk holds several samples"
    return {chunk["filename"]: i for i, chunk in enumerate(index["chunks"])}


def train_gets(requests: list[str]) -> list[str]:
    """The chunk files of ``train/`` these requests asked for."""
    return [r.rsplit("/", 1)[1] for r in requests if r.startswith("GET ") and "/one/train/chunk-" in r]


def from_nth_train_get(n: int):
    """An ``S3Server.fail`` trigger: the n-th chunk request of train/ from now (and every request after it)."""
    seen = [0]

    def match(method: str, path: str) -> bool:
        seen[0] += len(train_gets([f"{method} {path}"]))
        return seen[0] >= n

    return match


def flags(data_dir: str, *extra: str, devices: int = 2) -> list[str]:
    """The resume scenario's flags (random crops, dropout) on the stream, 2 loader workers, a checkpoint every 2
    steps."""
    argv = args(Path("unused"), devices, "--max-epochs", "2", "--num-workers", "2", "--checkpoint-every-n-steps", "2",
                *extra)
    argv[argv.index("--data") + 1], argv[argv.index("--data-dir") + 1] = "stream", data_dir
    return argv


def launch(argv: list[str], out: Path, machine: Path, chaos: tuple[str, int] | None = None, env: dict | None = None):
    """The recipe (or the chaos scenario's copy of it) on a new machine: an empty download cache."""
    env = {**(env or {}), "DDP_RECIPES_CACHE_DIR": str(machine)}
    script = RESNET
    if chaos is not None:
        env |= {"CHAOS_KIND": chaos[0], "CHAOS_AFTER": str(chaos[1])}
        script = [CHAOS, "resnet"]
    return start([*script, *argv, "--output-dir", str(out)], env=env)


def finished(proc, timeout: float = 600):
    """Its exit, once every process of the job (ranks, loader workers) is gone: none may be left waiting in a
    collective or on the store (a hang, not a timing: the bound is a minute)."""
    done = proc.finish(timeout=timeout)
    for _ in range(600):
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return done
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    raise AssertionError(f"a process of the job outlived it by a minute:\n{done.stderr[-3000:]}")


@pytest.fixture(scope="module")
def stream_straight(stream, s3, tmp_path_factory) -> Path:
    """The uninterrupted 2-rank streaming run (12 steps) every stopped run here must end equal to."""
    out = tmp_path_factory.mktemp("stream-straight")
    before = len(s3.requests)
    done = finished(launch(flags(stream), out, out / "machine"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert saved_step(last_ckpt(out)) == 2 * STEPS_PER_EPOCH
    # The node's cache: 2 ranks x 2 loader workers x 2 epochs fetched each chunk once, and it left with the run.
    gets = train_gets(s3.requests[before:])
    assert sorted(gets) == sorted(chunk_of_sample(s3, "train")), f"{len(gets)} chunk GETs for 48 chunks"
    assert cache_folders(out / "machine") == [], "a finished run left its cache behind"
    return last_ckpt(out)


def cache_folders(machine: Path) -> list[str]:
    """The dataset folders in a machine's download cache (the node's, shared by its ranks)."""
    return sorted(p.name for p in (machine / "stream").iterdir() if p.is_dir()) if (machine / "stream").is_dir() else []


# ---- fast: one split read by loader workers while the store fails ---------------------------------------------

def loader(split, workers: int = 2):
    return torch.utils.data.DataLoader(split, batch_size=4, num_workers=workers,
                                       collate_fn=lambda batch: [s["path"] for s in batch])


@contextlib.contextmanager
def reading(split, workers: int = 2):
    """The batches of ``loader(split)``, its workers ended on the way out, even when a read failed. Left to garbage
    collection, a failed iterator lives on (the traceback that ``pytest.raises`` keeps refers to it) and its workers
    go on prefetching once the store answers again: seen reading chunk-0-9 into the next test's request log, where
    the uninterrupted run's fixture counted it as a 49th chunk GET."""
    batches = iter(loader(split, workers))
    try:
        yield batches
    finally:
        batches._shutdown_workers()  # torch's own end of a multi-worker iterator (its __del__ calls it)


def test_an_outage_is_retried_then_one_line_and_the_store_back_reads_again(stream, s3, tmp_path, monkeypatch,
                                                                           capfd):
    """A chunk download goes through the pack's storage layer, as ``--output-dir``'s uploads do: 5 answers of 503 are
    ridden out (one line on stderr says so); a store that stays down fails the read, after the 8 attempts, with one
    line naming the sample and the chunk, raised in the training process from the loader worker. The store back, the
    same cache folder reads every sample: no half-downloaded chunk is taken for a whole one."""
    from ddp_recipes.data.stream import StreamSplit, StreamUnavailable, describe_outage
    from ddp_recipes.storage import retry

    monkeypatch.setattr(retry, "BASE_DELAY_S", 0.01)  # the workers are forked: they back off this long too
    s3.fail(5, after=from_nth_train_get(3))
    split = StreamSplit(f"{stream}/train", 48, str(tmp_path / "blip"))
    split.fetch_index()
    seen = [p for batch in loader(split) for p in batch]
    assert len(set(seen)) == 48 and len(s3.faults.failed) == 5
    said = [line for line in capfd.readouterr().err.splitlines() if line.startswith("storage: download of ")]
    assert said and "retrying with backoff (up to 8 attempts)" in said[0], said

    cache = str(tmp_path / "cache")
    split = StreamSplit(f"{stream}/train", 48, cache)
    split.fetch_index()
    s3.fail(10**6, after=from_nth_train_get(5))
    try:
        with reading(split) as batches, pytest.raises(StreamUnavailable) as info:
            list(batches)
    finally:
        s3.reset_faults()
    line = describe_outage(info.value)
    assert re.fullmatch(rf"reading train sample \d+ failed: download of {stream}/train/chunk-0-\d+\.bin failed after 8 "
                        r"attempts \(.*Service is unavailable.*\)", line), line
    again = StreamSplit(f"{stream}/train", 48, cache)
    seen = [p for batch in loader(again) for p in batch]
    assert len(seen) == 48 and len(set(seen)) == 48


def test_a_blip_while_a_process_opens_its_split_is_ridden_out(stream, s3, tmp_path, monkeypatch):
    """Opening a split reads index.json through litdata's boto3 (3 attempts): 5 answers of 503 there, as a loader
    worker opening its split mid-blip meets them, are retried by the storage layer instead of ending the run."""
    from ddp_recipes.data.stream import StreamSplit
    from ddp_recipes.storage import retry

    monkeypatch.setattr(retry, "BASE_DELAY_S", 0.01)
    s3.fail(5, after=lambda method, path: path.endswith("/one/train/index.json"))
    try:
        split = StreamSplit(f"{stream}/train", 48, str(tmp_path / "cache"))
        assert split[0]["path"].startswith("train/")
        assert len(s3.faults.failed) == 5
    finally:
        s3.reset_faults()


def test_a_cache_disk_that_refuses_a_chunk_names_the_cache_not_the_store():
    """A full (or read-only, or not this user's) cache disk is not an outage: waiting for the store would not help,
    so the line names DDP_RECIPES_CACHE_DIR and its fix, also as a loader worker's re-raised traceback ends."""
    import errno

    from ddp_recipes.data.stream import StreamCacheError, _local_fault, describe_outage
    from ddp_recipes.storage.retry import StorageError

    def failed(cause: BaseException) -> StorageError:
        try:
            try:
                raise cause
            except OSError as err:
                raise StorageError("output_dir: download of s3://b/x/train/chunk-0-1.bin failed (why)") from err
        except StorageError as err:
            return err

    assert _local_fault(failed(OSError(errno.ENOSPC, "No space left on device"))) == "No space left on device"
    assert _local_fault(failed(OSError(errno.EROFS, "Read-only file system"))) == "Read-only file system"
    assert _local_fault(failed(ConnectionResetError(errno.ECONNRESET, "reset"))) is None  # the store's: an outage
    line = "DDP_RECIPES_CACHE_DIR /c/k/train: chunk chunk-0-1.bin cannot be written there (No space left on device)"
    from_worker = StreamCacheError(f"Caught StreamCacheError in DataLoader worker process 1.\nTraceback (most "
                                   f"recent call last):\n  ...\nddp_recipes.data.stream.StreamCacheError: {line}")
    assert describe_outage(from_worker) == line and describe_outage(StreamCacheError(line)) == line


@pytest.mark.slow  # waits out one attempt: s3fs's 15 s read timeout, which s3fs itself retries (about 80 s)
def test_a_store_that_stops_answering_fails_the_read_instead_of_hanging(stream, s3, tmp_path, monkeypatch):
    """A store that stops answering mid-epoch (connections open, no answer): each request ends at the client's read
    timeout and is retried like any other transient error (here once: DDP_RECIPES_STORAGE_ATTEMPTS=1 in effect);
    then the read fails in one line. Nothing waits forever."""
    from ddp_recipes.data.stream import StreamSplit, StreamUnavailable, describe_outage
    from ddp_recipes.storage import retry

    monkeypatch.setattr(retry, "ATTEMPTS", 1)
    split = StreamSplit(f"{stream}/train", 48, str(tmp_path / "cache"))
    split.fetch_index()
    with reading(split, workers=1) as batches:
        next(batches)  # the worker has opened the split (litdata reads index.json then, through boto3's bounded
        # retries)
        s3.freeze(120)
        try:
            with pytest.raises(StreamUnavailable) as info:
                list(batches)
        finally:
            s3.reset_faults()
    line = describe_outage(info.value)
    assert re.fullmatch(r"reading train sample \d+ failed: download of \S+/train/chunk-0-\d+\.bin failed \(.*time.*\)",
                        line, re.IGNORECASE), line


# ---- slow: 2-rank runs stopped and continued, each attempt on a new machine -------------------------------------

@pytest.mark.slow  # two 2-rank runs (and the shared uninterrupted one)
def test_sigterm_mid_epoch_then_resume_auto_with_an_empty_cache_is_exact(stream, stream_straight, tmp_path):
    """SIGTERM to every process (ranks and loader workers) mid-epoch: the node's cache is gone when the last of
    them exits; the resumed run downloads again and ends equal to the run that was never stopped."""
    out, cache = tmp_path / "run", tmp_path / "machine-0"
    proc = launch(flags(stream), out, cache)
    seen = proc.wait_for_step(last_ckpt(out), 2, timeout=CAPTURED_STEP_LIMIT_S)
    proc.signal(signal.SIGTERM, group=True)  # every rank and loader worker, as a container stop does
    done = finished(proc, timeout=120)
    assert done.returncode == 128 + signal.SIGTERM, done.stderr[-3000:]
    assert seen <= saved_step(last_ckpt(out)) < STEPS_PER_EPOCH, "not stopped mid-epoch"
    assert not list(cache.rglob("*.bin")), "a stopped rank left its chunks behind"
    assert cache_folders(cache) == [], "a stopped run left its cache folder behind"
    done = finished(launch(flags(stream, "--resume", "auto"), out, tmp_path / "machine-1"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert_same_weights(stream_straight, last_ckpt(out))


def outage_line(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith(PROG) and "reading train sample" in line]


@pytest.mark.slow  # four 2-rank attempts and one 1-rank one
def test_an_outage_a_killed_rank_and_a_killed_job_each_resume_exactly_on_a_new_machine(stream, stream_straight, s3,
                                                                                      tmp_path):
    """One run, stopped three ways mid-epoch and continued each time with ``--resume auto`` from an empty cache:

    1. the store answers 503 from the 45th chunk request (of the 48 the two ranks read in epoch 0): the storage
       layer's retries, then one line naming --data-dir, every process gone, the last checkpoint kept (mid-epoch);
    2. the store back: rank 1 SIGKILLed mid-epoch (the job fails, last.ckpt is the last save before it);
       a copy of that folder resumed at world size 1 trains each of the epoch's remaining samples once;
    3. the job SIGKILLed mid-epoch;
    4. continued to the end: the weights of the run that was never stopped.
    """
    out, machines = tmp_path / "run", iter(tmp_path / f"machine-{i}" for i in range(9))
    last = last_ckpt(out)
    # 44 reads done: at least 20 per rank, so each rank's first 4 batches are whole (a worker that fails reads no
    # more) and the first failing read surfaces after the step-2 save; 4 are left to fail, in epoch 0.
    s3.fail(10**6, after=from_nth_train_get(45))
    try:
        down = finished(launch(flags(stream), out, next(machines), env={"DDP_RECIPES_STORAGE_BASE_DELAY_S": "0.05"}))
    finally:
        s3.reset_faults()
    said = outage_line(down.stderr)
    assert down.returncode == 2 and said, down.stderr[-3000:]
    assert re.fullmatch(rf"{re.escape(PROG)}--data-dir {stream}: reading train sample \d+ failed: download of "
                        rf"{stream}/train/chunk-0-\d+\.bin failed after 8 attempts \(.*Service is unavailable.*\); "
                        rf"training stopped; its last checkpoint is kept \({re.escape(str(last))}, step \d+\): rerun "
                        r"with --resume auto once the store answers", said[0]), said[0]
    assert "PrepareChunksThread" not in down.stderr  # litdata never fails a download: no report of its own
    outage_step = saved_step(last)
    assert 0 < outage_step < STEPS_PER_EPOCH, outage_step  # a mid-epoch save, not overwritten by a later one

    # 2. Rank 1 killed at the start of an odd step, so the last save is the step before it (every 2 steps).
    killed_at = outage_step + (3 if outage_step == 2 else 5)
    done = finished(launch(flags(stream, "--resume", "auto"), out, next(machines), chaos=("kill-rank1", killed_at -
                                                                                          outage_step)))
    assert done.returncode != 0 and saved_step(last) == killed_at - 1, done.stderr[-3000:]
    resized = tmp_path / "resized"
    shutil.copytree(out, resized)
    check_each_remaining_sample_once(stream, s3, resized, next(machines), killed_at - 1)

    # 3. The job killed at the start of an odd step past the epoch end: the last save is mid-epoch 1.
    after = 5 if killed_at - 1 == 4 else 3
    done = finished(launch(flags(stream, "--resume", "auto"), out, next(machines), chaos=("kill-job", after)))
    assert done.returncode != 0 and saved_step(last) == killed_at - 1 + after - 1, done.stderr[-3000:]

    done = finished(launch(flags(stream, "--resume", "auto"), out, next(machines)))
    assert done.returncode == 0, done.stderr[-3000:]
    assert saved_step(last) == 2 * STEPS_PER_EPOCH
    assert_same_weights(stream_straight, last)


def check_each_remaining_sample_once(stream: str, s3, out: Path, machine: Path, saved: int) -> None:
    """``out`` (2 ranks, stopped after ``saved`` steps) continued by 1 rank to the end of that epoch, on an empty
    cache: its loader gives exactly the epoch's samples the 2 ranks had not trained, each once; it takes one step
    per 4 of them; and each of them came from the store (one sample per chunk: the chunk requests name them)."""
    epoch, done_in_epoch = divmod(saved, STEPS_PER_EPOCH)
    order = ResumableSampler(list(range(48)), num_replicas=2, rank=0, seed=SEED)
    order.set_epoch(epoch)
    remaining = sorted(set(range(48)) - set(order.epoch_order()[:done_in_epoch * 2 * 4]))
    before, record = len(s3.requests), machine.with_suffix(".json")
    proc = start([CHAOS, "resnet", *flags(stream, "--resume", "auto", "--max-epochs", str(epoch + 1), devices=1),
                  "--output-dir", str(out)], env={"DDP_RECIPES_CACHE_DIR": str(machine), "CHAOS_RECORD": str(record)})
    done = finished(proc)
    assert done.returncode == 0, done.stderr[-3000:]
    trained = json.loads(record.read_text())
    assert trained["epoch"] == epoch and sorted(trained["samples"]) == remaining, (trained, remaining)
    assert saved_step(last_ckpt(out)) == saved + len(remaining) // 4
    sample = chunk_of_sample(s3, "train")
    assert set(remaining) <= {sample[name] for name in train_gets(s3.requests[before:])}
