"""DDPDiagnostics: every CPU-detectable row of the troubleshooting table, induced on purpose and found.

Two 2-process gloo runs of tests/scenarios/diag_scenarios.py (one with all the mistakes, one clean), a 1-process
run in this process, and the decision functions with made-up numbers (the CUDA memory row among them).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

from ddp_recipes import build_trainer
from ddp_recipes.config.cli import parse_config
from ddp_recipes.config.run_config import RunConfig
from ddp_recipes.train.diagnostic_rules import (
    batch_fingerprint,
    far_apart,
    first_tensor,
    identical_ranks,
    loss_diverged,
    memory_imbalance,
    params_drifted,
    sampler_sharding,
    shuffle_coincidence_chance,
    unsharded_ranks,
)
from ddp_recipes.train.diagnostics import DDPDiagnostics, DDPDiagnosticWarning
from ddp_recipes.train.trainer import trainer_for
from tests.launch import run
from tests.scenarios.diag_scenarios import FrozenEpochSampler, Net, dataset

SCRIPT = Path(__file__).resolve().parents[1] / "scenarios" / "diag_scenarios.py"
CPU_CODES = {"unsharded-data", "sampler-epoch", "param-drift", "loss-divergence", "unused-params",
             "small-batch-bn", "lr-not-scaled"}


def run_scenario(out: Path, scenario: str) -> tuple[subprocess.CompletedProcess, dict[int, dict]]:
    # quiet=False: the warnings are what we look for
    proc = run([SCRIPT, scenario, out], timeout=240, drop=["MASTER_ADDR"], quiet=False, check=True)
    return proc, {int(p.stem[4:]): json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))}


@pytest.fixture(scope="module")
def bad(tmp_path_factory):
    return run_scenario(tmp_path_factory.mktemp("diag") / "bad", "bad")


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    return run_scenario(tmp_path_factory.mktemp("diag") / "clean", "clean")


EXPECTED = {
    "unsharded-data": ["same first training batch", "FrozenEpochSampler(num_replicas=1, rank=0, shuffle=True)",
                       "not sharded", "all 2 ranks use a DistributedSampler built for another world "
                       "(this run needs num_replicas=2, rank=the global rank)",
                       "Fix: let Lightning insert a DistributedSampler"],
    "sampler-epoch": ["epoch 1 began with the same batch as epoch 0", "shuffles", "sampler.set_epoch(epoch)"],
    "param-drift": ["parameters differ across ranks", "rank 0:", "rank 1:", "outside DDP",
                    "step the same optimizer"],
    "loss-divergence": ["mean training loss of epoch 0", "rank 0:", "rank 1:", "data sharding", "labels"],
    # the scenario is a build_trainer script: the fixes name its arguments, not a recipe's flags
    "unused-params": ["2 parameter(s) received no gradient", "aux_head.weight", "aux_head.bias",
                      "find_unused_parameters=True", "requires_grad=False"],
    "small-batch-bn": ["body.1", "per-device batch of 4", "world size 2", "build_trainer(sync_batchnorm=True)"],
    "lr-not-scaled": ["global batch is 8", "tuned for batch 64", "lr_scaling none", "scale the module's LR with the "
                      "global batch", "warm it up"],
}


@pytest.mark.parametrize("code", sorted(EXPECTED))
def test_each_mistake_is_found_once_with_its_fix(bad, code):
    proc, ranks = bad
    assert set(ranks) == {0, 1}
    messages = dict(ranks[0]["findings"])
    assert set(messages) == CPU_CODES  # nothing else (memory-imbalance is CUDA-only)
    for text in EXPECTED[code]:
        assert text in messages[code], (code, text, messages[code])
    assert "--" not in messages[code].replace("---", ""), messages[code]  # no recipe flag on the library path
    # Warned once, by rank 0 only, with the stable prefix; rank 1 reached the same cross-rank verdicts.
    assert proc.stderr.count(f"DDPDiagnostics: [{code}]") == 1, proc.stderr[-3000:]
    assert code in dict(ranks[1]["findings"])


def test_clean_run_reports_nothing(clean):
    proc, ranks = clean
    for rank in (0, 1):
        assert ranks[rank]["findings"] == []
        assert CPU_CODES <= set(ranks[rank]["checked"])  # the checks ran; they found nothing
    assert "DDPDiagnostics" not in proc.stderr + proc.stdout


def test_one_process_runs_local_checks_only(tmp_path):
    trainer = build_trainer(devices=1, accelerator="cpu", seed=3, lr_scaling="sqrt", warmup_epochs=0,
                            reference_batch=64, max_epochs=2, limit_train_batches=3, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            default_root_dir=tmp_path)
    data = dataset()
    loader = DataLoader(data, batch_size=4, sampler=FrozenEpochSampler(data, num_replicas=1, rank=0, shuffle=True))
    with pytest.warns(DDPDiagnosticWarning) as caught:
        trainer.fit(Net(unused_head=True, drift=False), loader)
    diag = next(c for c in trainer.callbacks if isinstance(c, DDPDiagnostics))
    assert [code for code, _ in diag.findings] == ["unused-params", "sampler-epoch"]
    assert diag.checked == {"unused-params", "sampler-epoch", "lr-not-scaled"}  # no cross-rank check, no BN
    ours = [str(w.message) for w in caught if issubclass(w.category, DDPDiagnosticWarning)]
    assert [m.split("]")[0] for m in ours] == ["DDPDiagnostics: [unused-params", "DDPDiagnostics: [sampler-epoch"]


# ---- decisions with made-up numbers ---------------------------------------------------------------------


def test_memory_imbalance_decision():
    gib = 2**30
    assert memory_imbalance([2 * gib, 8 * gib])  # 4x and 6 GiB apart: rank-0-only work on the GPU
    assert not memory_imbalance([10 * gib, 14 * gib])  # 1.4x: normal jitter
    assert not memory_imbalance([0.2 * gib, 0.9 * gib])  # 4.5x but 0.7 GiB: too small to matter
    assert not memory_imbalance([5 * gib])


def test_loss_and_drift_decisions():
    assert loss_diverged([1.5, 15.3]) and not loss_diverged([0.1, 0.35])  # 3.5x but only 0.25 apart
    assert not loss_diverged([1.0, 2.9]) and not loss_diverged([-1.0, 5.0]) and not loss_diverged([1.0, float("nan")])
    assert far_apart([1.0, float("nan"), 10.0], 3.0, 0.5)
    same = torch.tensor([[30.25, 12.5], [30.25, 12.5]], dtype=torch.float64)
    assert not params_drifted(same)
    assert params_drifted(same + torch.tensor([[0.0, 0.0], [0.0, 1e-3]], dtype=torch.float64))


def test_fingerprint_sees_order_and_never_matches_without_tensors():
    x = torch.arange(24.0).reshape(6, 4)
    assert torch.equal(batch_fingerprint((x, x[:, 0])), batch_fingerprint([x.clone()]))
    assert not torch.equal(batch_fingerprint(x), batch_fingerprint(x[[1, 0, 2, 3, 4, 5]]))
    assert first_tensor({"ids": [x], "mask": None}) is x
    rows = torch.stack([batch_fingerprint(x), batch_fingerprint(x + 1), batch_fingerprint(x), batch_fingerprint("a")])
    assert identical_ranks(rows) == [0, 2]
    assert identical_ranks(torch.stack([batch_fingerprint(None)] * 2)) == []
    assert shuffle_coincidence_chance(64, 4) < 1e-6 < shuffle_coincidence_chance(32, 4)


def test_sharding_verdict():
    data = dataset()
    expected = {"num_replicas": 2, "rank": 1}
    assert sampler_sharding(DistributedSampler(data, num_replicas=2, rank=1), expected) == 1.0
    assert sampler_sharding(DistributedSampler(data, num_replicas=1, rank=0), expected) == -1.0
    assert sampler_sharding(RandomSampler(data), expected) == 0.0
    fp = batch_fingerprint(torch.ones(4, 3))

    def rows(*flags: float) -> torch.Tensor:  # two ranks with the same first batch, and their sampler flags
        return torch.stack([torch.cat([fp, torch.tensor([f], dtype=torch.float64)]) for f in flags])

    assert unsharded_ranks(rows(0.0, 0.0)) == ([], [0, 1])  # same batches, no DistributedSampler
    assert unsharded_ranks(rows(-1.0, -1.0)) == ([0, 1], [0, 1])  # DistributedSampler(num_replicas=1)
    assert unsharded_ranks(rows(1.0, 1.0)) == ([], [])  # correctly sharded, the data just looks alike


def test_build_trainer_and_cli_wiring():
    cfg = parse_config(RunConfig, ["--devices", "1", "--batch-size", "32", "--lr-scaling", "sqrt"])
    plan = cfg.plan  # resolved once, frozen; trainer_for reads it whole
    assert plan.diagnostics is True
    assert (plan.lr_scaling, plan.reference_batch, plan.batch.global_batch) == ("sqrt", 64, 32)
    trainer = trainer_for(cfg.plan, logger=False, enable_checkpointing=False)
    diag = [c for c in trainer.callbacks if isinstance(c, DDPDiagnostics)]
    assert len(diag) == 1 and (diag[0].lr_scaling, diag[0].global_batch) == ("sqrt", 32)
    off = parse_config(RunConfig, ["--devices", "1", "--no-diagnostics"]).plan
    trainer = trainer_for(off, logger=False, enable_checkpointing=False)
    assert not any(isinstance(c, DDPDiagnostics) for c in trainer.callbacks)


def test_accumulation_remainder_is_reported_with_the_numbers():
    """10 micro-batches, accumulation 4: the last step sums 2 but Lightning divides by 4."""
    diag = DDPDiagnostics()
    diag._check_accumulation(4, 12)
    assert diag.findings == [] and "accum-remainder" in diag.checked
    with pytest.warns(DDPDiagnosticWarning, match=r"\[accum-remainder\] 10 batches per epoch with accumulation 4"):
        diag._check_accumulation(4, 10)
    assert "2/4 of a full step's" in diag.findings[0][1] and "--accumulate-grad-batches" in diag.findings[0][1]
    fresh = DDPDiagnostics()
    fresh._check_accumulation(1, 10)
    assert fresh.checked == set()
