"""gpu-check's in-process checks, each run in a fresh process by ``tests.gpucheck``.

    python -m tests.gpucheck.worker sync-debug --out FILE [--steps 12] [--warmup-steps 3] [--accelerator cpu]
    python -m tests.gpucheck.worker decode-gpu --out FILE [--steps 16] [--batch-size 128]

``sync-debug``: the pack's training path (``build_trainer``, the recipe's ResNet-50 LightningModule,
bf16-mixed, channels-last, one GPU) with ``torch.cuda.set_sync_debug_mode("warn")`` switched on for the
steady-state steps only: after the warm-up (one-off syncs: cuDNN set-up, the allocator) and after the first log
step (one-off: Lightning's metric holders built and moved to the device), a CSV logger writing every 5 steps so
later log steps fall inside the window. ``--accelerator cpu``: the same on the CPU, counted by
:mod:`tests.gpucheck.standin` (how the CPU suite runs it). Every "synchronizing CUDA operation" warning is
counted with the Python frames that caused it and the batch it came in; FILE gets :func:`sync_report`'s
record: ``syncs`` in the steps that do not log (must be 0) and, per log step, the syncs against the values the
logger wrote.
bf16, not 16-mixed: a GradScaler reads found-inf on the host each step by design.

``decode-gpu``: the ResNet-50 recipe (``python -m recipes.resnet``, bf16-mixed, channels-last, one device, the
recipe's default loader workers) on one folder of real-size synthetic JPEGs
(:mod:`ddp_recipes.bench.jpeg_folder`, written next to FILE), once with ``--decode cpu`` and once with
``--decode gpu``, each in a fresh process; FILE gets each run's images/s, input-wait fraction, loader workers
and (gpu) its ``decode`` record from ``summary.json``. The training folder holds one batch more than the steps
take, so no run reaches its epoch's end: the figures are the training steps', not validation's.
"""

from __future__ import annotations

import argparse
import json
import traceback
import warnings
from pathlib import Path
from typing import Any

SYNC_MESSAGE = "synchronizing CUDA operation"


class SyncCounter:
    """Records each host sync's caller frames, and the batch it came in, while :meth:`active` is set: CUDA's
    sync-debug warnings on a GPU, the stand-ins' counts (:mod:`tests.gpucheck.standin`) on the CPU."""

    def __init__(self) -> None:
        self.active = False
        self.batch = -1
        self.sites: list[tuple[int, str]] = []

    def record(self, what: str = "") -> None:
        if self.active:
            frames = [f for f in traceback.extract_stack()[:-1]
                      if "warnings.py" not in f.filename and "standin.py" not in f.filename][-3:]
            site = " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames))
            self.sites.append((self.batch, f"{site} ({what})" if what else site))

    def showwarning(self, message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ANN001
        if SYNC_MESSAGE in str(message):
            self.record()


def sync_report(sites: list[tuple[int, str]], logged: dict[int, int], first: int, last: int) -> dict[str, Any]:
    """sync.json: the host syncs of batches ``first``..``last`` split by whether the logger wrote in that batch
    (``logged``: batch -> values written). A step that does not log must make none; a log step may read what the
    logger writes, one value each."""
    log_batches = sorted(b for b in logged if first <= b <= last)
    plain = [(b, site) for b, site in sites if b not in logged]
    at_log = {b: sum(1 for s, _ in sites if s == b) for b in log_batches}
    over = {b: n for b, n in at_log.items() if n > logged[b]}
    return {"syncs": len(plain), "steps": last - first + 1, "first_batch": first, "last_batch": last,
            "sites": sorted({site for _, site in plain})[:20],
            "log_steps": log_batches, "log_step_syncs": at_log, "logged_values": {b: logged[b] for b in log_batches},
            "log_steps_over": over,
            "log_step_sites": sorted({site for b, site in sites if b in over})[:20]}


def sync_debug(steps: int, warmup: int, batch: int, out: Path, log_every: int = 5, accelerator: str = "cuda",
               arch: str = "resnet50", image_size: int = 224, precision: str = "bf16-mixed") -> dict[str, Any]:
    import contextlib

    import torch
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.loggers import CSVLogger
    from torch.utils.data import DataLoader

    from ddp_recipes.bench.harness.workload import Workload, build_dataset, build_module
    from ddp_recipes.data.samplers import keep_batch
    from ddp_recipes.train.trainer import build_trainer

    on_cuda = accelerator == "cuda"
    # The window opens after the first log step (batch log_every - 1): there Lightning builds its metric holders
    # on the host and moves them to the device, and its logger connector starts its per-log work, once per run.
    warmup = max(warmup, log_every)
    counter = SyncCounter()
    total = warmup + steps
    logged: dict[int, int] = {}

    class Window(Callback):
        # The mode is global (not per thread), and backward's warnings are replayed on this thread. The window
        # spans log steps (every log_every): a log step's reads must be the logger's values, no more.
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            counter.batch = batch_idx
            if batch_idx == warmup:
                if on_cuda:
                    torch.cuda.synchronize()
                    torch.cuda.set_sync_debug_mode("warn")
                counter.active = True

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if batch_idx == total - 1:
                if on_cuda:
                    torch.cuda.set_sync_debug_mode("default")
                counter.active = False

    class CountingCSV(CSVLogger):
        def log_metrics(self, metrics, step=None) -> None:
            if counter.active:
                logged[counter.batch] = logged.get(counter.batch, 0) + len(metrics)
            super().log_metrics(metrics, step)

    w = Workload(recipe="resnet", arch=arch, image_size=image_size, batch_size=batch, steps=steps,
                 warmup_steps=warmup, precision=precision, accelerator=accelerator, channels_last=1)
    trainer = build_trainer(devices=1, accelerator=accelerator, precision=precision, seed=0, max_steps=total,
                            logger=CountingCSV(out.parent / "sync-logs"), log_every_n_steps=log_every,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            num_sanity_val_steps=0, callbacks=[Window()])
    module = build_module(w)
    with warnings.catch_warnings(), contextlib.ExitStack() as stand_ins:
        warnings.simplefilter("always")  # every occurrence, not once per call site
        warnings.showwarning = counter.showwarning
        if not on_cuda:  # the CPU stand-ins, entered for the whole run: host tensors are followed from the start
            from tests.gpucheck.standin import HostReads, HostToDeviceCopies

            stand_ins.enter_context(HostToDeviceCopies(torch.device(accelerator), counter.record))
            stand_ins.enter_context(HostReads(counter.record))
        trainer.fit(module, DataLoader(build_dataset(w), batch_size=batch, shuffle=True, collate_fn=keep_batch))
    if on_cuda:
        torch.cuda.set_sync_debug_mode("default")
    return {**sync_report(counter.sites, logged, warmup, total - 1), "precision": precision,
            "batch_size": batch, "log_every_n_steps": log_every, "accelerator": accelerator,
            "counted_by": "CUDA sync debug" if on_cuda else "the CPU stand-ins (tests/gpucheck/standin.py)"}


def decode_gpu(out: Path, steps: int, batch: int, accelerator: str, arch: str, image_size: int,
               precision: str) -> dict[str, Any]:
    import os
    import shutil
    import subprocess
    import sys

    from ddp_recipes.bench.jpeg_folder import write_image_folder
    from ddp_recipes.config.world import default_num_workers

    work = out.parent
    # One validation batch: the sanity check and the recipe's test pass each decode it once.
    folder = write_image_folder(work / "jpegs", train=(steps + 1) * batch, val=max(batch, 4), classes=4)
    runs: dict[str, Any] = {}
    for decode in ("cpu", "gpu"):
        cmd = [sys.executable, "-m", "recipes.resnet", "--accelerator", accelerator, "--devices", "1",
               "--data", "imagefolder", "--data-dir", os.fspath(folder), "--arch", arch, "--image-size",
               str(image_size), "--precision", precision, "--channels-last", "--batch-size", str(batch),
               "--max-steps", str(steps), "--decode", decode, "--seed", "0", "--output-dir",
               os.fspath(work / f"decode-{decode}")]
        shutil.rmtree(work / f"decode-{decode}", ignore_errors=True)  # this check's own output of an earlier run
        print("+", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
        summary = json.loads((work / f"decode-{decode}" / "summary.json").read_text())
        runs[decode] = {"images_per_s": summary.get("train_samples_per_sec"),
                        "input_wait_fraction": summary.get("input_wait_fraction"),
                        "num_workers": summary["config"].get("num_workers") or default_num_workers(),
                        "steps": summary.get("steps"),
                        "decode": summary.get("decode")}
        # After each run: a check cut during the second still shows the first's figures.
        out.write_text(json.dumps({**runs, "batch_size": batch, "arch": arch, "image_size": image_size,
                                   "precision": precision, "train_images": (steps + 1) * batch}, indent=2) + "\n")
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tests.gpucheck.worker")
    p.add_argument("check", choices=["sync-debug", "decode-gpu"])
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=None, help="default: 12 (sync-debug: batches 5-16, log steps 9 "
                   "and 14 among them), 16 (decode-gpu)")
    p.add_argument("--warmup-steps", type=int, default=3, help="sync-debug: at least to the first log step's end")
    p.add_argument("--batch-size", type=int, default=None, help="default: 32 (sync-debug), 128 (decode-gpu)")
    # The CPU tests run the same commands small, on the CPU (sync-debug: counted by the stand-ins).
    p.add_argument("--accelerator", default="cuda")
    p.add_argument("--arch", default="resnet50")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--precision", default="bf16-mixed")
    args = p.parse_args(argv)
    if args.check == "sync-debug":
        result = sync_debug(args.steps or 12, args.warmup_steps, args.batch_size or 32, Path(args.out),
                            accelerator=args.accelerator, arch=args.arch, image_size=args.image_size,
                            precision=args.precision)
    else:
        result = decode_gpu(Path(args.out), args.steps or 16, args.batch_size or 128, args.accelerator, args.arch,
                            args.image_size, args.precision)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
