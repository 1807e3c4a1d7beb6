"""A user's own litdata ``StreamingDataLoader`` given to ``build_trainer`` (issue #42, item 4): litdata splits the
stream by rank and keeps its own position, Lightning saves that position in the pack's checkpoint, and the pack
makes the resume exact: the state loads into another cache folder, the epoch after the resumed one is whole, and
the loader's workers' base seed is not drawn from training's random stream. A dataset built before the process
group is refused in one line.

Real litdata over a dataset the pack's converter wrote, on moto's S3 server (tests/s3server.py); the 2-rank runs
are ``tests/scenarios/litdata_scenario.py``.
"""

from __future__ import annotations

import importlib.util
import json
import signal
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from ddp_recipes import build_trainer
from ddp_recipes.data.convert import main as convert
from ddp_recipes.data.litdata_lib import STREAM_EXTRA, adopt_litdata_loader, import_litdata
from ddp_recipes.errors import ConfigError
from tests.helpers import assert_same_weights, last_ckpt
from tests.launch import run, saved_step, start
from tests.tiny_modules import TinyNet

pytestmark = pytest.mark.skipif(importlib.util.find_spec("litdata") is None,
                                reason=f"litdata is the stream extra: {STREAM_EXTRA}")
ROOT = Path(__file__).resolve().parents[2]
SCENARIO = ROOT / "tests" / "scenarios" / "litdata_scenario.py"
WAIT_S = 300


@pytest.fixture(scope="module")
def bucket_stream(images, s3, tmp_path_factory) -> str:
    """48 training images in ~4 KB chunks (a couple of dozen), in a bucket: what a user streams from."""
    url = f"{s3.bucket('user-stream')}/tiny"
    assert convert([str(images), url, "--chunk-bytes", "4KB", "--workers", "1",
                    "--staging", str(tmp_path_factory.mktemp("staging"))]) == 0
    return f"{url}/train"


def loader(url: str, cache: Path, **kwargs):
    litdata = import_litdata()
    dataset = litdata.StreamingDataset(url, shuffle=True, seed=7, cache_dir=str(cache), **kwargs)
    return litdata.StreamingDataLoader(dataset, batch_size=4, num_workers=0)


def paths(batches) -> list[list[str]]:
    return [list(batch["path"]) for batch in batches]


def test_a_saved_position_resumes_in_another_cache_folder(bucket_stream, tmp_path):
    """litdata alone refuses the state in a new cache folder; adopted, the rest of the epoch follows exactly."""
    whole = paths(loader(bucket_stream, tmp_path / "a"))
    assert len(whole) == 12
    first = loader(bucket_stream, tmp_path / "a")
    it = iter(first)
    head = [list(next(it)["path"]) for _ in range(5)]
    state = first.state_dict()
    del it
    plain = loader(bucket_stream, tmp_path / "b")
    plain.load_state_dict(json.loads(json.dumps(state)))
    with pytest.raises(ValueError, match="input_dir` path state doesn't match"):
        next(iter(plain))
    moved = loader(bucket_stream, tmp_path / "c")
    adopt_litdata_loader(moved, 1, 0, seed=0, gather=lambda built: [built])
    moved.load_state_dict(json.loads(json.dumps(state)))
    assert head + paths(moved) == whole


def test_a_position_saved_at_another_world_size_is_named(bucket_stream, tmp_path, monkeypatch):
    first = loader(bucket_stream, tmp_path / "a")
    it = iter(first)
    next(it)
    state = first.state_dict()  # world size 1
    del it
    monkeypatch.setenv("WORLD_SIZE", "2")  # rank 0 of 2, as litdata reads it
    wider = loader(bucket_stream, tmp_path / "b")
    adopt_litdata_loader(wider, 2, 0, seed=0, gather=lambda built: [built, [(2, 1)]])
    with pytest.warns(UserWarning, match=r"litdata resumes a position saved at world size 1 at world size 2: it "
                                         r"repeats up to world size x batch size - 1 samples"):
        wider.load_state_dict(state)


def test_a_dataset_built_for_another_world_is_refused_in_one_line(bucket_stream, tmp_path, monkeypatch):
    """What a top-level dataset under torchrun records (litdata reads WORLD_SIZE but not RANK): world 2, rank 0."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    early = loader(bucket_stream, tmp_path / "cache")
    monkeypatch.delenv("WORLD_SIZE")
    trainer = build_trainer(accelerator="cpu", max_steps=1, default_root_dir=str(tmp_path), logger=False,
                            enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ConfigError) as info:
        trainer.fit(TinyNet(), early)
    text = str(info.value)
    assert text.startswith("train_dataloader: its litdata StreamingDataset (StreamingDataset) split the data for "
                           "world size 2, rank 0 on rank 0 of a 1-rank run") and "\n" not in text, text
    assert "build it inside train_dataloader() or setup()" in text


def test_a_plain_iterable_loader_is_still_named(tmp_path):
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter([(torch.ones(4), torch.tensor(0))] * 4)

    trainer = build_trainer(accelerator="cpu", max_steps=1, default_root_dir=str(tmp_path), logger=False,
                            enable_progress_bar=False, enable_model_summary=False)
    with pytest.warns(UserWarning, match=r"train_dataloader: an IterableDataset \(Stream\): it cannot be repositioned"):
        trainer.fit(TinyNet(), DataLoader(Stream(), batch_size=2))


def scenario(out: Path, data: str, cache: Path, *extra: str, step_s: float = 0.0):
    return start([SCENARIO, out, data, 2, *extra], env={"SCENARIO_CACHE": str(cache), "SCENARIO_STEP_S": str(step_s)})


@pytest.mark.slow  # a 2-rank launch (~25 s on 2 shared cores)
def test_a_dataset_built_before_the_process_group_is_refused_on_every_rank(bucket_stream, tmp_path):
    done = scenario(tmp_path / "out", bucket_stream, tmp_path / "cache", "--build-early").finish(timeout=WAIT_S)
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if "ConfigError: train_dataloader: its litdata" in line]
    assert len(lines) == 2, done.stderr[-3000:]  # each rank says it, naming the world the dataset split for
    assert all("split the data for world size 1, rank 0 on rank" in line and "of a 2-rank run" in line
               for line in lines), lines


@pytest.mark.slow  # three 2-rank runs
def test_sigterm_mid_epoch_then_ckpt_path_last_in_a_new_empty_cache_is_exact(bucket_stream, tmp_path):
    """2 ranks, 2 litdata workers each, litdata's shuffle, dropout: stopped mid-epoch, resumed on "another machine"
    (a new, empty cache folder): the same samples in the same order, and the weights of the run never stopped."""
    straight, out = tmp_path / "straight", tmp_path / "stopped"
    scenario(straight, bucket_stream, tmp_path / "cache-s").finish(timeout=WAIT_S, check=True)
    assert saved_step(last_ckpt(straight)) == 12
    # stopped in epoch 0, so the resumed run also shows that the epoch after the resumed one is whole
    proc = scenario(out, bucket_stream, tmp_path / "cache-a", step_s=0.5)
    seen = proc.wait_for_step(last_ckpt(out), 1, timeout=WAIT_S)
    proc.signal(signal.SIGTERM)  # the launcher, as a job controller does; the pack stops every rank
    done = proc.finish(timeout=WAIT_S)
    assert done.returncode == 128 + signal.SIGTERM, done.stderr[-3000:]
    step = saved_step(last_ckpt(out))
    assert seen <= step < 6, "not stopped mid-epoch"
    state = torch.load(last_ckpt(out), map_location="cpu", weights_only=True)["loops"]["fit_loop"]["state_dict"]
    position = state["combined_loader"][0]
    # the position of the save, in the pack's checkpoint: step batches of 4 per rank into epoch 1 of litdata's count
    assert (position["current_epoch"], position["num_samples_yielded"]) == (1, 4 * step), position
    assert position["dataset"]["cache_dir_path"] == str(tmp_path / "cache-a")
    run([SCENARIO, out, bucket_stream, 2], env={"SCENARIO_CACHE": str(tmp_path / "cache-b")}, timeout=WAIT_S,
        check=True)
    assert saved_step(last_ckpt(out)) == 12
    assert_same_weights(last_ckpt(out), last_ckpt(straight))
    trained, resumed = (json.loads((o / "result.json").read_text())["seen"] for o in (straight, out))
    assert all(resumed[r] == trained[r][4 * step:] for r in range(2))  # each rank: the rest, in order
    assert not set(trained[0][:24]) & set(trained[1][:24])  # the ranks' shards of an epoch are disjoint
