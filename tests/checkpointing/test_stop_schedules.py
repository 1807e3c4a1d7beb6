"""Stops one after another, each resumed with ``--resume auto``: the run ends at its limit, bit-identical to the
uninterrupted one (issue #43).

The schedule that failed: a SIGTERM agreed at an epoch's last step, the resumed run killed two steps into
the next epoch, then resumed again. Lightning 2.6 restored the first checkpoint with the next epoch never
opened, so the second checkpoint read "no epoch in progress" and the last run trained that whole epoch again
(26 steps where 3 epochs x 8 imply 24). ``open_next_epoch`` fixes it; ``RunPosition`` fails such a run at its
first batch instead of letting it train.

2 gloo ranks, ResNet-18 on 16 px crops of a JPEG folder (random crops in 1 loader worker per rank), a
checkpoint at every step. Faults come from tests/scenarios/reliability_scenarios.py.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import assert_same_weights, write_jpeg_tree
from tests.launch import run

ROOT = Path(__file__).resolve().parents[2]
SCENARIO = ROOT / "tests" / "scenarios" / "reliability_scenarios.py"
# 64 train images / (4 per device x 2 ranks) = 8 steps per epoch; 3 epochs = 24 steps.
STEPS_PER_EPOCH, EPOCHS = 8, 3
CLEAN = dict(drop_prefixes=("TORCHELASTIC_", "REL_", "SLURM_"), drop=("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                                     "MASTER_ADDR"), threads=1)


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    return write_jpeg_tree(tmp_path_factory.mktemp("jpegs"), per_class=32, val_per_class=4, side=20)


def flags(images: Path, out: Path | str, *extra: str, epochs: int = EPOCHS) -> list[str]:
    return ["--accelerator", "cpu", "--data", "imagefolder", "--data-dir", str(images), "--image-size", "16",
            "--min-crop-scale", "0.3", "--batch-size", "4", "--num-workers", "1", "--lr", "0.05", "--no-cosine",
            "--devices", "2", "--max-epochs", str(epochs), "--checkpoint-every-n-steps", "1", "--timeout-s", "30",
            "--output-dir", str(out), *extra]


def saved(out: Path) -> dict:
    ckpt = torch.load(out / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    return {"step": ckpt["global_step"], "epoch": ckpt["epoch"]}


@pytest.mark.slow  # 4 two-rank runs
def test_sigterm_at_an_epochs_last_step_then_a_lost_rank_resumes_exactly(images, tmp_path):
    straight = tmp_path / "straight"
    run(["-m", "recipes.resnet", *flags(images, straight)], timeout=600, check=True, **CLEAN)
    out = tmp_path / "split"
    # SIGTERM to rank 1 during step 15: agreed at the next boundary, step 16, epoch 1's last.
    term = run([SCENARIO, "resnet", *flags(images, out)], timeout=600, **CLEAN,
               env=dict(REL_FAULT="term", REL_STEP="14", REL_MARKER=str(tmp_path / "term")))
    assert term.returncode == 143, term.stdout[-3000:] + term.stderr[-3000:]
    assert saved(out)["step"] == 2 * STEPS_PER_EPOCH
    # Resumed there; rank 1 dies at the start of step 19 (the last checkpoint: step 18, epoch 2's second).
    crash = run([SCENARIO, "resnet", *flags(images, out, "--resume", "auto")], timeout=600, **CLEAN,
                env=dict(REL_FAULT="crash", REL_STEP="18", REL_MARKER=str(tmp_path / "crash")))
    assert crash.returncode != 0 and saved(out)["step"] == 18, crash.stderr[-3000:]
    done = run(["-m", "recipes.resnet", *flags(images, out, "--resume", "auto")], timeout=600, **CLEAN)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == EPOCHS * STEPS_PER_EPOCH, summary["steps"]
    assert_same_weights(out / "checkpoints" / "last.ckpt", straight / "checkpoints" / "last.ckpt")


# ---- chaos: a seeded schedule of stops of every kind, locally and on a bucket ---------------------------------

CHAOS = ROOT / "tests" / "scenarios" / "chaos_scenario.py"
CHAOS_EPOCHS = 6  # 48 steps: room for 10 stops, the longest of which keep an epoch
IN_PROCESS = ("kill-job", "term-launcher", "kill-rank1", "kill-in-upload", "kill-before-publish", "kill-in-validation",
              "term-last-batch", "kill-after-agreed")
TERMS = ("term-launcher", "term-last-batch")


def chaos_schedule(seed: int, bucket: bool, stops: int = 10) -> list[tuple[str, int]]:
    """Every kind once (a frozen store too on a bucket), the rest drawn, in a seeded order; each with the steps
    after its attempt's start at which it strikes."""
    import random

    rng = random.Random(seed)
    kinds = [*IN_PROCESS, *(["freeze-store"] if bucket else [])]
    plan = kinds + rng.choices(kinds, k=max(0, stops - len(kinds)))
    rng.shuffle(plan)
    return [(kind, rng.randint(1, 3)) for kind in plan]


def _chaos_attempt(args: list[str], kind: str, after: int, log: Path, s3=None, **options) -> tuple[int, str]:
    from tests.launch import start

    if kind != "freeze-store":
        done = run([CHAOS, "resnet", *args], timeout=600, log=log, env={**options.pop("env", {}), "CHAOS_KIND": kind,
                                                                         "CHAOS_AFTER": str(after)}, **options)
        return done.returncode, done.stdout
    # The store stops answering for 8 s once this attempt has published `after` more steps; 3 s into it the job is
    # killed (its upload hangs), and the next attempt starts while the store is still frozen.
    proc = start(["-m", "recipes.resnet", *args], log=log, **options)
    first = proc.wait_until(lambda: _published_step(s3) >= 0 and _published_step(s3), 300, "a first manifest")
    proc.wait_until(lambda: _published_step(s3) >= first + after, 300, f"step {first + after} published")
    s3.freeze(8)
    time.sleep(3)
    proc.signal(9, group=True)
    code = proc.wait(60)
    said = f"[chaos] stop freeze-store: job killed 3 s into an 8 s freeze after step {first + after}"
    return code, f"{proc.output}\n{said}\n"


def _published_step(s3) -> int:
    try:
        body = s3.client().get_object(Bucket="chaos", Key="run/checkpoints/last.ckpt.manifest.json")["Body"].read()
    except Exception:
        return -1
    return int(json.loads(body)["global_step"])


@pytest.fixture(scope="module")
def chaos_straight(images, tmp_path_factory) -> Path:
    """The uninterrupted 48-step run both backends' schedules must end equal to: always written locally, so the
    same run serves both (it was run once per backend)."""
    straight = tmp_path_factory.mktemp("chaos-straight")
    run(["-m", "recipes.resnet", *flags(images, straight, epochs=CHAOS_EPOCHS)], timeout=900, check=True, **CLEAN)
    return straight / "checkpoints" / "last.ckpt"


@pytest.mark.slow  # 11 two-rank attempts per backend

@pytest.mark.parametrize("backend", ["local", "bucket"])
def test_a_seeded_chaos_schedule_of_stops_ends_bit_identical(backend, images, chaos_straight, tmp_path, request):
    """10 stops (every kind in chaos_scenario.py, and on a bucket a frozen store), each followed by the same
    command with --resume auto (on a bucket from an empty cache: another machine): the run ends at 48 steps with
    the uninterrupted run's weights. The seed and every stop's moment are printed; CHAOS_SEED replays one."""
    import os

    seed = int(os.environ.get("CHAOS_SEED", "43"))
    plan = chaos_schedule(seed, bucket=backend == "bucket")
    print(f"chaos seed {seed} ({backend}): " + ", ".join(f"{kind}+{after}" for kind, after in plan))
    options: dict = dict(CLEAN)
    s3 = None
    if backend == "bucket":
        s3 = request.getfixturevalue("s3")
        out = s3.bucket("chaos") + "/run"
    else:
        out = str(tmp_path / "run")
    for i, (kind, after) in enumerate(plan):
        cache = tmp_path / f"machine-{i}"  # every attempt on a fresh machine: an empty local cache
        env = {**(s3.env if s3 else {}), "DDP_RECIPES_CACHE_DIR": str(cache)}
        resume = ["--resume", "auto"] if i else []
        code, text = _chaos_attempt(flags(images, out, *resume, epochs=CHAOS_EPOCHS), kind, after,
                                    tmp_path / f"attempt-{i}.log", s3=s3, **{**options, "env": env})
        said = [line[line.index("[chaos]"):] for line in text.splitlines() if "[chaos]" in line]  # after a bar's \r
        print(f"attempt {i} ({kind}+{after}): exit {code}; " + " | ".join(said))
        assert code != 0, f"attempt {i} ended the run before its stop ({kind}+{after}):\n{text[-3000:]}"
        if kind in TERMS or kind == "kill-after-agreed":
            assert any("stop " in line for line in said), text[-3000:]
        assert "run-position" not in text, text[-3000:]
    env = {**(s3.env if s3 else {}), "DDP_RECIPES_CACHE_DIR": str(tmp_path / "machine-last")}
    done = run(["-m", "recipes.resnet", *flags(images, out, "--resume", "auto", epochs=CHAOS_EPOCHS)], timeout=900,
               log=tmp_path / "last.log", env=env, **CLEAN)
    assert done.returncode == 0, done.stdout[-3000:]
    if s3 is None:
        summary, final = json.loads((Path(out) / "summary.json").read_text()), Path(out) / "checkpoints" / "last.ckpt"
    else:
        summary = json.loads(s3.client().get_object(Bucket="chaos", Key="run/summary.json")["Body"].read())
        entry = json.loads(s3.client().get_object(Bucket="chaos", Key="run/checkpoints/last.ckpt.manifest.json")
                           ["Body"].read())
        final = tmp_path / "final.ckpt"
        s3.client().download_file("chaos", f"run/checkpoints/{entry['object']}", str(final))
    assert summary["steps"] == CHAOS_EPOCHS * STEPS_PER_EPOCH
    stops = summary["stops"]
    assert stops["attempts"] == len(plan) + 1 and len(stops["stops"]) == len(plan)
    print("stops: " + json.dumps(stops["stops"]))
    for stop, (kind, _) in zip(stops["stops"], plan, strict=True):
        if kind in TERMS:  # saved where it stopped
            assert stop["how"] == "preempted by SIGTERM" and stop["steps_redone"] == 0, stop
        assert stop["steps_redone"] <= 2, stop  # a checkpoint every step
    assert_same_weights(final, chaos_straight)
