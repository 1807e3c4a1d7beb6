"""The preemption vote's watcher tells a store wait that timed out (wait again) from a store that has gone (stop
watching) by the exception's type, as torch raises them (``DistStoreError`` for a timed-out wait,
``DistNetworkError`` for a closed connection; torch 2.11-2.15), never by the words of its message. One process,
real TCPStores; this process plays rank 1, the test rank 0."""

from __future__ import annotations

import subprocess
import sys
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from ddp_recipes.checkpointing import vote as vote_module
from ddp_recipes.checkpointing.vote import STOP_KEY, StopVote
from tests.helpers import free_port


class _Reworded:
    """A real store whose timed-out wait says so in other words (stores differ: "Wait timeout", "wait timeout
    after ...ms"; a store a launcher provides may say "timed out")."""

    def __init__(self, store) -> None:
        self._store = store

    def clone(self):
        return _Reworded(self._store.clone())

    def wait(self, keys, timeout):
        try:
            self._store.wait(keys, timeout)
        except dist.DistStoreError:
            raise dist.DistStoreError("the keys did not come in time") from None

    def __getattr__(self, name):
        return getattr(self._store, name)


def _client(port: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, 2, False, timedelta(seconds=30))


def test_the_watcher_waits_again_after_a_timed_out_wait_whatever_its_words(monkeypatch):
    monkeypatch.setattr(vote_module, "WATCH_POLL", timedelta(milliseconds=50))  # several timeouts before the stop
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, 2, True, timedelta(seconds=30), wait_for_workers=False)
    for store in (server, _Reworded(server)):
        vote = StopVote(store, 1, 2, torch.device("cpu"))
        rank0 = _client(port)
        threading.Event().wait(0.3)  # the watcher's waits time out a few times
        rank0.compare_set(STOP_KEY, "", "5:15")  # rank 0 announces a stop at step 5 (SIGTERM)
        rank0.wait(["ack/1"], timedelta(seconds=10))  # the watcher acknowledged it
        assert vote.at_boundary(4, 0) == 0 and vote.at_boundary(5, 0) == 15
        vote.close()
        server.delete_key(STOP_KEY)
        server.delete_key("ack/1")


def test_the_watcher_ends_when_the_store_has_gone():
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-c", "import sys, datetime, torch.distributed as d; "
         f"s = d.TCPStore('127.0.0.1', {port}, 2, True, datetime.timedelta(seconds=30), wait_for_workers=False); "
         "print('up', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "up"
        vote = StopVote(_client(port), 1, 2, torch.device("cpu"))
        assert vote._watcher is not None and vote._watcher.is_alive()
    finally:
        server.stdin.close()  # rank 0 ends: its store goes with it
        server.wait(timeout=30)
    vote._watcher.join(timeout=30)
    assert not vote._watcher.is_alive()
