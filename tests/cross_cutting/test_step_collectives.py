"""A pack training step issues no collective beyond DDP's own and reads nothing on the host (issues #31, #39).

At 2 gloo ranks, ``tests/scenarios/collective_scenario.py`` records (with the bench's counter,
``benchmarks/account/step_counts.py``), for every whole loop iteration (one training
batch's start to the next one's), the collectives issued on every process group (each group's sequence
number: DDP's C++ gradient-bucket all-reduces and buffer broadcasts included), the ``torch.distributed``
functions called from Python, and the host reads of tensor values, for the MNIST recipe's path and for plain
``L.Trainer(strategy="ddp")`` on the same module and data. Plain Lightning broadcasts a SIGTERM flag from
Python and reads it back at every step; the pack takes that out (its stop is agreed through the store), so
in every steady iteration (not the one that spans an epoch end and validation) the pack issues exactly DDP's
collectives, calls none from Python, and reads nothing outside a log step. What the pack adds at an epoch end
(the preemption vote's one all-reduce, DDPDiagnostics' gather, ``last.ckpt``'s random-state gather) stays
there: K = one epoch, docs/benchmark.md.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.account.step_counts import DDP_OWN
from tests.launch import run

ROOT = Path(__file__).resolve().parents[2]
SCENARIO = ROOT / "tests" / "scenarios" / "collective_scenario.py"


def _counts(out: Path, mode: str) -> list[list[dict]]:
    run([SCENARIO, out, mode], timeout=400, check=True)
    return [json.loads((out / f"{mode}-rank{r}.json").read_text()) for r in range(2)]


def steady(rows: list[dict]) -> list[dict]:
    """Iterations inside an epoch (not the one an epoch's end or the fit's end closes), after the fit's first
    (DDPDiagnostics' one-time check of the sharding gathers there)."""
    return [row for row in rows if row["spans"] == "step" and row["step"] > 1]


def lightnings(row: dict) -> list[str]:
    """The Python collective calls of an iteration beyond DDP's own buffer broadcast (``_broadcast_coalesced``,
    which DDP's forward calls from Python; its gradient all-reduces are C++)."""
    return [name for name in row["python"] if name not in DDP_OWN]


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> list[list[dict]]:
    return _counts(tmp_path_factory.mktemp("plain"), "plain")


def test_plain_lightning_broadcasts_and_reads_a_flag_at_every_step(plain):
    # What the pack takes out, seen by the same count: if a Lightning release drops it, this fails and the
    # pack's skip_sigterm_broadcast (checkpointing/preemption.py) can go.
    for rank in range(2):
        rows = steady(plain[rank])
        assert rows and all(lightnings(row) == ["broadcast"] for row in rows), rows
        assert all(row["reads"] >= 1 for row in rows), rows


def test_a_pack_step_issues_only_ddps_collectives_and_no_host_read(plain, tmp_path):
    pack = _counts(tmp_path, "pack")
    for rank in range(2):
        ours, theirs = steady(pack[rank]), steady(plain[rank])
        assert len(ours) == len(theirs) >= 12  # 2 epochs x 7 steady iterations, less the first
        # Every step alike after DDP's bucket rebuild (its second iteration broadcasts the new bucket order),
        # but an epoch's first, whose forward follows validation's and has no buffers to broadcast.
        per_step = {row["issued"] for row in theirs if row["step"] > 2 and row["batch_idx"] > 0}
        assert len(per_step) == 1 and min(per_step) >= 3, theirs  # bucket all-reduce(s) + buffers + the flag
        python = [(row["step"], row["python"]) for row in ours if lightnings(row)]
        assert not python, f"rank {rank}: (step, collectives the pack's step called from Python): {python}"
        other = [(a["step"], a["issued"], b["issued"])
                 for a, b in zip(ours, theirs, strict=True) if a["issued"] != b["issued"] - 1]
        assert not other, f"rank {rank}: (step, pack's collectives, plain's) beyond DDP's own: {other}"
        reads = [(row["step"], row["reads"]) for row in ours if row["reads"] and not row["logs"]]
        assert not reads, f"rank {rank}: (step, host reads) in steps that do not log: {reads}"
        assert {row["groups"] for row in ours} == {row["groups"] for row in theirs}  # no process group of its own
        # The epoch end is where the pack's own collectives go (vote, diagnostics, checkpoint state).
        at_epoch_end = [(a["issued"], b["issued"]) for a, b in zip(pack[rank], plain[rank], strict=True)
                        if a["spans"] == "epoch_end"]
        assert at_epoch_end and all(a > b for a, b in at_epoch_end), at_epoch_end


def test_without_last_ckpt_the_stop_agreement_still_replaces_lightnings_per_step_broadcast(plain, tmp_path):
    # build_trainer(enable_checkpointing=False): no LastCheckpoint, the agreement alone (preemption=False: Lightning's).
    alone = _counts(tmp_path, "pack-no-checkpointing")
    for rank in range(2):
        ours, theirs = steady(alone[rank]), steady(plain[rank])
        assert len(ours) == len(theirs) >= 12
        python = [(row["step"], row["python"]) for row in ours if lightnings(row)]
        assert not python, f"rank {rank}: (step, collectives called from Python): {python}"
        reads = [(row["step"], row["reads"]) for row in ours if row["reads"] and not row["logs"]]
        assert not reads, f"rank {rank}: (step, host reads) in steps that do not log: {reads}"
        assert [b["issued"] - a["issued"] for a, b in zip(ours, theirs, strict=True)] == [1] * len(ours)


@pytest.mark.slow  # a third 2-rank fit, only to show the count sees what it must catch
def test_the_count_sees_a_per_step_vote_on_a_group_of_its_own(plain, tmp_path):
    voted = _counts(tmp_path, "pack-per-step-vote")
    for rank in range(2):
        ours, theirs = steady(voted[rank]), steady(plain[rank])
        assert [a["issued"] - b["issued"] for a, b in zip(ours, theirs, strict=True)] == [0] * len(ours)
        assert all(lightnings(row) == ["all_reduce"] for row in ours)  # its all-reduce for Lightning's broadcast
