"""Stop anywhere, continue exactly: SIGKILL at a random step, SIGTERM, SLURM's SIGUSR1, resize, PowerSGD.

Every scenario runs the real CLI (``python -m recipes.resnet``) with what makes exactness hard: random
crops decoded in loader workers (``--num-workers 1``), dropout, two gloo ranks. The weights a resumed run
ends with are compared bit for bit with an uninterrupted run's.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import stat
from pathlib import Path

import pytest
import torch

from tests.helpers import SHARED_DATA, assert_same_weights
from tests.launch import run, saved_step, start
from tests.marks import needs_mnist
from tests.resume_scenario import (
    CAPTURED_STEP_LIMIT_S,
    RESNET,
    RUNS,
    args,
)


@pytest.mark.slow  # over 30 s: the fast suite keeps its 10-minute budget
@pytest.mark.parametrize("devices", [1])
def test_sigkill_at_random_step_then_resume_auto_is_exact(devices, images, straight, tmp_path):
    """1 rank with gradient accumulation (a kill mid-window resumes at the window's start). SIGKILL of a 2-rank
    job is in every seeded chaos schedule (test_stop_schedules.py, ``kill-job``), locally and on a bucket."""
    argv = [*args(images, devices, *RUNS[devices], "--checkpoint-every-n-steps", "1"), "--output-dir", str(tmp_path)]
    kill_at = random.Random(os.getpid() + devices).randint(1, 11)  # mid-epoch, epoch end, next epoch
    proc = start([*RESNET, *argv])
    seen = proc.wait_for_step(tmp_path / "checkpoints" / "last.ckpt", kill_at, timeout=CAPTURED_STEP_LIMIT_S)
    proc.kill()  # the ranks and their loader workers, no grace
    assert seen < 12, "the run finished before it could be killed"
    run([*RESNET, *argv, "--resume", "auto"], timeout=600, check=True)
    assert saved_step(tmp_path / "checkpoints" / "last.ckpt") == 12
    assert_same_weights(straight(devices), tmp_path / "checkpoints" / "last.ckpt")


@pytest.mark.slow  # a long multi-process run: make test-slow (keeps make test near 10 min)
@pytest.mark.parametrize("target", ["every-rank"])
def test_sigterm_saves_exits_cleanly_and_resumes_exactly(target, images, straight, tmp_path):
    """SIGTERM to every process of the job (a container stop); the launcher alone is every chaos schedule's
    ``term-launcher`` (test_stop_schedules.py), which checks the same save-where-it-stopped."""
    argv = [*args(images, 2, "--max-epochs", "2", "--checkpoint-every-n-steps", "2"), "--output-dir", str(tmp_path)]
    last = tmp_path / "checkpoints" / "last.ckpt"
    proc = start([*RESNET, *argv])
    seen = proc.wait_for_step(last, 2, timeout=CAPTURED_STEP_LIMIT_S)
    # the launcher: the process Lightning launched the other rank from; every rank: and every loader worker,
    # as a container stop does
    proc.signal(signal.SIGTERM, group=target != "launcher")
    done = proc.finish(timeout=120)
    err = done.stderr
    assert done.returncode == 128 + signal.SIGTERM, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("preempted by")]
    assert len(lines) == 1 and "SIGTERM" in lines[0] and "--resume auto" in lines[0] and str(last) in lines[0]
    assert "Traceback" not in err
    step = saved_step(last)
    # Saved within a few steps of the signal: the vote is read one boundary late, and the signal itself lands up to
    # two steps after `seen` (the test learns the step by loading the file; CI saw 2 -> saved 6 under load). The
    # grace period is counted in steps, not timed here; that every rank stops at the same one is asserted above.
    assert seen <= step <= seen + 4 and f"at step {step} " in lines[0]
    run([*RESNET, *argv, "--resume", "auto"], timeout=600, check=True)
    assert_same_weights(straight(2), last)


def test_slurm_sigusr1_saves_requeues_and_exits(images, tmp_path):
    """One srun task (as SLURM would start it), ``--signal=SIGUSR1@90``: save, ``scontrol requeue``, exit."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'scontrol.log'}\n")
    scontrol.chmod(scontrol.stat().st_mode | stat.S_IEXEC)
    slurm = {"SLURM_NTASKS": "1", "SLURM_NTASKS_PER_NODE": "1", "SLURM_JOB_ID": "4242", "SLURM_PROCID": "0",
             "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_JOB_NAME": "train", "SLURM_NODELIST": "localhost",
             "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    out = tmp_path / "run"
    proc = start([*RESNET, *args(images, 1, "--max-epochs", "2", "--checkpoint-every-n-steps", "3"),
                  "--output-dir", str(out)], env=slurm)
    proc.wait_for_step(out / "checkpoints" / "last.ckpt", 3, timeout=CAPTURED_STEP_LIMIT_S)
    proc.signal(signal.SIGUSR1)
    done = proc.finish(timeout=120)
    err = done.stderr
    assert done.returncode == 128 + signal.SIGUSR1, err[-3000:]
    assert (tmp_path / "scontrol.log").read_text().split() == ["requeue", "4242"]
    line = [x for x in err.splitlines() if x.startswith("preempted by SIGUSR1")]
    assert line and "SLURM job 4242 requeued" in line[0] and "Traceback" not in err


@pytest.mark.slow  # over 30 s: the fast suite keeps its 10-minute budget
def test_resize_two_ranks_to_one_keeps_the_lr_curve(images, tmp_path):
    """2 ranks x 4, stopped after epoch 1; resumed on 1 rank with the global batch kept (4 x 2 accumulation):
    the LR of the first resumed step is the one the 2-rank run used at that step."""
    common = ["--global-batch-size", "8", "--max-epochs", "2", "--max-steps", "7"]
    run([*RESNET, *args(images, 2, *common), "--output-dir", str(tmp_path / "two")], timeout=600, check=True)
    run([*RESNET, *args(images, 2, *common[:4], "--max-steps", "6"), "--output-dir", str(tmp_path / "split")],
        timeout=600)
    one = run([*RESNET, *args(images, 1, *common), "--output-dir", str(tmp_path / "split"), "--resume", "auto"],
              timeout=600, check=True)
    said = [line for line in (one.stdout + one.stderr).splitlines() if "resumed at world size 1" in line]
    assert said and "global batch 8 kept" in said[0] and "2 accumulation" in said[0]

    def lr_after(path: Path) -> float:  # the LR set for the step after the checkpoint's last one
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
        return ckpt["optimizer_states"][0]["param_groups"][0]["lr"]

    assert lr_after(tmp_path / "split" / "checkpoints" / "last.ckpt") == pytest.approx(
        lr_after(tmp_path / "two" / "checkpoints" / "last.ckpt"), rel=1e-12)


@pytest.mark.slow
def test_resize_with_another_global_batch_applies_the_new_lr(images, tmp_path):
    """Per-device batch kept, so 1 rank has half the global batch: its linearly scaled LR, not the checkpoint's,
    continues the schedule (warm-up 0.5 epoch, cosine over the run)."""
    run([*RESNET, *args(images, 2, "--max-epochs", "1"), "--output-dir", str(tmp_path)], timeout=600, check=True)
    resumed = run([*RESNET, *args(images, 1, "--max-epochs", "2", "--max-steps", "13"), "--output-dir", str(tmp_path),
                   "--resume", "auto"], timeout=600, check=True)
    said = " ".join(line for line in (resumed.stdout + resumed.stderr).splitlines() if "resumed at world" in line)
    assert "global batch 8 -> 4" in said and "peak LR 0.0015625 -> 0.00078125 re-applied" in said
    ckpt = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert ckpt["lr_schedulers"][0]["base_lrs"] == pytest.approx([0.05 * 4 / 256] * 2)


@pytest.mark.slow  # over 30 s: the fast suite keeps its 10-minute budget
@needs_mnist
def test_powersgd_state_is_checkpointed(tmp_path):
    """PowerSGD (from iteration 10) on 2 ranks, SIGKILLed after it started compressing: the resumed run ends
    equal. The MNIST MLP's gradients fit one DDP bucket, whose order changes at DDP's bucket rebuild, so this
    also proves the state is re-laid-out for the first resumed step. (Several buckets cannot run on gloo:
    torch's hook then issues collectives from future callbacks that pair up wrongly, resumed or not.)"""
    common = ["--accelerator", "cpu", "--data-dir", str(SHARED_DATA), "--no-download", "--devices", "2",
              "--max-steps", "24", "--comm-hook", "powersgd", "--checkpoint-every-n-steps", "1"]

    def mnist(out: Path, *extra: str) -> list[str]:
        return ["-m", "recipes.mnist", *common, "--output-dir", str(out), *extra]

    run(mnist(tmp_path / "straight"), timeout=600, check=True)
    last = tmp_path / "split" / "checkpoints" / "last.ckpt"
    proc = start(mnist(tmp_path / "split"))
    proc.wait_for_step(last, 14, timeout=CAPTURED_STEP_LIMIT_S)
    proc.kill()
    states = torch.load(last, map_location="cpu", weights_only=True)["callbacks"]["ResumeState"]["comm_hook"]
    assert len(states) == 2 and states[0]["iter"] >= 14
    pieces = [s["pieces"] for s in states]  # per parameter: error feedback and warm-start Q
    assert pieces[0].keys() == pieces[1].keys() and all("error" in p for p in pieces[0].values())
    assert any("q" in p for p in pieces[0].values())
    weight = next(name for name in pieces[0] if name.endswith("weight"))
    assert not torch.equal(pieces[0][weight]["error"], pieces[1][weight]["error"])  # per-rank residuals
    run(mnist(tmp_path / "split", "--resume", "auto"), timeout=600, check=True)
    assert saved_step(last) == 24
    assert_same_weights(tmp_path / "straight" / "checkpoints" / "last.ckpt", last)


# ---- in-process, one device: the cadence and the --resume auto rule ------------------------------------

TINY = ["--accelerator", "cpu", "--data", "synthetic", "--image-size", "16", "--synthetic-samples", "64",
        "--batch-size", "16", "--lr", "0.05"]  # 4 steps per epoch


@pytest.mark.parametrize("val_samples", ["32", "0"])
def test_last_checkpoint_cadence(val_samples, tmp_path, monkeypatch):
    """last.ckpt at every epoch end (validation or not, improving or not) and every N steps, once per step."""
    from ddp_recipes.checkpointing.last import LastCheckpoint
    from recipes import resnet

    saved: list[int] = []
    original = LastCheckpoint.save

    def spy(self, trainer):
        before = self._saved_step
        original(self, trainer)
        if self._saved_step != before:
            saved.append(trainer.global_step)

    monkeypatch.setattr(LastCheckpoint, "save", spy)
    resnet.main([*TINY, "--synthetic-val-samples", val_samples, "--max-epochs", "2", "--checkpoint-every-n-steps", "3",
                 "--lr", "1e-9", "--output-dir", str(tmp_path)])  # lr ~0: val_acc does not improve in epoch 2
    assert saved == [3, 4, 6, 8]  # every 3 steps and every epoch end (step 4, 8), each step once
    assert saved_step(tmp_path / "checkpoints" / "last.ckpt") == 8


def _cut(path: Path) -> bytes:
    """``path`` cut in half, as a full disk or a broken copy leaves it; returns the bytes kept."""
    kept = path.read_bytes()[: path.stat().st_size // 2]
    path.write_bytes(kept)
    return kept


def test_a_cut_last_ckpt_with_nothing_else_is_refused_and_kept(tmp_path, capsys):
    """--resume auto on a last.ckpt cut in half, the run's only checkpoint: one line naming the file and the ways
    on, exit 2, and the file and summary.json untouched (it was a start from step 0 over both)."""
    from recipes import resnet

    resnet.main([*TINY, "--max-steps", "2", "--output-dir", str(tmp_path)])
    last, summary = tmp_path / "checkpoints" / "last.ckpt", tmp_path / "summary.json"
    kept, said = _cut(last), summary.read_bytes()
    for resume in (["--resume", "auto"], []):  # continuing, and a new run over it
        capsys.readouterr()
        with pytest.raises(SystemExit) as exc:
            resnet.main([*TINY, "--max-steps", "4", "--output-dir", str(tmp_path), *resume])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert last.read_bytes() == kept and summary.read_bytes() == said
        assert "last.ckpt" in err and "--output-dir" in err
    assert "is a cut or damaged checkpoint" in err or "holds" in err


def test_a_cut_last_ckpt_continues_from_the_runs_newest_readable_one_and_keeps_the_bytes(tmp_path):
    """A cut last.ckpt beside a readable checkpoint of the same run: --resume auto says which one it continues
    from, keeps the cut bytes as last.ckpt.unreadable, and ends where an uncut continuation from that one does."""
    from recipes import resnet

    resnet.main([*TINY, "--max-steps", "4", "--checkpoint-every-n-steps", "2", "--output-dir", str(tmp_path)])
    folder = tmp_path / "checkpoints"
    shutil.copy(folder / "last.ckpt", folder / "step4.ckpt")  # a copy the user kept, readable
    kept = _cut(folder / "last.ckpt")
    with pytest.warns(UserWarning, match=r"last\.ckpt is a cut or damaged checkpoint .*continuing from step4\.ckpt at "
                                         r"step 4.*kept as last\.ckpt\.unreadable"):
        resnet.main([*TINY, "--max-steps", "6", "--output-dir", str(tmp_path), "--resume", "auto"])
    assert (folder / "last.ckpt.unreadable").read_bytes() == kept
    assert saved_step(folder / "last.ckpt") == 6


# ---- random streams: the rank's own CUDA generator only, and no CUDA at all on a CPU run ---------------

CUDA_CALLS = ("is_available", "init", "_lazy_init", "device_count", "current_device", "get_rng_state",
              "get_rng_state_all", "set_rng_state", "set_rng_state_all")


def test_a_cpu_run_never_calls_into_cuda(tmp_path, monkeypatch):
    """A CPU run (fresh, then resumed) on a GPU host must not initialise CUDA in its ranks: neither the RNG
    save/restore nor the image DataModule's pin_memory default may ask CUDA anything."""
    import inspect

    from recipes import resnet

    ours = str(Path(__file__).resolve().parents[2] / "ddp_recipes")
    asked: list[str] = []

    def recorder(name, original):
        def call(*args, **kwargs):
            caller = inspect.stack()[1].filename
            if caller.startswith(ours):
                asked.append(f"torch.cuda.{name} from {Path(caller).name}")
            return original(*args, **kwargs)
        return call

    for name in CUDA_CALLS:
        monkeypatch.setattr(torch.cuda, name, recorder(name, getattr(torch.cuda, name)))
    common = [*TINY, "--checkpoint-every-n-steps", "2", "--output-dir", str(tmp_path)]
    resnet.main([*common, "--max-steps", "2"])
    resnet.main([*common, "--max-steps", "4", "--resume", "auto"])
    assert saved_step(tmp_path / "checkpoints" / "last.ckpt") == 4
    assert asked == []
    rng = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)["callbacks"]["ResumeState"]["rng"]
    assert rng[0]["cuda"] is None


@pytest.fixture
def four_gpus(monkeypatch):
    """A fake layout of 4 visible CUDA devices: each generator's state is its index; restores are recorded."""
    import torch.cuda as cuda

    restored: list[tuple[torch.device, int]] = []
    visible = {"count": 4}

    def index(device) -> int:
        device = torch.device(device)
        return device.index if device.index is not None else 0

    def never(*args, **kwargs):
        raise AssertionError("every device's generator touched")

    monkeypatch.setattr(cuda, "device_count", lambda: visible["count"])
    monkeypatch.setattr(cuda, "get_rng_state", lambda device="cuda": torch.tensor([index(device)], dtype=torch.uint8))
    monkeypatch.setattr(cuda, "set_rng_state",
                        lambda state, device="cuda": restored.append((torch.device(device), int(state[0]))))
    monkeypatch.setattr(cuda, "get_rng_state_all", never)
    monkeypatch.setattr(cuda, "set_rng_state_all", never)
    return visible, restored


def test_only_the_own_cuda_generator_is_saved_and_restored(four_gpus, tmp_path):
    """Saved by rank 2 of a 4-GPU node (cuda:2), resumed as one SLURM task per GPU (the task sees cuda:0)."""
    from ddp_recipes.checkpointing.exact_continuation import rng_state, set_rng_state

    visible, restored = four_gpus
    torch.save(rng_state(torch.device("cuda", 2)), tmp_path / "rng.pt")
    saved = torch.load(tmp_path / "rng.pt", weights_only=True)
    assert torch.equal(saved["cuda"], torch.tensor([2], dtype=torch.uint8))
    visible["count"] = 1
    set_rng_state(saved, torch.device("cuda", 0))
    assert restored == [(torch.device("cuda", 0), 2)]
    set_rng_state(saved, torch.device("cpu"))  # a CPU resume of a CUDA run: the CPU streams only
    assert len(restored) == 1


def test_old_checkpoints_with_every_devices_state_still_load(four_gpus):
    """ddp-recipes <= 0.2 saved every visible device's state in a list: its own entry is restored when the
    process sees as many devices; otherwise a warning, not a crash."""
    from ddp_recipes.checkpointing.exact_continuation import rng_state, set_rng_state

    visible, restored = four_gpus
    old = {**rng_state(), "cuda": [torch.tensor([i], dtype=torch.uint8) for i in range(4)]}
    set_rng_state(old, torch.device("cuda", 3))
    assert restored == [(torch.device("cuda", 3), 3)]
    visible["count"] = 1
    with pytest.warns(UserWarning, match=r"CUDA random states of 4 visible device\(s\) by position"):
        set_rng_state(old, torch.device("cuda", 0))
    assert len(restored) == 1
    set_rng_state({**old, "cuda": []}, torch.device("cuda", 0))  # an old CPU run's checkpoint
    assert len(restored) == 1


def test_a_cut_last_ckpt_of_a_users_model_checkpoint_is_kept_too(tmp_path):
    """build_trainer(preemption=False) with the user's own ModelCheckpoint(save_last=True), continued with
    ckpt_path="last": the cut last.ckpt is set aside before that callback's next save could write over it."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from ddp_recipes import build_trainer
    from tests.tiny_modules import tiny_module_and_data

    def fit(steps: int) -> None:
        saver = ModelCheckpoint(dirpath=tmp_path / "ck", save_last=True, every_n_train_steps=1)
        trainer = build_trainer(accelerator="cpu", max_steps=steps, preemption=False, callbacks=[saver],
                                default_root_dir=str(tmp_path), logger=False, enable_progress_bar=False)
        trainer.fit(*tiny_module_and_data(), ckpt_path="last")

    fit(2)
    kept = _cut(tmp_path / "ck" / "last.ckpt")
    with pytest.warns(UserWarning, match=r"last\.ckpt is a cut or damaged checkpoint .*kept as last\.ckpt\.unreadable"):
        fit(3)
    assert (tmp_path / "ck" / "last.ckpt.unreadable").read_bytes() == kept
    assert saved_step(tmp_path / "ck" / "last.ckpt") == 3
