"""The second run (issue #30): a user runs again, continues, or built the model first; nothing is lost and
nothing is silently wrong.

* (An output folder belonging to one run, ``version_N``, what ``--resume auto`` takes and rank 0's decision:
  tests/checkpointing/run_folder/.)
* Continuing past the run's own limit (``--max-steps``, ``--max-epochs``, ``max_time``) is bit-exact.
* ``build_trainer(seed=...)`` names a model built before it; an iterable loader is split or named.
* Bad input fails in one line before any rank starts (exit 2, nothing written); the pack's noise is gone.

Fast tests run one process in-process on the real mini-MNIST_CPU; 2-rank runs (gloo) are in the slow tier, each
with a fast in-process twin for its logic.
"""

from __future__ import annotations

import datetime
import json
import os
import pickle
import shutil
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Timer
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from ddp_recipes import build_trainer
from ddp_recipes.checkpointing.exact_continuation import PREBUILT, ResumeState
from ddp_recipes.errors import ConfigError
from recipes import mnist
from tests.helpers import MNIST_CPU, assert_same_weights, files_of, last_ckpt, refused_mnist
from tests.launch import run, saved_step
from tests.marks import needs_mnist
from tests.resume_scenario import RESNET, args
from tests.tiny_modules import TinyNet

SCENARIO = Path(__file__).resolve().parents[1] / "scenarios" / "second_run_scenario.py"
QUIET = dict(logger=False, enable_progress_bar=False, enable_model_summary=False)


# ---- 1. continuing past the run's own limit is exact ---------------------------------------------------------

@needs_mnist
def test_continuing_past_max_steps_is_exact(tmp_path):
    straight, split = tmp_path / "straight", tmp_path / "split"
    mnist.main([*MNIST_CPU, "--max-steps", "10", "--output-dir", str(straight)])
    first = mnist.main([*MNIST_CPU, "--max-steps", "5", "--output-dir", str(split)])
    loops = torch.load(last_ckpt(split), weights_only=True)["loops"]["fit_loop"]
    assert loops["epoch_progress"]["current"]["processed"] == 0  # a mid-epoch checkpoint, not "epoch 0 done"
    assert loops["state_dict"]["combined_loader"][0]["samples_seen"] == 5 * 64
    mnist.main([*MNIST_CPU, "--max-steps", "10", "--output-dir", str(split), "--resume", "auto"])
    assert_same_weights(last_ckpt(split), last_ckpt(straight))
    assert first["epochs"] == 0 and first["steps"] == 5


@needs_mnist
def test_continuing_past_max_steps_into_max_epochs_is_exact(tmp_path):
    """Batch 500: 16 steps per epoch. ``--max-steps 5`` then ``--max-epochs 1`` trains the rest of epoch 0 (not
    "max_epochs=1 reached" at step 5); ``--max-epochs 1`` then ``2`` (no validation data, so nothing is left to
    run at the saved epoch end) continues with the next epoch's first batch, once."""
    big = [*MNIST_CPU, "--batch-size", "500"]
    epoch, cut, both = tmp_path / "epoch", tmp_path / "cut", tmp_path / "both"
    mnist.main([*big, "--max-epochs", "1", "--output-dir", str(epoch)])
    mnist.main([*big, "--max-steps", "5", "--output-dir", str(cut)])
    summary = mnist.main([*big, "--max-epochs", "1", "--output-dir", str(cut), "--resume", "auto"])
    assert summary["steps"] == 16 and summary["epochs"] == 1
    assert_same_weights(last_ckpt(cut), last_ckpt(epoch))
    mnist.main([*big, "--max-epochs", "2", "--output-dir", str(both)])
    again = mnist.main([*big, "--max-epochs", "2", "--output-dir", str(epoch), "--resume", "auto"])
    assert again["steps"] == 32 and again["epochs"] == 2
    assert_same_weights(last_ckpt(epoch), last_ckpt(both))


class SpendTimeAt(L.Callback):
    """Spends the whole ``max_time`` during step ``step`` (counted from 1): the fit stops after that step, at a
    point the test chooses rather than wherever the host's clock happens to be (an epoch end or not)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step - 1:
            timer = next(c for c in trainer.callbacks if isinstance(c, Timer))
            timer._offset = timer._duration + 1.0  # the elapsed time a resumed Timer carries in from a checkpoint


@needs_mnist
@pytest.mark.parametrize("stop, epochs", [(48, 3), (37, 2)], ids=["at-an-epoch-end", "mid-epoch"])
def test_continuing_past_max_time_is_exact_and_counts_epochs_alike(tmp_path, stop, epochs):
    """Stopped by max_time after step ``stop`` (16 steps per epoch: the last batch of epoch 2, or batch 5 of
    epoch 2), the checkpoint resumes at that batch; a run resumed from it with the same, spent max_time stops
    at once and reports the same epochs and steps; continued with time to spare it trains on exactly."""
    big = [*MNIST_CPU, "--batch-size", "500"]  # 16 steps per epoch
    timed, straight = tmp_path / "timed", tmp_path / "straight"
    hour, day = {"max_time": datetime.timedelta(hours=1)}, {"max_time": datetime.timedelta(days=1)}
    first = mnist.main([*big, "--max-epochs", "20", "--output-dir", str(timed)], trainer_kwargs=hour,
                       callbacks=[SpendTimeAt(stop)])
    again = mnist.main([*big, "--max-epochs", "20", "--output-dir", str(timed), "--resume", "auto"],
                       trainer_kwargs=hour)
    assert (first["epochs"], first["steps"]) == (again["epochs"], again["steps"]) == (epochs, stop)
    steps = stop + 20  # past the stop, into the next epoch
    mnist.main([*big, "--max-steps", str(steps), "--output-dir", str(timed), "--resume", "auto"], trainer_kwargs=day)
    mnist.main([*big, "--max-steps", str(steps), "--output-dir", str(straight)], trainer_kwargs=day)
    assert saved_step(last_ckpt(timed)) == steps
    assert_same_weights(last_ckpt(timed), last_ckpt(straight))


def test_a_schedule_sized_for_the_run_says_so_when_the_limit_changes(tmp_path):
    """Cosine over the run: continued with another limit, the first steps followed another curve."""
    from recipes import resnet

    tiny = ["--accelerator", "cpu", "--data", "synthetic", "--image-size", "16", "--synthetic-samples", "64",
            "--synthetic-val-samples", "0", "--batch-size", "16", "--logger", "none", "--output-dir", str(tmp_path)]
    resnet.main([*tiny, "--max-steps", "2"])
    with pytest.warns(UserWarning, match="sized for 2 steps when the checkpoint was written and is sized for 4 now"):
        resnet.main([*tiny, "--max-steps", "4", "--resume", "auto"])


# ---- 2. build_trainer(seed=...) and a model built before it -------------------------------------------------

def _net() -> TinyNet:
    """A user's module with dropout: the global stream it draws from shows any extra draw."""
    return TinyNet(4, 2, 8, dropout=0.2)


def _loader(batch_size: int = 8) -> DataLoader:
    g = torch.Generator().manual_seed(1)
    return DataLoader(TensorDataset(torch.randn(32, 4, generator=g), torch.randint(0, 2, (32,), generator=g)),
                      batch_size=batch_size, shuffle=True)


def _fit(root: Path, model_first: bool) -> tuple[dict[str, torch.Tensor], list[str]]:
    os.environ.pop("PL_GLOBAL_SEED", None)  # the previous run's seed_everything set it (the test restores it)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model = _net() if model_first else None
        trainer = build_trainer(accelerator="cpu", seed=0, max_steps=3, default_root_dir=str(root), **QUIET)
        model = model or _net()
        trainer.fit(model, _loader())
    return ({k: v.clone() for k, v in model.state_dict().items()},
            [str(w.message) for w in seen if "was built before build_trainer" in str(w.message)])


def test_seed_names_a_model_built_before_build_trainer(tmp_path, monkeypatch):
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    torch.seed()  # an unseeded process, as a script starts (torch's initial seed is a random 64-bit number)
    after_1, said = _fit(tmp_path / "a1", model_first=False)
    torch.seed()
    after_2, _ = _fit(tmp_path / "a2", model_first=False)
    assert not said and all(torch.equal(after_1[k], after_2[k]) for k in after_1)  # seeded: the same, run after run
    torch.seed()
    _, said = _fit(tmp_path / "b", model_first=True)
    assert len(said) == 1
    assert said[0].startswith("TinyNet was built before build_trainer(seed=0) seeded the random streams")
    assert "build the model after build_trainer(...), or call lightning.seed_everything(seed) before" in said[0]
    L.seed_everything(0, verbose=False)  # the script seeded before building it: nothing to say
    _, said = _fit(tmp_path / "c", model_first=True)
    assert not said



def test_a_trainer_that_names_a_prebuilt_model_still_pickles_into_spawned_ranks(monkeypatch):
    """start_method="spawn" pickles the model and the Trainer's callbacks into every rank: the mark of a model
    built before build_trainer(seed=...) travels with both (a set of the modules did not pickle at all)."""
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    torch.seed()
    model = _net()
    trainer = build_trainer(accelerator="cpu", seed=0, **QUIET)
    state = next(c for c in trainer.callbacks if isinstance(c, ResumeState))
    in_rank = pickle.loads(pickle.dumps((state, model)))
    assert state.prebuilt is not None and in_rank[0].prebuilt == getattr(in_rank[1], PREBUILT) == state.prebuilt

class Steps(L.Callback):
    """(epoch, batch index) of every training batch this fit trained."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, int]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seen.append((trainer.current_epoch, batch_idx))


class Batches(IterableDataset):
    """_loader()'s 32 samples as 4 batches of 8, in a fixed order: a stream with no length."""

    def __iter__(self):
        x, y = _loader().dataset.tensors
        return iter([(x[i:i + 8], y[i:i + 8]) for i in range(0, 32, 8)])


def _fit_steps(root: Path, ckpt_path: str | None = None, save_after: Path | None = None, stream: bool = False,
               **limits: int) -> tuple[dict[str, torch.Tensor], list[tuple[int, int]]]:
    """A user's module without validation (4 batches per epoch, dropout): its weights and the (epoch, batch)
    pairs this fit trained; ``save_after``: a checkpoint saved after fit returned, as a script's own would be."""
    steps = Steps()
    trainer = build_trainer(accelerator="cpu", seed=0, default_root_dir=str(root), callbacks=[steps], **limits,
                            **QUIET)
    model = _net()
    trainer.fit(model, DataLoader(Batches(), batch_size=None) if stream else _loader(), ckpt_path=ckpt_path)
    if save_after is not None:
        trainer.save_checkpoint(save_after)
    return {k: v.clone() for k, v in model.state_dict().items()}, steps.seen


EPOCH = [(0, 0), (0, 1), (0, 2), (0, 3)]


@pytest.mark.parametrize("stream", [False, True], ids=["shuffled", "stream"])
def test_resumed_at_an_epoch_end_without_validation_trains_the_next_epoch_exactly(tmp_path, stream):
    """Stopped by max_steps at epoch 0's end (last.ckpt written there), the continued fit trains epoch 1 from its
    first batch and ends at the straight run's weights. (Lightning 2.6 alone trains a 5th batch inside the
    finished epoch 0; a loader the pack does not adopt, the stream, also drew its workers' seed from the restored
    global stream a second time, which dropout then felt.)"""
    straight, _ = _fit_steps(tmp_path / "straight", max_steps=6, stream=stream)
    _, first = _fit_steps(tmp_path / "split", max_steps=4, stream=stream)
    resumed, then = _fit_steps(tmp_path / "split", ckpt_path="last", max_steps=6, stream=stream)
    assert (first, then) == (EPOCH, [(1, 0), (1, 1)])
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)


def test_a_checkpoint_saved_after_fit_continues_with_a_whole_next_epoch(tmp_path):
    """Lightning 2.6 alone numbers the next epoch's batches on from the finished one's (batch 4) and trains one
    batch fewer in it."""
    straight, _ = _fit_steps(tmp_path / "straight", max_steps=10)
    _fit_steps(tmp_path / "split", max_steps=4, save_after=tmp_path / "after.ckpt")
    resumed, then = _fit_steps(tmp_path / "split", ckpt_path=str(tmp_path / "after.ckpt"), max_steps=10)
    assert then == [(1, 0), (1, 1), (1, 2), (1, 3), (2, 0), (2, 1)]
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)


def test_a_checkpoint_saved_after_a_fit_cut_inside_an_epoch_continues_that_epoch(tmp_path):
    """Stopped by max_steps at batch 2 of 4, saved after fit: the continued fit trains batches 2 and 3 of epoch
    0, then epoch 1. (Lightning 2.6 alone counts epoch 0 done and trains epoch 1 from batch 2; RunPosition
    stops that run at its first batch.)"""
    straight, _ = _fit_steps(tmp_path / "straight", max_steps=8)
    _fit_steps(tmp_path / "split", max_steps=2, save_after=tmp_path / "after.ckpt")
    resumed, then = _fit_steps(tmp_path / "split", ckpt_path=str(tmp_path / "after.ckpt"), max_steps=8)
    assert then == [(0, 2), (0, 3), (1, 0), (1, 1), (1, 2), (1, 3)]
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)


class SaveAndDie(L.Callback):
    """Saves ``path`` at the end of step ``step``'s batch and stops the process's fit there, as a stop agreed at that
    boundary does (its checkpoint is written in on_train_batch_end)."""

    def __init__(self, step: int, path: Path) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)
            raise Died(f"after step {self.step}")


class Died(Exception):
    """The process a test's fit "died" in."""


@pytest.mark.parametrize(("stream", "batch_size"), [(False, 8), (False, 4), (True, 8)],
                         ids=["same-epoch", "longer-epoch", "stream"])  # a stream's batches are fixed at 8
def test_a_stop_at_an_epochs_last_batch_resumes_with_the_whole_next_epoch(tmp_path, stream, batch_size):
    """Saved at epoch 1's last batch end (step 8), resumed to max_epochs=3: epoch 2 is trained from its first batch
    to its last, with the straight run's weights at the same batch size. Lightning 2.6 alone left the next epoch
    unopened (issue #43), numbered a stream's batches on from 4, and at a longer epoch (batch 4: 8 batches) started
    it at batch 4; a stream's resumed epoch also missed the loader's base-seed draw of the new epoch."""
    straight, _ = _fit_steps(tmp_path / "straight", max_epochs=3, stream=stream)
    trainer = build_trainer(accelerator="cpu", seed=0, default_root_dir=str(tmp_path / "split"), max_epochs=3,
                            callbacks=[SaveAndDie(8, tmp_path / "stop.ckpt")], **QUIET)
    data = DataLoader(Batches(), batch_size=None) if stream else _loader()
    with pytest.raises(Died):
        trainer.fit(_net(), data)
    assert trainer.global_step == 8 and (tmp_path / "stop.ckpt").exists()
    steps = Steps()
    trainer = build_trainer(accelerator="cpu", seed=0, default_root_dir=str(tmp_path / "split"), max_epochs=3,
                            callbacks=[steps], **QUIET)
    model = _net()
    data = DataLoader(Batches(), batch_size=None) if stream else _loader(batch_size=batch_size)
    trainer.fit(model, data, ckpt_path=str(tmp_path / "stop.ckpt"))
    assert steps.seen == [(2, b) for b in range(32 // batch_size)]
    if batch_size == 8:
        assert all(torch.equal(straight[k], model.state_dict()[k]) for k in straight)


def test_continuing_into_max_epochs_with_max_steps_set_trains_every_epoch(tmp_path):
    """Both limits set: stopped by max_steps at epoch 0's end, continued with max_epochs=3 (and a large
    max_steps): epochs 1 and 2 both train (Lightning 2.6 alone counts the restored epoch twice and stops after
    epoch 1)."""
    straight, _ = _fit_steps(tmp_path / "straight", max_epochs=3, max_steps=100)
    _fit_steps(tmp_path / "split", max_epochs=3, max_steps=4)
    resumed, then = _fit_steps(tmp_path / "split", ckpt_path="last", max_epochs=3, max_steps=100)
    assert then == [(e, b) for e in (1, 2) for b in range(4)]
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)


# ---- 3. iterable loaders ------------------------------------------------------------------------------------

class Counting(IterableDataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(range(self.n))


@pytest.mark.parametrize("n", [8, 9, 11])
def test_a_stream_split_by_position_is_disjoint_complete_and_even(n):
    from ddp_recipes.data.streams import RankShardedStream

    shards = [list(RankShardedStream(Counting(n), rank, 3, seed=0)) for rank in range(3)]
    assert len({len(s) for s in shards}) == 1 and len(shards[0]) == n // 3  # as many batches on every rank
    kept = sorted(i for s in shards for i in s)
    assert kept == list(range(3 * (n // 3)))  # disjoint, and all but a last group of fewer than 3


class _Vote:
    """A strategy of a fake 2-rank group: rank 0's broadcast value, and the other rank's answers."""

    def __init__(self, rank0, other: list[bool]) -> None:
        self.rank0, self.other = rank0, list(other)

    def broadcast(self, obj):
        if isinstance(obj, tuple):  # the claim's outcome: rank 0 recorded the run
            return ("claim", None)
        return self.rank0

    def reduce_boolean_decision(self, mine: bool, all: bool = True) -> bool:  # noqa: A002
        return mine and self.other.pop(0)


class Shuffled(IterableDataset):
    def __iter__(self):
        return iter(torch.randperm(16).tolist())


def test_a_stream_is_split_only_where_its_order_is_fixed():
    from ddp_recipes.data.streams import _STATES, classify, first_samples

    fixed = Counting(16)
    assert classify(_Vote(first_samples(fixed, _STATES[0]), [True, True, True]), fixed) == "shard"
    assert classify(_Vote("another rank's", [True, False]), fixed) == "split"  # its __iter__ splits by rank
    assert classify(_Vote(first_samples(Shuffled(), _STATES[0]), [True, True, True]), Shuffled()) == "random"
    assert classify(_Vote(None, [False]), Counting(0)) == "unknown"
    state = torch.get_rng_state()
    first_samples(Shuffled(), _STATES[0])
    assert torch.equal(torch.get_rng_state(), state), "reading the stream leaves the training streams alone"


# ---- 4. bad input: one line before any rank starts, exit 2, nothing written -----------------------------------

@needs_mnist
@pytest.mark.parametrize(("extra", "expected"), [
    (["--trainer", "max_time=abc"], "--trainer max_time='abc': lightning.Trainer refuses it (`Timer(duration='abc')` "
                                    "is not a valid duration"),
    (["--tracking-uri", "http://127.0.0.1:5000"], "--tracking-uri has no effect without mlflow in --logger (it is "
                                                  "none): add mlflow to --logger (e.g. --logger mlflow)"),
    (["--run-name", "x"], "--run-name has no effect without mlflow or wandb in --logger"),
    (["--val-size", "99999"], "--val-size 99999 leaves no training data (the train split has 8000 images)"),
    (["--val-size", "7999", "--devices", "2"], "--val-size 7999 leaves 1 training image(s) for 2 ranks"),
    (["--trainer", "val_check_interval=0.25"], "--trainer val_check_interval=0.25 has no effect: this run has no "
                                               "validation data; hold some out with --val-size N, or drop it"),
], ids=["max_time", "tracking_uri", "run_name", "val_size", "val_size_ranks", "val_check_interval"])
def test_bad_input_fails_in_one_line_before_anything_is_written(extra, expected, tmp_path, capsys):
    line = refused_mnist([*MNIST_CPU, "--max-steps", "2", "--output-dir", str(tmp_path / "out"), *extra], capsys)
    assert expected in line, line
    assert not (tmp_path / "out").exists()


def test_a_checkpoint_io_plugin_is_refused_by_the_recipe_and_named_by_the_library(tmp_path, capsys):
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    with pytest.raises(SystemExit):
        mnist.main([*MNIST_CPU, "--max-steps", "2", "--output-dir", str(tmp_path / "out")],
                   trainer_kwargs={"plugins": [TorchCheckpointIO()]})
    assert ("error: main(trainer_kwargs=...) plugins TorchCheckpointIO would replace the recipe's AtomicCheckpointIO"
            in capsys.readouterr().err)
    assert not (tmp_path / "out").exists()
    with pytest.warns(UserWarning,
                      match="TorchCheckpointIO replaces the pack's AtomicCheckpointIO: saves are no longer"):
        build_trainer(accelerator="cpu", plugins=[TorchCheckpointIO()], default_root_dir=str(tmp_path), **QUIET)


@needs_mnist
def test_a_model_checkpoint_writing_the_packs_last_ckpt_is_refused(tmp_path, capsys):
    from lightning.pytorch.callbacks import ModelCheckpoint

    out = tmp_path / "out"
    line = refused_mnist([*MNIST_CPU, "--max-steps", "2", "--output-dir", str(out), "--callbacks",
                    f"{{class_path: ModelCheckpoint, init_args: {{dirpath: {out / 'checkpoints'}, save_last: true}}}}"],
                   capsys)
    assert ("--callbacks ModelCheckpoint(save_last=True) would write last.ckpt in " in line
            and "over the recipe's own last.ckpt (what --resume auto continues from)" in line)
    # dirpath left to Lightning: with no logger it is <output-dir>/checkpoints, known once fitting starts
    with pytest.raises(ConfigError, match=r"callbacks: ModelCheckpoint\(save_last=True\) would write last.ckpt in .*"
                                          r"the pack's own last.ckpt .*build_trainer\(checkpoint_dir=...\)"):
        build_trainer(accelerator="cpu", max_steps=1, default_root_dir=str(tmp_path / "lib"), **QUIET,
                      callbacks=[ModelCheckpoint(save_last=True)]).fit(_net(), _loader())
    assert not (tmp_path / "lib" / "checkpoints").exists()


@needs_mnist
def test_a_fast_dev_run_writes_nothing_in_a_runs_folder(tmp_path):
    out = tmp_path / "out"
    mnist.main([*MNIST_CPU, "--max-steps", "3", "--output-dir", str(out)])
    before = files_of(out)
    mnist.main([*MNIST_CPU, "--output-dir", str(out), "--trainer", "fast_dev_run=2"])
    assert files_of(out) == before  # no last.ckpt, summary.json, final.ckpt: a later --resume auto continues the run
    fresh = tmp_path / "fresh"
    mnist.main([*MNIST_CPU, "--output-dir", str(fresh), "--trainer", "fast_dev_run=true"])
    assert not last_ckpt(fresh).exists() and not (fresh / "summary.json").exists()


# ---- 5. the pack's own noise -----------------------------------------------------------------------------

def test_looking_for_loader_workers_at_exit_warns_nothing():
    """torch.distributed's deprecated reduce_op is among the gc's objects; isinstance() on it warned."""
    from ddp_recipes.data.loader_workers import _live_loader_worker_pids

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _live_loader_worker_pids() == set()


def test_diagnostics_speak_the_library_users_language():
    from ddp_recipes.train.diagnostics import DDPDiagnostics

    for library, flag, argument in ((False, "--num-workers", "DataLoader(num_workers=...)"),
                                    (True, "DataLoader(num_workers=...)", "--num-workers")):
        diagnostics = DDPDiagnostics(library=library)
        with pytest.warns(UserWarning) as seen:
            diagnostics.report("input-bound", "the loop waited 40% of the step for data.")
            diagnostics.report("unused-params", "1 parameter(s) received no gradient (and, with "
                                                "{find_unused_parameters}, an extra traversal).")
        text = " ".join(str(w.message) for w in seen)
        assert flag in text and argument not in text
        assert ("find_unused_parameters=True" in text) == library and ("--find-unused-parameters" in text) != library


def test_a_weights_file_that_is_no_pytorch_file_says_so(tmp_path):
    from ddp_recipes.modules.pretrained import read_weights, resolve_weights

    (tmp_path / "w.pth").write_text("epoch,loss\n1,0.5\n")
    with pytest.raises(ConfigError, match=r"is not a PyTorch file \(neither a torch.save archive nor a pickle\); save "
                                          r"the weights with torch.save\(model.state_dict\(\), path\)"):
        read_weights(resolve_weights("resnet18", str(tmp_path / "w.pth")))


# ---- 2-rank runs (slow) -------------------------------------------------------------------------------------

def scenario(mode: str, out: Path, steps: int, **options):
    return run([SCENARIO, mode, out, steps], timeout=600, **options)


@pytest.mark.slow
def test_ranks_on_disks_holding_other_files_never_train_from_different_checkpoints(tmp_path):
    """Two "nodes" (each rank its own working directory, the same relative default_root_dir): rank 0's
    ckpt_path="last" decision is checked on rank 1, which fails every rank in one line while its disk holds no
    copy or a stale one; with the same files on both, the run continues on both from rank 0's checkpoint."""
    first = scenario("nodes", tmp_path, 3)
    assert first.returncode == 0, first.stderr[-3000:]
    node0, node1 = tmp_path / "node0" / "run", tmp_path / "node1" / "run"
    assert saved_step(node0 / "checkpoints" / "last.ckpt") == 3 and not (node1 / "checkpoints").exists()
    missing = scenario("nodes", tmp_path, 6)
    assert missing.returncode != 0
    said = [line for line in missing.stderr.splitlines() if "every rank must read the same checkpoints" in line]
    assert said and "which rank 1 cannot read (no such file)" in said[-1], missing.stderr[-3000:]
    assert saved_step(node0 / "checkpoints" / "last.ckpt") == 3  # nothing trained
    shutil.copytree(node0, node1)  # the disks synced: both hold the step-3 checkpoint
    shutil.copy(node0 / "checkpoints" / "last.ckpt", tmp_path / "step3.ckpt")
    same = scenario("nodes", tmp_path, 6)
    assert same.returncode == 0, same.stderr[-3000:]
    assert json.loads((tmp_path / "result.json").read_text())["global_step"] == 6
    shutil.copy(tmp_path / "step3.ckpt", node1 / "checkpoints" / "last.ckpt")  # node 1's copy is stale now
    stale = scenario("nodes", tmp_path, 9)
    assert stale.returncode != 0 and "which rank 1 reads as step 3 of run" in stale.stderr, stale.stderr[-3000:]


@pytest.mark.slow
def test_an_iterable_loader_at_two_ranks_is_split_and_said_so(tmp_path):
    done = scenario("stream", tmp_path, 0, quiet=False)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = [json.loads((tmp_path / f"seen{rank}.json").read_text()) for rank in (0, 1)]
    assert [s["global_step"] for s in seen] == [8, 8]  # 64 samples / (4 x 2 ranks): as a map-style Dataset
    assert not set(seen[0]["seen"]) & set(seen[1]["seen"]) and len(seen[0]["seen"] + seen[1]["seen"]) == 64
    said = [line for line in done.stderr.splitlines() if "train_dataloader: an IterableDataset (Stream)" in line]
    assert len(said) == 1 and "each of the 2 ranks reads the whole stream" in said[0]
    assert "the pack splits it: rank r keeps samples r, r+2" in said[0] and "split it in Stream.__iter__" in said[0]


@pytest.mark.slow
def test_a_model_built_before_build_trainer_is_named_once_at_two_ranks(tmp_path):
    done = scenario("prebuilt", tmp_path, 4, quiet=False)
    assert done.returncode == 0, done.stderr[-3000:]
    said = [line for line in done.stderr.splitlines() if "was built before build_trainer(seed=0)" in line]
    assert len(said) == 1, done.stderr[-3000:]  # rank 0 only
    for noise in ("sync_dist=True", "reduce_op", "Total length of", "exists and is not empty"):
        assert noise not in done.stderr, noise


@pytest.mark.slow
def test_two_ranks_continuing_past_max_steps_with_workers_and_augmentation_is_exact(images, tmp_path):
    """ResNet on ImageFolder PNGs, RandomResizedCrop in 1 loader worker per rank, dropout, warm-up (a schedule
    that does not depend on the run's length), 2 gloo ranks: stopped by --max-steps 3 mid-epoch (6 steps per
    epoch), then --max-epochs 1 ends that epoch at step 6, and --max-epochs 2 ends as the run that had
    --max-epochs 2 from the start. Also: the noise a 2-rank recipe run printed is gone."""
    common = ["--no-cosine"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    run([*RESNET, *args(images, 2, "--max-epochs", "2", *common), "--output-dir", straight], timeout=600, check=True)
    stopped = run([*RESNET, *args(images, 2, "--max-epochs", "2", "--max-steps", "3", *common), "--output-dir", split],
                  timeout=600, check=True, quiet=False)
    for noise in ("sync_dist=True", "reduce_op", "Total length of", "exists and is not empty", "could not find the "
                  "monitored key"):
        assert noise not in stopped.stderr, noise
    one = run([*RESNET, *args(images, 2, "--max-epochs", "1", *common), "--output-dir", split, "--resume", "auto"],
              timeout=600, check=True)
    assert saved_step(last_ckpt(split)) == 6 and "max_epochs=1" in one.stdout + one.stderr
    run([*RESNET, *args(images, 2, "--max-epochs", "2", *common), "--output-dir", split, "--resume", "auto"],
        timeout=600, check=True)
    assert_same_weights(last_ckpt(split), last_ckpt(straight))


def test_a_run_resumed_with_another_epoch_length_is_held_to_its_own_limit(tmp_path):
    """Epoch 0 at batch 8 (4 steps), continued at batch 2 (16 steps an epoch) to max_epochs=2, max_steps=10: the
    run ends at step 10 with no RunPositionError (the checkpoint's 4-step epochs alone would imply 8)."""
    trainer = build_trainer(accelerator="cpu", seed=0, default_root_dir=str(tmp_path), max_epochs=1, **QUIET)
    trainer.fit(_net(), _loader())
    trainer.save_checkpoint(tmp_path / "epoch0.ckpt")
    steps = Steps()
    trainer = build_trainer(accelerator="cpu", seed=0, default_root_dir=str(tmp_path), max_epochs=2, max_steps=10,
                            callbacks=[steps], **QUIET)
    trainer.fit(_net(), _loader(batch_size=2), ckpt_path=str(tmp_path / "epoch0.ckpt"))
    assert trainer.global_step == 10 and steps.seen == [(1, b) for b in range(6)]


def test_a_stream_resumed_at_another_accumulation_is_not_held_to_an_unknown_epoch_length(tmp_path):
    """A loader without a length never says how many steps an epoch has: resumed at accumulation 2 from an
    accumulation-1 checkpoint, the fit ends at its own limit with no RunPositionError ("x -1 steps per epoch")."""
    trainer = build_trainer(accelerator="cpu", seed=0, default_root_dir=str(tmp_path), max_epochs=1, **QUIET)
    trainer.fit(_net(), DataLoader(Batches(), batch_size=None))
    trainer.save_checkpoint(tmp_path / "epoch0.ckpt")
    trainer = build_trainer(accelerator="cpu", seed=0, default_root_dir=str(tmp_path), max_epochs=2,
                            accumulate_grad_batches=2, **QUIET)
    trainer.fit(_net(), DataLoader(Batches(), batch_size=None), ckpt_path=str(tmp_path / "epoch0.ckpt"))
    assert trainer.global_step == 6

