"""The node's stream cache (:mod:`ddp_recipes.data.node_cache`): a folder per dataset, shared by the node's processes
through leases, removed by the last process that leaves it; a killed process's folder removed by the next join, a
live process's folder never. Each process here is a real one, killed by a real signal."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from ddp_recipes.data.node_cache import collect, dataset_key
from tests.launch import run, start

pytest.importorskip("fcntl", reason="leases are flocks; without them each process keeps a folder of its own")

# Joins KEY, says where, keeps a "chunk" there, and leaves (normally: exit hooks run) once GO exists.
HOLD = """
import sys, time
from pathlib import Path
from ddp_recipes.data.node_cache import join
folder = join(sys.argv[1])
(folder / "chunk.bin").write_bytes(b"x")
print("joined", folder, flush=True)
while not Path(sys.argv[2]).exists():
    time.sleep(0.05)
"""


def hold(key: str, go: Path, cache: Path):
    proc = start(["-c", HOLD, key, go], env={"DDP_RECIPES_CACHE_DIR": str(cache)}, port=False)
    return proc, Path(proc.wait_for_line("joined", timeout=120).split(" ", 1)[1])


def test_a_folder_is_shared_and_removed_when_the_last_process_leaves(tmp_path):
    cache, go = tmp_path / "cache", tmp_path / "go"
    (first, folder), (second, again) = hold("a" * 24, go / "1", cache), hold("a" * 24, go / "2", cache)
    assert folder == again == cache / "stream" / ("a" * 24)
    assert len(list((folder / "leases").iterdir())) == 2
    go.mkdir()
    (go / "1").touch()
    assert first.finish(timeout=60, check=True).returncode == 0
    assert (folder / "chunk.bin").is_file(), "removed while another process still uses it"
    (go / "2").touch()
    assert second.finish(timeout=60, check=True).returncode == 0
    assert not folder.exists(), "the last process to leave did not remove the folder"


def test_a_killed_processs_folder_goes_at_the_next_join_and_a_live_ones_stays(tmp_path, monkeypatch):
    cache, go = tmp_path / "cache", tmp_path / "go"
    (killed, dead), (alive, live) = hold("d" * 24, go / "d", cache), hold("e" * 24, go / "e", cache)
    killed.kill()  # SIGKILL: no exit hook runs
    assert (dead / "chunk.bin").is_file()
    script = "import sys, pathlib; from ddp_recipes.data.node_cache import join; join('f' * 24); " \
             "print(pathlib.Path(sys.argv[1]).exists(), pathlib.Path(sys.argv[2]).exists())"
    joined = run(["-c", script, dead, live], check=True, timeout=120, env={"DDP_RECIPES_CACHE_DIR": str(cache)},
                 port=False)
    assert joined.stdout.split() == ["False", "True"], "at the next join: the dead folder gone, the live one kept"
    assert not dead.exists() and not (cache / "stream" / ("f" * 24)).exists()
    assert (live / "chunk.bin").is_file(), "a live process's chunks were deleted under it"
    alive.signal(signal.SIGTERM)  # Python's default SIGTERM: no exit hook either
    alive.finish(timeout=60)
    assert (live / "chunk.bin").is_file()
    monkeypatch.setenv("DDP_RECIPES_CACHE_DIR", str(cache))
    assert collect() == [live] and not live.exists()


FORKED = """
import multiprocessing, sys
from ddp_recipes.data.node_cache import join

def rank(queue):
    queue.put(str(join(sys.argv[1])))

if __name__ == "__main__":
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=rank, args=(queue,))
    child.start()
    print("joined", queue.get(), flush=True)
    child.join()
    assert child.exitcode == 0
"""


def test_a_rank_started_by_fork_leaves_at_its_exit(tmp_path):
    """Lightning's fork launcher: a multiprocessing child ends in os._exit, past atexit."""
    done = run(["-c", FORKED, "c" * 24], check=True, timeout=120, env={"DDP_RECIPES_CACHE_DIR": str(tmp_path)},
               port=False)
    folder = Path(done.stdout.split("joined ", 1)[1].strip())
    assert folder.parent == tmp_path / "stream" and not folder.exists()


def test_the_key_is_the_url_and_every_index():
    index = {"train": b'{"updated_at": "1"}', "val": b"{}"}
    key = dataset_key("s3://b/d", index)
    assert key == dataset_key("s3://b/d/", dict(reversed(index.items())))
    assert key != dataset_key("s3://b/e", index)
    assert key != dataset_key("s3://b/d", {**index, "train": b'{"updated_at": "2"}'})  # converted again


def test_a_cache_root_that_cannot_be_made_is_one_line_naming_the_variable(tmp_path, monkeypatch):
    from ddp_recipes.data.node_cache import join
    from ddp_recipes.errors import ConfigError

    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("DDP_RECIPES_CACHE_DIR", str(blocker))  # (a read-only disk or another user's folder alike)
    with pytest.raises(ConfigError) as refused:
        join("k" * 24)
    line = refused.value.cli()
    assert line.startswith(f"DDP_RECIPES_CACHE_DIR {blocker / 'stream'}: the stream cache cannot be made there (")
    assert "\n" not in line and line.endswith("point DDP_RECIPES_CACHE_DIR at a writable local disk of this user's")


def test_a_test_that_fails_before_finish_leaves_no_process_running(tmp_path):
    """tests/conftest.py ends what a test started and left: here by hand, as the hook does after the call."""
    import os
    import time

    proc = start(["-c", "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
                        "'import time; time.sleep(600)']); print('up', flush=True); time.sleep(600)"], port=False)
    proc.wait_for_line("up", timeout=60)
    proc.end_leftovers()
    for _ in range(100):
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    raise AssertionError("the command's child outlived end_leftovers")
