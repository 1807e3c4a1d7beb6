"""One resume path: a 2-rank run continued with ``--resume auto`` decides its checkpoint on rank 0 and every rank
loads it once (Lightning's restore); everything before that reads headers (``torch.load(mmap=True)``: the
pickled structure, no tensor bytes) or manifests only.

Every ``torch.load`` of the two rank processes is counted by a ``sitecustomize`` on the children's
``PYTHONPATH``, one log file per process."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import pytest

from tests.helpers import MNIST_CPU
from tests.launch import ROOT, launch_env, run
from tests.marks import needs_mnist

COUNTER = """
import json, os

import torch

_real = torch.load


def _counted(f, *args, **kwargs):
    name = f if isinstance(f, (str, os.PathLike)) else getattr(f, "name", None) or getattr(f, "path", None)
    entry = {"file": os.path.basename(str(name)), "mmap": bool(kwargs.get("mmap")),
             "rank": os.environ.get("LOCAL_RANK", "0")}
    with open(os.path.join(os.environ["LOAD_LOG"], f"{os.getpid()}.jsonl"), "a") as log:
        log.write(json.dumps(entry) + "\\n")
    return _real(f, *args, **kwargs)


torch.load = _counted
"""


def loads(log: Path) -> dict[str, Counter]:
    """Per rank: how many whole loads and header reads of each checkpoint file (other loads, a dataset's, are
    not counted)."""
    counts: dict[str, Counter] = {}
    for file in log.glob("*.jsonl"):
        for line in file.read_text().splitlines():
            entry = json.loads(line)
            if not entry["file"].endswith(".ckpt"):
                continue
            kind = "header" if entry["mmap"] else "whole"
            counts.setdefault(entry["rank"], Counter())[f"{kind} {entry['file']}"] += 1
    return counts


@needs_mnist
@pytest.mark.slow
def test_a_continued_two_rank_run_loads_its_checkpoint_once_per_rank(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(COUNTER)
    out = tmp_path / "out"
    common = ["-m", "recipes.mnist", *MNIST_CPU, "--devices", "2", "--output-dir", out]
    first = run([*common, "--max-steps", "12"], timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    log = tmp_path / "loads"
    log.mkdir()
    env = launch_env(extra={"LOAD_LOG": str(log)})
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(site), env["PYTHONPATH"]])
    second = run([*common, "--max-steps", "24", "--resume", "auto"], env=env, timeout=600)
    assert second.returncode == 0, second.stderr[-3000:]
    counts = loads(log)
    assert set(counts) == {"0", "1"}, counts
    for rank in ("0", "1"):
        whole = {k: n for k, n in counts[rank].items() if k.startswith("whole")}
        assert whole == {"whole last.ckpt": 1}, (rank, counts)
    # The header reads: before the launch every rank's process opens --resume (the checks of the run's input;
    # rank 1 checks rank 0's choice against that read), and rank 0 reads it again to decide in the ranks.
    # (Before #53: rank 0 3 header reads and 2 whole loads, rank 1 2 and 2.)
    assert counts["0"]["header last.ckpt"] == 2 and counts["1"]["header last.ckpt"] == 1, counts
