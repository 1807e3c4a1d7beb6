"""The checkpoint a fit starts from is decided on rank 0 and checked on every rank: a rank that reads another
file at rank 0's path fails every rank in one line, a checkpoint without a run id continues at two ranks, and
a claim refused on rank 0 stops every rank. Each test is one rank of a fake 2-rank group, in-process."""

from __future__ import annotations

import pytest
import torch

from ddp_recipes.checkpointing.checkpoint import RUN_KEY
from ddp_recipes.checkpointing.run_folder import ownership
from ddp_recipes.errors import ConfigError


class _Strategy:
    """What agree() needs of a strategy, for one rank of a fake 2-rank group: rank 0's broadcast value."""

    def __init__(self, rank0: dict) -> None:
        self.rank0 = rank0

    def broadcast(self, obj):
        if isinstance(obj, tuple):  # the claim's outcome: rank 0 recorded the run
            return ("claim", None)
        return self.rank0


def test_a_rank_that_reads_another_file_at_rank_0s_path_fails_every_rank(tmp_path, monkeypatch):
    """rank 1 of 2 (the decision is rank 0's): it reads the checkpoint rank 0 chose, but finds another step there
    (a node-local disk); the gathered answer fails every rank with one line naming the rank and the fix."""
    from types import SimpleNamespace

    from ddp_recipes.checkpointing.last import LastCheckpoint
    from ddp_recipes.checkpointing.run_folder import resume

    folder = tmp_path / "checkpoints"
    folder.mkdir()
    torch.save({"state_dict": {}, "global_step": 3, "epoch": 0, RUN_KEY: {"run_id": "aaaaaaaaaaaa"}},
               folder / "last.ckpt")
    rank0 = {"path": str(folder / "last.ckpt"), "step": 6, "run_id": "aaaaaaaaaaaa", "ckpt_run": "aaaaaaaaaaaa",
             "folder": str(folder)}
    trainer = SimpleNamespace(is_global_zero=False, global_rank=1, strategy=_Strategy(rank0), callbacks=[],
                              fast_dev_run=False)
    monkeypatch.setattr(resume, "_gather", lambda problem: [None, problem])
    with pytest.raises(ConfigError) as info:
        resume.agree(trainer, LastCheckpoint(folder), resume.Continue(), fitting=True)
    text = info.value.cli()
    assert (f"rank 0 resumes from {folder / 'last.ckpt'} (step 6 of run aaaaaaaaaaaa), which rank 1 reads as "
            "step 3") in text
    assert "every rank must read the same checkpoints: put --output-dir on a filesystem every node shares" in text
    assert info.value.agreed  # printed by rank 0 only
    rank0["step"] = 3  # the same file: rank 1 takes rank 0's folder and run id
    last = LastCheckpoint(tmp_path / "elsewhere")
    assert resume.agree(trainer, last, resume.Continue(), fitting=True) == str(folder / "last.ckpt")
    assert last.dirpath == folder and last.run_id == "aaaaaaaaaaaa"
    assert not (folder / "run.json").exists()  # only rank 0 records the run


def test_a_checkpoint_without_a_run_id_continues_at_two_ranks(tmp_path, monkeypatch):
    """A checkpoint older than run ids (or plain Lightning's, given by path) gets a new run id for this fit;
    rank 1 must compare its own read of the file with what the file records (no id), not with that new id,
    or every resume of such a file at 2 ranks failed with the node-local-disk error."""
    from types import SimpleNamespace

    from ddp_recipes.checkpointing.last import LastCheckpoint
    from ddp_recipes.checkpointing.run_folder import resume

    folder = tmp_path / "checkpoints"
    folder.mkdir()
    torch.save({"state_dict": {}, "global_step": 7, "epoch": 0}, folder / "last.ckpt")  # no RUN_KEY
    rank0_trainer = SimpleNamespace(is_global_zero=True, global_rank=0, callbacks=[], checkpoint_callbacks=[],
                                    fast_dev_run=False, default_root_dir=str(tmp_path))
    for request in (resume.Continue(), str(folder / "last.ckpt")):
        decision = resume.decide(rank0_trainer, LastCheckpoint(folder), request, fitting=True)
        assert decision["ckpt_run"] is None and decision["run_id"], decision
        assert resume._check_same(decision, 1) is None
    trainer = SimpleNamespace(is_global_zero=False, global_rank=1, strategy=_Strategy(decision), callbacks=[],
                              fast_dev_run=False)
    monkeypatch.setattr(resume, "_gather", lambda problem: [None, problem])
    last = LastCheckpoint(folder)
    assert resume.agree(trainer, last, str(folder / "last.ckpt"), fitting=True) == str(folder / "last.ckpt")
    assert last.run_id == decision["run_id"]


def test_a_claim_refused_on_rank_0_stops_every_rank(tmp_path, monkeypatch):
    """Rank 0 records the run; when that fails (claimed meanwhile, read-only, a denied bucket) the outcome is
    broadcast, so rank 1 raises too instead of waiting in DDP's set-up for the collective timeout."""
    from types import SimpleNamespace

    from ddp_recipes.checkpointing.last import LastCheckpoint
    from ddp_recipes.checkpointing.run_folder import resume

    class Told:
        def __init__(self, outcome):
            self.outcome = outcome

        def broadcast(self, obj):
            return self.outcome if isinstance(obj, tuple) else obj

    folder = tmp_path / "checkpoints"
    rank1 = SimpleNamespace(is_global_zero=False, global_rank=1, strategy=Told(("claim", "CheckpointError: taken")),
                            fast_dev_run=False)
    with pytest.raises(ConfigError, match="rank 0 could not record the run in .*taken.*every rank stops") as info:
        resume._claim_on_rank_0(rank1, LastCheckpoint(folder))
    assert info.value.agreed
    sent = []

    class Records(Told):
        def broadcast(self, obj):
            sent.append(obj)
            return obj

    ownership.claim(folder, "bbbbbbbbbbbb")
    last = LastCheckpoint(folder)
    last.run_id = "aaaaaaaaaaaa"
    rank0 = SimpleNamespace(is_global_zero=True, global_rank=0, strategy=Records(None), fast_dev_run=False)
    with pytest.raises(ConfigError, match="was claimed by run bbbbbbbbbbbb"):
        resume._claim_on_rank_0(rank0, last)
    assert sent and sent[0][0] == "claim" and "was claimed by run bbbbbbbbbbbb" in sent[0][1]


def test_a_rank_checks_rank_0s_choice_against_the_header_it_read_before_the_launch(tmp_path):
    """A recipe's rank read its candidate's header before the launch: that read is its view of rank 0's choice,
    so it reads the file again only for a path it did not open (each rank loads the checkpoint whole once)."""
    from ddp_recipes.checkpointing.run_folder import resume

    path = str(tmp_path / "last.ckpt")  # not there now: the header read before the launch is what counts
    decision = {"path": path, "step": 6, "ckpt_run": "aaaaaaaaaaaa"}
    header = {"global_step": 6, "ddp_recipes_run": {"run_id": "aaaaaaaaaaaa"}}
    assert resume._check_same(decision, 1, resume.Continue(path, header)) is None
    stale = resume.Continue(path, {**header, "global_step": 3})
    assert "which rank 1 reads as step 3 of run aaaaaaaaaaaa" in resume._check_same(decision, 1, stale)
    assert "which rank 1 cannot read (no such file)" in resume._check_same(decision, 1, resume.Continue())
