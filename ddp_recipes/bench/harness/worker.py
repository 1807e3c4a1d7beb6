"""The measured runs, each in fresh processes: ``python -m ddp_recipes.bench.harness.worker {pack,plain,raw,dp} ...``.

* ``pack``: the library's path: the recipe's LightningModule and Trainer (``make_trainer``: TunedDDPStrategy
  at N > 1, every callback a recipe run has), Lightning launching the ranks.
* ``plain``: plain Lightning, ``L.Trainer(strategy="ddp")``, on the same LightningModule and data.
* ``raw``: the write-up's plain PyTorch DDP loop (init_process_group, DDP wrap, DistributedSampler, the
  same loop) on the same network, synthetic data, batch, precision and thread budget.
* ``dp``: torch.nn.DataParallel over N GPUs in one process (the write-up's DP-vs-DDP comparison).
* ``writeup``: the write-up's MNIST script as published (per-sample PIL transforms, 4 loader workers).

Every path times a step the same way (``ddp_recipes.bench.harness.measure``: barrier + cuda.synchronize at the end
of every step, wall time between consecutive step ends, warm-up steps dropped). Rank 0 writes one JSON
file (``--out``). The clone's ``benchmarks/account/worker.py`` runs these with its counter and switches.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch
from torch.utils.data import DataLoader

from ddp_recipes.bench.harness.baselines import run_dp, run_raw, run_writeup
from ddp_recipes.bench.harness.workload import Workload, build_dataset, build_module, build_val_dataset, data_facts
from ddp_recipes.data.samplers import keep_batch


def run_pack(w: Workload, out: str, counter: Any = None, switch: Callable[[Any], None] | None = None,
             name: str = "pack") -> None:
    """The recipe's Trainer (make_trainer); ``counter``: a callback counting after the timed steps, ``switch``:
    takes parts out of the built Trainer."""
    from ddp_recipes.bench.harness.components import LOG_EVERY_N_STEPS, finish, scratch_dir, step_timer
    from ddp_recipes.config.run_config import RunConfig
    from ddp_recipes.train.callbacks import ThroughputMeter
    from ddp_recipes.train.run import make_trainer

    scratch = scratch_dir(out)
    cfg = RunConfig(devices=w.devices, accelerator=w.accelerator, precision=w.precision, max_steps=w.run_steps,
                    batch_size=w.batch_size, seed=w.seed, output_dir=str(scratch), num_workers=0,
                    log_every_n_steps=LOG_EVERY_N_STEPS, diagnostics=True)
    timer = step_timer(w, counter)
    # No FLOP count in the meter: it runs once at the first live report, inside the timed window (the
    # recipes count at that moment too; here it would be one step's outlier, not a per-step cost).
    trainer = make_trainer(cfg, callbacks=[ThroughputMeter(), timer, *([counter] if counter else [])],
                           benchmark=True,  # cudnn.benchmark on, as the raw and dp loops set it
                           enable_model_summary=False, num_sanity_val_steps=0)
    if switch is not None:
        switch(trainer)
    module = build_module(w)
    if w.compile:
        module = torch.compile(module)  # what --compile does: Lightning compiles forward and the step methods
    data = None
    if w.recipe == "mnist" and w.data_dir:
        from ddp_recipes.data.mnist import MNISTDataModule

        # The recipe's own data path (recipes.mnist): in-memory tensors, resumable sampler.
        trainer.fit(module, datamodule=MNISTDataModule(w.data_dir, batch_size=w.batch_size, seed=w.seed,
                                                       val_size=w.val_size, download=False))
    else:
        data = build_dataset(w)
        trainer.fit(module, DataLoader(data, batch_size=w.batch_size, shuffle=True, collate_fn=keep_batch))
    finish(w, out, name + ("-compiled" if w.compile else ""), trainer, timer, data_facts(data), counter)


def run_plain(w: Workload, out: str, counter: Any = None) -> None:
    """Plain Lightning: L.Trainer(strategy="ddp"), logging and drawing at the pack's cadence."""
    import lightning as L
    from lightning.pytorch.callbacks import TQDMProgressBar
    from lightning.pytorch.loggers import CSVLogger

    from ddp_recipes.bench.harness.components import (
        LOG_EVERY_N_STEPS,
        PROGRESS_REFRESH,
        finish,
        scratch_dir,
        step_timer,
    )

    L.seed_everything(w.seed, verbose=False)
    timer = step_timer(w, counter)
    trainer = L.Trainer(accelerator="gpu" if w.accelerator == "cuda" else "cpu", devices=w.devices,
                        strategy="ddp" if w.devices > 1 else "auto", precision=w.precision,
                        max_steps=w.run_steps, benchmark=True, default_root_dir=scratch_dir(out),
                        logger=CSVLogger(scratch_dir(out), name="logs"), log_every_n_steps=LOG_EVERY_N_STEPS,
                        callbacks=[TQDMProgressBar(refresh_rate=PROGRESS_REFRESH), timer,
                                   *([counter] if counter else [])],
                        enable_checkpointing=False, enable_model_summary=False, num_sanity_val_steps=0)
    module = build_module(w)
    if w.compile:
        module = torch.compile(module)
    data, val = build_dataset(w), build_val_dataset(w)
    trainer.fit(module, DataLoader(data, batch_size=w.batch_size, shuffle=True, collate_fn=keep_batch),
                None if val is None else DataLoader(val, batch_size=w.batch_size, collate_fn=keep_batch))
    finish(w, out, "plain" + ("-compiled" if w.compile else ""), trainer, timer, data_facts(data), counter)


def parse(argv: list[str] | None) -> tuple[str, str, Workload]:
    """The run's implementation, its JSON path and its :class:`Workload`, from the command line."""
    parser = argparse.ArgumentParser(prog="python -m ddp_recipes.bench.harness.worker")
    parser.add_argument("impl", choices=["pack", "plain", "raw", "dp", "writeup", "pack-compiled", "plain-compiled",
                                         "raw-compiled"])
    parser.add_argument("--out", required=True)
    for name, value in asdict(Workload()).items():
        parser.add_argument("--" + name.replace("_", "-"), dest=name, type=type(value), default=value)
    args = vars(parser.parse_args(argv))
    impl, out = args.pop("impl"), args.pop("out")
    if impl.endswith("-compiled"):
        impl, args["compile"] = impl.removesuffix("-compiled"), 1
    return impl, out, Workload(**args)


def main(argv: list[str] | None = None) -> None:
    impl, out, w = parse(argv)
    {"pack": run_pack, "plain": run_plain, "raw": run_raw, "dp": run_dp, "writeup": run_writeup}[impl](w, out)


if __name__ == "__main__":
    main(sys.argv[1:])
