"""A pack training step issues no collective beyond DDP's own (issue #31): counted, not timed.

At 2 gloo ranks, ``tests/scenarios/collective_scenario.py`` records the collectives issued on every process group
between consecutive training batch ends (each group's sequence number: DDP's C++ gradient-bucket
all-reduces and buffer broadcasts included) for the MNIST recipe's path and for plain
``L.Trainer(strategy="ddp")`` on the same module and data. In every steady interval (not the one that
spans an epoch end and validation) the pack issues exactly plain Lightning's collectives. What the pack adds
at an epoch end (the preemption vote's one all-reduce, DDPDiagnostics' gather, ``last.ckpt``'s random-state
gather) stays there: K = one epoch, docs/benchmark.md.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.launch import run

ROOT = Path(__file__).resolve().parents[2]
SCENARIO = ROOT / "tests" / "scenarios" / "collective_scenario.py"


def _counts(out: Path, mode: str) -> list[list[dict]]:
    run([SCENARIO, out, mode], timeout=400, check=True)
    return [json.loads((out / f"{mode}-rank{r}.json").read_text()) for r in range(2)]


def steady(rows: list[dict]) -> list[dict]:
    """Intervals inside an epoch: an epoch's first batch end closes the interval that held the epoch end."""
    return [row for row in rows if row["batch_idx"] > 0]


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> list[list[dict]]:
    return _counts(tmp_path_factory.mktemp("plain"), "plain")


def test_a_pack_step_issues_exactly_plain_lightnings_collectives(plain, tmp_path):
    pack = _counts(tmp_path, "pack")
    for rank in range(2):
        ours, theirs = steady(pack[rank]), steady(plain[rank])
        assert len(ours) == len(theirs) >= 12  # 2 epochs x 7 steady intervals
        # Every step alike after DDP's bucket rebuild (its second iteration broadcasts the new bucket order).
        per_step = {row["collectives"] for row in theirs if row["step"] > 2}
        assert len(per_step) == 1 and min(per_step) >= 2, theirs  # DDP's bucket all-reduce(s) + buffer broadcast
        extra = [(row["step"], row["collectives"], other["collectives"], row["python"])
                 for row, other in zip(ours, theirs, strict=True) if row["collectives"] != other["collectives"]]
        assert not extra, (f"rank {rank}: (step, pack's collectives, plain's, the pack's Python calls) where the "
                           f"pack's step issued other collectives than plain Lightning's: {extra}")
        assert {row["groups"] for row in ours} == {row["groups"] for row in theirs}  # no process group of its own
        # The epoch end is where the pack's own collectives go (vote, diagnostics, checkpoint state).
        at_epoch_end = [(a["collectives"], b["collectives"]) for a, b in zip(pack[rank], plain[rank], strict=True)
                        if a["batch_idx"] == 0]
        assert at_epoch_end and all(a > b for a, b in at_epoch_end), at_epoch_end


@pytest.mark.slow  # a third 2-rank fit, only to show the count sees what it must catch
def test_the_count_sees_a_per_step_vote_on_a_group_of_its_own(plain, tmp_path):
    voted = _counts(tmp_path, "pack-per-step-vote")
    for rank in range(2):
        ours, theirs = steady(voted[rank]), steady(plain[rank])
        assert [a["collectives"] - b["collectives"] for a, b in zip(ours, theirs, strict=True)] == [1] * len(ours)
        assert all("all_reduce" in row["python"] for row in ours)
