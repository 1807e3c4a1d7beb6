"""DDP semantics on CPU (gloo, 2 processes): what the strategy promises, proven against 1 process."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from tests.launch import run

SCRIPT = Path(__file__).resolve().parents[1] / "scenarios" / "ddp_scenarios.py"
_CACHE: dict[tuple, dict[int, dict]] = {}


def run_scenario(tmp_root: Path, *args: str, torchrun: bool = False, expect_ok: bool = True):
    """Run tests/scenarios/ddp_scenarios.py once per distinct argument list; returns {rank: saved dict}."""
    key = (torchrun, *args)
    if key in _CACHE:
        return _CACHE[key]
    out = tmp_root / f"run{len(_CACHE)}"
    proc = run([SCRIPT, args[0], out, *args[1:]], torchrun=2 if torchrun else None, timeout=240,
               drop=["MASTER_ADDR"], check=expect_ok)
    if not expect_ok:
        return proc
    result = {int(p.stem[4:]): torch.load(p, weights_only=False) for p in sorted(out.glob("rank*.pt"))}
    for rank, saved in result.items():  # written by the scenario's last exit handler
        saved["group_at_exit"] = (out / f"exit{rank}.txt").read_text()
    _CACHE[key] = result
    return result


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("ddp")


def max_rel_diff(a: dict, b: dict) -> float:
    """Largest |a-b| / max|b| over all floating tensors of two state dicts (running stats included)."""
    worst = 0.0
    for key, value in b.items():
        if value.is_floating_point():
            worst = max(worst, ((a[key] - value).abs().max() / value.abs().max().clamp_min(1e-12)).item())
    return worst


def assert_same_across_ranks(result: dict) -> None:
    assert set(result) == {0, 1}
    for key, value in result[0]["state"].items():
        assert torch.equal(value, result[1]["state"][key]), f"{key} differs across ranks"


def test_two_ranks_at_b_equal_one_process_at_2b(root):
    two = run_scenario(root, "train", "--devices", "2", "--batch", "8", "--steps", "6")
    one = run_scenario(root, "train", "--devices", "1", "--batch", "16", "--steps", "6")
    assert_same_across_ranks(two)
    assert max_rel_diff(two[0]["state"], one[0]["state"]) <= 1e-5
    # The shards are disjoint and together they are the single process's batches, step for step
    # (6 steps = 1.5 epochs, so the per-epoch reshuffle is covered too).
    for step in range(6):
        rank0, rank1 = set(two[0]["record"]["indices"][step]), set(two[1]["record"]["indices"][step])
        assert not rank0 & rank1
        assert rank0 | rank1 == set(one[0]["record"]["indices"][step])
    assert two[0]["record"]["indices"][4] != two[0]["record"]["indices"][0]  # set_epoch: a new order


@pytest.mark.slow  # a long multi-process run: make test-slow (keeps make test near 10 min)
def test_sync_batchnorm_matches_single_process_and_without_it_differs(root):
    single = run_scenario(root, "train", "--devices", "1", "--batch", "16", "--batchnorm")
    synced = run_scenario(root, "train", "--devices", "2", "--batch", "8", "--batchnorm", "--sync-batchnorm")
    local = run_scenario(root, "train", "--devices", "2", "--batch", "8", "--batchnorm")
    assert_same_across_ranks(synced)
    assert max_rel_diff(synced[0]["state"], single[0]["state"]) <= 1e-5
    for key in ("body.1.running_mean", "body.1.running_var"):
        assert torch.allclose(synced[0]["state"][key], single[0]["state"][key], rtol=1e-5, atol=1e-7)
    # Without the flag each rank normalises with its own half-batch statistics: a different model, and
    # ranks even disagree on the running statistics (buffers are broadcast from rank 0 only at forward).
    assert max_rel_diff(local[0]["state"], single[0]["state"]) > 1e-3
    # After fit the layers are plain BatchNorm again: the checkpoint holds what the user's model has.
    assert "body.1.num_batches_tracked" in synced[0]["state"]


@pytest.mark.slow  # a long multi-process run: make test-slow (keeps make test near 10 min)
def test_accumulation_equals_larger_batch_and_skips_allreduce(root):
    accumulated = run_scenario(root, "train", "--devices", "1", "--batch", "8", "--accumulate", "2")
    big = run_scenario(root, "train", "--devices", "1", "--batch", "16", "--steps", "6")
    assert accumulated[0]["record"]["global_step"] == 6
    assert max_rel_diff(accumulated[0]["state"], big[0]["state"]) <= 1e-5

    counted = run_scenario(root, "train", "--devices", "2", "--batch", "4", "--accumulate", "2", "--count-allreduce")
    plain = run_scenario(root, "train", "--devices", "2", "--batch", "4", "--count-allreduce")
    assert_same_across_ranks(counted)
    # 6 optimizer steps of 2 micro-batches: one all-reduce per step (the model fits one bucket), none on
    # the 6 accumulation-only backward passes.
    assert counted[0]["record"]["calls"] == counted[0]["record"]["global_step"] == 6
    assert len(counted[0]["record"]["losses"]) == 12
    assert plain[0]["record"]["calls"] == 6 and len(plain[0]["record"]["losses"]) == 6
    # And 2 ranks x batch 4 x 2 micro-batches is the same optimisation as 1 process at batch 16.
    assert max_rel_diff(counted[0]["state"], big[0]["state"]) <= 1e-5


def test_seed_plus_rank(root):
    first = run_scenario(root, "train", "--devices", "2", "--batch", "8", "--steps", "6")
    again = run_scenario(root, "train", "--devices", "2", "--batch", "8", "--steps", "6", "--seed", "7")
    draws0, draws1 = first[0]["record"]["draws"], first[1]["record"]["draws"]
    assert draws0[0] != draws1[0] and draws0[1] != draws1[1] and draws0[2] != draws1[2]
    # Set-up hooks (a DataModule's random_split, configure_model) see one RNG on every rank.
    assert first[0]["record"]["setup_draws"] == first[1]["record"]["setup_draws"]
    for key, value in first[0]["record"]["initial"].items():
        assert torch.equal(value, first[1]["record"]["initial"][key]), "initial weights differ before DDP's broadcast"
    # --seed 7 is the default: the second run is a separate launch with the same seed.
    for rank in (0, 1):
        assert first[rank]["record"]["draws"] == again[rank]["record"]["draws"]
        for key, value in first[rank]["state"].items():
            assert torch.equal(value, again[rank]["state"][key])


@pytest.mark.slow  # a long multi-process run: make test-slow (keeps make test near 10 min)
def test_unused_parameters_error_names_them_and_the_flag(root):
    proc = run_scenario(root, "unused", "--devices", "2", "--steps", "3", expect_ok=False)
    assert proc.returncode != 0
    assert "aux_head.weight" in proc.stderr and "aux_head.bias" in proc.stderr
    assert "--find-unused-parameters" in proc.stderr
    fixed = run_scenario(root, "unused", "--devices", "2", "--steps", "3", "--find-unused-parameters")
    assert_same_across_ranks(fixed)


@pytest.mark.parametrize("hook", ["fp16", pytest.param("bf16", marks=pytest.mark.slow),
                                  pytest.param("powersgd", marks=pytest.mark.slow)])
def test_comm_hooks_run_on_cpu(root, hook):
    result = run_scenario(root, "train", "--devices", "2", "--batch", "8", "--steps", "12", "--comm-hook", hook)
    assert_same_across_ranks(result)
    expected = {"fp16": "fp16_compress_hook", "bf16": "bf16_compress_hook", "powersgd": "powerSGD_hook"}[hook]
    assert result[0]["record"]["comm_hook"] == expected
    losses = result[0]["record"]["losses"]
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4


@pytest.mark.slow  # a long multi-process run: make test-slow (keeps make test near 10 min)
def test_precisions_on_cpu(root):
    bf16 = run_scenario(root, "train", "--devices", "2", "--batch", "8", "--precision", "bf16-mixed")
    assert bf16[0]["record"]["precision"] == "bf16-mixed"
    assert_same_across_ranks(bf16)
    # Documented: 16-mixed needs CUDA; on CPU build_trainer switches to bf16-mixed and says so.
    fp16 = run_scenario(root, "train", "--devices", "1", "--batch", "16", "--precision", "16-mixed")
    assert fp16[0]["record"]["precision"] == "bf16-mixed"


@pytest.mark.slow  # a long multi-process run: make test-slow (keeps make test near 10 min)
def test_torchrun_launch_matches_lightning_launch(root):
    launched = run_scenario(root, "train", "--devices", "2", "--batch", "8", "--steps", "6")
    torchrun = run_scenario(root, "train", "--batch", "8", "--steps", "6", torchrun=True)
    assert torchrun[0]["env_rank"] == "0" and torchrun[1]["env_rank"] == "1"
    # Both launchers: the gloo group is destroyed by an exit handler, never left to interpreter
    # finalization (where gloo can abort a finished rank with SIGABRT).
    for result in (launched, torchrun):
        assert [result[r]["group_at_exit"] for r in (0, 1)] == ["destroyed", "destroyed"]
    assert torchrun[0]["record"]["world_size"] == 2
    assert_same_across_ranks(torchrun)
    assert max_rel_diff(torchrun[0]["state"], launched[0]["state"]) <= 1e-6


@pytest.mark.slow  # the default launcher trains every other test of this file
@pytest.mark.parametrize("start_method", ["spawn", "fork"])
def test_spawn_and_fork_launchers_train_like_the_default_one(root, start_method):
    """A user's TunedDDPStrategy subclass with CPU SyncBatchNorm, pickled into spawned ranks: the weights
    rank 0 ends with equal the default (subprocess) launcher's."""
    flags = ("--devices", "2", "--batch", "8", "--steps", "6", "--batchnorm", "--sync-batchnorm", "--subclass")
    default = run_scenario(root, "train", *flags)
    other = run_scenario(root, "train", *flags, "--start-method", start_method)
    for key, value in default[0]["state"].items():
        assert torch.equal(value, other[0]["state"][key]), key


@pytest.mark.slow
def test_a_failure_under_spawn_leaves_no_cleanup_crash(root):
    proc = run_scenario(root, "unused", "--devices", "2", "--steps", "3", "--start-method", "spawn", expect_ok=False)
    assert proc.returncode != 0 and "aux_head.weight" in proc.stderr
    assert "Exception ignored" not in proc.stderr and "has no attribute 'wait'" not in proc.stderr


@pytest.mark.slow  # a long multi-process run: make test-slow (keeps make test near 10 min)
def test_unequal_batches_per_rank_fail_before_the_first_step(root):
    """Rank 0 has 8 batches, rank 1 has 7: both stop at once with the counts, instead of rank 0 hanging."""
    started = time.monotonic()
    proc = run_scenario(root, "uneven", "--devices", "2", "--steps", "20", expect_ok=False)
    assert proc.returncode != 0 and time.monotonic() - started < 120
    assert "different numbers of training batches per epoch (rank 0: 8, rank 1: 7)" in proc.stderr
    assert "DistributedSampler" in proc.stderr


@pytest.mark.slow
def test_unequal_batches_bounded_by_max_steps_only_warn(root):
    """Rank 1's 7 batches outlast --max-steps 5: this run cannot hang, so it trains (with a warning)."""
    proc = run_scenario(root, "uneven", "--devices", "2", "--steps", "5", expect_ok=False)
    assert proc.returncode == 0, proc.stderr[-3000:]  # (its warning is silenced by the tests' PYTHONWARNINGS)
