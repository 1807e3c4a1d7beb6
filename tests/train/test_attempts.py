"""Each launch of a run leaves an attempt record; summary.json sums what the stops between them cost (issue #43.4)."""

from __future__ import annotations

import json

import pytest

from ddp_recipes.checkpointing.run_folder.ownership import ATTEMPTS_DIR
from ddp_recipes.modules.resnet import ResNetClassifier
from ddp_recipes.train.attempts import read_attempts
from ddp_recipes.train.summary import stop_costs
from recipes import resnet

TINY = ["--accelerator", "cpu", "--data", "synthetic", "--image-size", "16", "--synthetic-samples", "64",
        "--synthetic-val-samples", "0", "--batch-size", "16", "--lr", "0.05", "--no-cosine"]  # 4 steps per epoch


def test_stop_costs_counts_redone_steps_and_the_time_to_the_next_first_step():
    records = [
        # SIGTERM: saved where it stopped, nothing to redo
        {"attempt": 1, "started_at": 100.0, "train_started_at": 110.0, "start_step": 0, "last_step": 16,
         "last_step_at": 150.0, "ended": "preempted by SIGTERM", "ended_at": 151.0, "first_step_at": 112.0},
        # SIGKILL (no end recorded) at step 23, seen last at 190; resumed from the step-20 checkpoint
        {"attempt": 2, "started_at": 160.0, "train_started_at": 170.0, "start_step": 16, "last_step": 23,
         "last_step_at": 190.0, "ended": None, "first_step_at": 171.0},
        {"attempt": 3, "started_at": 200.0, "train_started_at": 205.0, "start_step": 20, "last_step": 30,
         "last_step_at": 240.0, "ended": "finished", "ended_at": 240.0, "first_step_at": 206.5},
    ]
    costs = stop_costs(records, ended_at=250.0)
    assert costs["attempts"] == 3 and costs["steps_redone"] == 3
    first, second = costs["stops"]
    assert (first["how"], first["steps_redone"], first["seconds_to_first_step"]) == ("preempted by SIGTERM", 0, 20.0)
    assert second["how"].startswith("killed") and second["steps_redone"] == 3
    assert second["seconds_to_first_step"] == 16.5 and second["resumed_from_step"] == 20
    assert costs["wall_seconds"] == 150.0
    assert costs["training_seconds"] == pytest.approx(41 + 20 + 35)
    assert costs["goodput"] == pytest.approx(96 / 150, abs=1e-4)
    assert stop_costs([]) == {}


def test_a_run_and_its_continuation_leave_two_records_and_one_stop(tmp_path):
    common = [*TINY, "--output-dir", str(tmp_path)]
    resnet.main([*common, "--max-steps", "4"])
    resnet.main([*common, "--max-steps", "6", "--resume", "auto"])
    records = read_attempts(tmp_path / ATTEMPTS_DIR)
    assert [(r["attempt"], r["start_step"], r["last_step"], r["ended"]) for r in records] == [
        (1, 0, 4, "finished"), (2, 4, 6, "finished")]
    assert all(r["first_step_at"] >= r["train_started_at"] >= r["started_at"] for r in records)
    summary = json.loads((tmp_path / "summary.json").read_text())
    stops = summary["stops"]
    assert stops["attempts"] == 2 and stops["steps_redone"] == 0
    assert [s["how"] for s in stops["stops"]] == ["finished"]
    assert stops["stops"][0]["seconds_to_first_step"] > 0
    assert 0 < stops["goodput"] <= 1 and stops["training_seconds"] <= stops["wall_seconds"]


class _BrokenOptimizers(ResNetClassifier):
    """Fails after the run claimed its folder and before on_fit_start (Lightning sets up the optimizers there)."""

    def configure_optimizers(self):
        raise RuntimeError("a bug in configure_optimizers")


def test_a_run_that_fails_before_on_fit_start_leaves_the_folder_to_the_same_command(tmp_path):
    out = ["--output-dir", str(tmp_path), "--max-steps", "2"]
    with pytest.raises(RuntimeError, match="a bug in configure_optimizers"):
        resnet.main([*TINY, *out], model_cls=_BrokenOptimizers)
    (record,) = read_attempts(tmp_path / ATTEMPTS_DIR)
    assert record["ended"] == "error: RuntimeError" and record["run_id"]
    summary = resnet.main([*TINY, *out])  # the bug fixed, the same command: a new run, not refused
    assert summary["steps"] == 2 and summary["stops"]["attempts"] == 1
