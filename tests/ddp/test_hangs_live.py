"""A hung or slow rank named while the run is alive, at 2 ranks (gloo), as it happens: through build_trainer with a
user's own module and through the MNIST recipe.

(a) rank 1 blocks in its training_step; (b) rank 1's loader worker blocks in ``__getitem__``; (c) rank 1 calls a
barrier the others do not: each names rank 1, its phase and its line within the bound, and the run then ends at the
collective timeout with the report's path. (d) rank 1's loader is slower, (e) its training_step is: each named with
its cause within a few log windows, far from the epoch's end. A recipe run stopped after its hang report continues
exactly with ``--resume auto``; an ordinary run on a loaded host reports nothing. Each test prints its
stall-to-report time (docs/multi-node-and-failures.md quotes them).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest

from tests.helpers import SHARED_DATA, assert_same_weights
from tests.launch import run, start
from tests.marks import needs_mnist

pytestmark = pytest.mark.slow

USER = """
import os, re, sys, time
import torch, lightning as L
from torch.utils.data import DataLoader, Dataset
from ddp_recipes import build_trainer

CASE = sys.argv[1]
RANK1 = os.environ.get("LOCAL_RANK") == "1"


def stall():
    print(f"STALL {time.time()}", file=sys.stderr, flush=True)


class Data(Dataset):
    def __init__(self):
        self.reads = 0

    def __len__(self):
        return 100_000

    def __getitem__(self, i):
        self.reads += 1
        if CASE == "b" and RANK1 and self.reads == 60:
            stall()
            time.sleep(900)  # LOADER-LINE
        g = torch.Generator().manual_seed(i)
        return torch.randn(32, generator=g), torch.tensor(i % 4)


class User(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(32, 4)

    def training_step(self, batch, i):
        if CASE == "a" and RANK1 and self.global_step == 6:
            stall()
            time.sleep(900)  # STEP-LINE
        if CASE == "c" and RANK1 and self.global_step == 6:
            stall()
            torch.distributed.barrier()  # BARRIER-LINE
        if CASE == "g" and not RANK1 and self.global_step == 6:
            stall()
            re.match(r"(a+)+$", "a" * 64 + "b")  # holds the GIL for ages: rank 0's Python cannot report
        if CASE == "e" and RANK1:
            time.sleep(0.03)  # slower compute on rank 1
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(Data(), batch_size=8, num_workers=2 if CASE == "b" else 0)


if __name__ == "__main__":
    trainer = build_trainer(devices=2, accelerator="cpu", max_steps=int(sys.argv[3]), timeout_s=float(sys.argv[4]),
                            hang_report_s=6, default_root_dir=sys.argv[2], log_every_n_steps=5,
                            enable_progress_bar=False, logger=False)
    trainer.fit(User())
"""

LINES = {"a": ("training_step", "STEP-LINE"), "b": ("data fetch (waiting for its loader workers)", "LOADER-LINE"),
         "c": ("collective barrier", "BARRIER-LINE")}


def _stall_to_report(proc, line: str) -> float:
    started = float(re.search(r"STALL (\S+)", proc.output).group(1))
    return time.time() - started


@pytest.mark.parametrize("case", ["a", "b", "c", "a-torchrun"])
def test_a_hung_rank_is_named_with_its_phase_and_line(tmp_path, case):
    script = tmp_path / "user.py"
    script.write_text(USER)
    out = tmp_path / "out"
    case, _, launcher = case.partition("-")
    timeout_s = 40 if case == "a" else 300  # (a) waits for the collective timeout, under either launcher
    proc = start([script, case, out, 1000, timeout_s], cwd=tmp_path, torchrun=2 if launcher else None)
    try:
        line = proc.wait_for_line("DDP hang:", timeout=240)
        took = _stall_to_report(proc, line)
        phase, marker = LINES[case]
        source = next(n for n, text in enumerate(USER.splitlines(), 1) if marker in text)
        assert re.search(rf"rank 1 is in {re.escape(phase)} at step \d+ \(user\.py:{source} in ", line), line
        assert "the other 1 rank(s) wait in backward and gradient all-reduce" in line, line
        assert line.endswith(f"every rank's stacks: {out / 'stall-reports'}"), line
        print(f"case {case}: stall to report {took:.1f} s (bound 6 s)")
        assert took < 6 + 30, took  # within the bound and its grace, far below the collective timeout
        reports = {p.name.rsplit("-", 1)[1]: p.read_text() for p in (out / "stall-reports").iterdir()}
        assert sorted(reports) == ["rank0.txt", "rank1.txt"], reports.keys()
        assert f"phase: {phase}" in reports["rank1.txt"] and "--- thread MainThread" in reports["rank1.txt"]
        if case == "b":
            assert "--- loader worker pid" in reports["rank1.txt"] and "__getitem__" in reports["rank1.txt"]
        if case == "a":  # the run then ends as before, at the collective timeout, pointing at the report
            result = proc.finish(timeout=240)
            assert result.returncode != 0
            assert f"the hang report's stacks: {out / 'stall-reports'}" in result.stderr, result.stderr[-3000:]
    finally:
        proc.kill()


def test_when_rank_0_cannot_report_the_next_rank_names_it(tmp_path):
    """Rank 0 (the usual reporter) holds the GIL in native code: its report thread cannot run, so rank 1 prints."""
    script = tmp_path / "user.py"
    script.write_text(USER)
    proc = start([script, "g", tmp_path / "out", 1000, 300], cwd=tmp_path)
    try:
        line = proc.wait_for_line("DDP hang:", timeout=240)
        assert line.startswith("[rank 1] DDP hang: ") and "rank 0 posted nothing (its Python is not running" in line
        assert "the other 1 rank(s) wait in backward and gradient all-reduce at step 6" in line, line
        print(f"case g: stall to report {_stall_to_report(proc, line):.1f} s (bound 6 s)")
    finally:
        proc.kill()


def test_a_slow_ranks_compute_is_named_within_a_few_log_windows(tmp_path):
    script = tmp_path / "user.py"
    script.write_text(USER)
    result = run([script, "e", tmp_path / "out", 60, 300], cwd=tmp_path, timeout=600, quiet=False)
    assert result.returncode == 0, result.stderr[-3000:]
    found = re.search(r"\[compute-bound\] rank 1 is a straggler: .* \(up to step (\d+)\)", result.stderr)
    assert found, result.stderr[-3000:]
    assert int(found.group(1)) <= 5 * 5  # within 5 log windows of 5 steps; the epoch is 6,250 steps
    assert "[input-bound]" not in result.stderr and "DDP hang" not in result.stderr


RECIPE = """
import os
import sys
import time

from lightning.pytorch.callbacks import Callback

from tests.helpers import run_recipe_with

MODE = os.environ["MODE"]


if MODE == "slow" and os.environ.get("LOCAL_RANK") == "1":  # rank 1's loader, several times slower than rank 0's
    from ddp_recipes.data.samplers import TensorBatchDataset

    read = TensorBatchDataset.__getitems__

    def slow(self, keys):
        time.sleep(0.001 * len(keys))
        return read(self, keys)

    TensorBatchDataset.__getitems__ = slow
    TensorBatchDataset.gather_epoch = lambda self, order: None  # no whole-epoch copy: each batch is a __getitems__


class Fault(Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if MODE == "hang" and os.environ.get("LOCAL_RANK") == "1" and trainer.global_step == 12:
            print(f"STALL {time.time()}", file=sys.stderr, flush=True)
            time.sleep(900)


if __name__ == "__main__":
    run_recipe_with(Fault(), sys.argv[1:])
"""

MNIST = ["mnist", "--data-dir", str(SHARED_DATA), "--accelerator", "cpu", "--no-download", "--logger", "csv",
         "--devices", "2", "--num-workers", "0", "--batch-size", "16", "--log-every-n-steps", "5"]


@needs_mnist
def test_a_recipe_names_a_slow_loader_and_survives_a_hang(tmp_path):
    """(d) through the recipe: rank 1's slower loader named input-bound early in the epoch; then a hang at step 12
    reported, the run stopped, and ``--resume auto`` continues exactly (the report left the run's files alone)."""
    script = tmp_path / "fault.py"
    script.write_text(RECIPE)
    slow = run([script, *MNIST, "--output-dir", tmp_path / "slow", "--max-steps", "60"], cwd=tmp_path,
               env={"MODE": "slow"}, timeout=600, quiet=False)  # the finding is a warning
    assert slow.returncode == 0, slow.stderr[-3000:]
    found = re.search(r"\[input-bound\] rank 1 is a straggler: .* \(up to step (\d+)\)", slow.stderr)
    assert found and int(found.group(1)) <= 25, slow.stderr[-3000:]  # an epoch is 250 steps
    ranks = json.loads((tmp_path / "slow" / "summary.json").read_text())["ranks"]
    assert ranks["slowest_rank"] == 1 and ranks["fastest_rank"] == 0 and ranks["ratio"] > 1.2, ranks

    flags = [*MNIST, "--max-steps", "24", "--checkpoint-every-n-steps", "5", "--hang-report-s", "6"]
    hung = start([script, *flags, "--output-dir", tmp_path / "hung"], cwd=tmp_path, env={"MODE": "hang"})
    try:
        line = hung.wait_for_line("DDP hang:", timeout=300)
        assert "rank 1 is in on_train_batch_start at step 12 (fault.py:" in line, line
        print(f"recipe hang: stall to report {_stall_to_report(hung, line):.1f} s")
    finally:
        hung.kill()
    resumed = run([script, *flags, "--output-dir", tmp_path / "hung", "--resume", "auto"], cwd=tmp_path,
                  env={"MODE": "none"}, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    straight = run([script, *flags, "--output-dir", tmp_path / "straight"], cwd=tmp_path, env={"MODE": "none"},
                   timeout=600)
    assert straight.returncode == 0, straight.stderr[-3000:]
    assert_same_weights(tmp_path / "straight" / "final.ckpt", tmp_path / "hung" / "final.ckpt")


@needs_mnist
def test_an_ordinary_run_on_a_loaded_host_reports_nothing(tmp_path):
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])  # a third process on the 2 cores
    try:
        result = run([*MNIST_MODULE, "--output-dir", tmp_path / "out", "--max-steps", "150", "--hang-report-s", "20"],
                     cwd=tmp_path, timeout=900, quiet=False)  # a finding would be a warning
    finally:
        burner.kill()
        burner.wait()
    assert result.returncode == 0, result.stderr[-3000:]
    assert "DDP hang" not in result.stderr and "straggler" not in result.stderr, result.stderr[-3000:]
    ranks = json.loads((tmp_path / "out" / "summary.json").read_text())["ranks"]
    assert set(ranks) >= {"slowest_rank", "fastest_rank", "ratio", "input_wait_ms", "forward_ms"}, ranks


MNIST_MODULE = ["-m", "recipes.mnist", *MNIST[1:]]
