"""Scenarios the DDP tests run in fresh processes: ``python tests/scenarios/ddp_scenarios.py NAME OUT [options]``.

Lightning's launcher re-runs this same command line for every extra rank (or torchrun starts each one),
so each scenario is a plain script; every rank writes ``OUT/rank<r>.pt`` with its final weights and
what the scenario recorded, and the tests compare those files.
"""

from __future__ import annotations

import argparse
import atexit
import os
import random
import sys
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from ddp_recipes import TunedDDPStrategy, build_trainer  # noqa: E402
from tests.tiny_modules import TinyNet  # noqa: E402

N_SAMPLES, N_FEATURES, N_CLASSES = 64, 16, 4


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(N_SAMPLES, N_FEATURES, generator=g)
    y = (x[:, :N_CLASSES].argmax(1) + (x[:, 4] > 1).long()) % N_CLASSES
    return TensorDataset(x, y, torch.arange(N_SAMPLES))


class Net(TinyNet):
    """The suite's tiny net recording what the DDP tests compare: initial weights, draws, losses, samples."""

    def __init__(self, batchnorm: bool = False, aux_head: bool = False) -> None:
        super().__init__(N_FEATURES, N_CLASSES, 32, batchnorm=batchnorm, activation="tanh", aux_head=aux_head,
                         momentum=0.9)
        self.record: dict = {"losses": []}

    def setup(self, stage: str) -> None:
        # Runs after the process group is up and before DDP's broadcast: every rank's RNG is the same here.
        self.record["initial"] = {k: v.detach().clone() for k, v in self.state_dict().items()}
        self.record["setup_draws"] = (random.random(), float(np.random.rand()), torch.rand(3).tolist())

    def training_step(self, batch, batch_idx):
        if "draws" not in self.record:  # training: per-rank streams (seed + rank)
            self.record["draws"] = (random.random(), float(np.random.rand()), torch.rand(3).tolist())
        loss = super().training_step(batch, batch_idx)
        self.record["losses"].append(loss.item())
        self.record.setdefault("indices", []).append(batch[2].tolist())
        return loss

    def on_train_end(self) -> None:
        ddp = self.trainer.strategy.model
        if hasattr(ddp, "_get_ddp_logging_data"):
            self.record["comm_hook"] = ddp._get_ddp_logging_data().get("comm_hook")
        self.record["precision"] = self.trainer.precision
        self.record["world_size"] = self.trainer.world_size


class UserStrategy(TunedDDPStrategy):
    """A user's own subclass, defined in the script Lightning launches: must pickle into spawned ranks."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.marker = "user"


def counting_allreduce_hook(state: dict, bucket):
    """Plain averaging all-reduce that counts its calls, to prove accumulation skips communication."""
    state["calls"] += 1
    tensor = bucket.buffer().div_(torch.distributed.get_world_size())
    return torch.distributed.all_reduce(tensor, async_op=True).get_future().then(lambda fut: fut.value()[0])


_RANK: dict = {}


def record_group_at_exit(out: Path) -> None:
    if "rank" not in _RANK:
        return  # fit never reached the process group
    rank = _RANK["rank"]
    out.mkdir(parents=True, exist_ok=True)
    alive = torch.distributed.is_available() and torch.distributed.is_initialized()
    (out / f"exit{rank}.txt").write_text("alive" if alive else "destroyed")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("scenario", choices=["train", "unused", "uneven"])
    p.add_argument("out")
    p.add_argument("--devices", type=int, default=None)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--batchnorm", action="store_true")
    p.add_argument("--sync-batchnorm", action="store_true")
    p.add_argument("--find-unused-parameters", action="store_true")
    p.add_argument("--comm-hook", default="none")
    p.add_argument("--count-allreduce", action="store_true")
    p.add_argument("--precision", default="32-true")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--start-method", default=None, help="Lightning's launcher: spawn or fork (default: subprocess)")
    p.add_argument("--subclass", action="store_true", help="a user's subclass of TunedDDPStrategy")
    p.add_argument("--accelerator", default="cpu", help="cpu (gloo) or gpu (NCCL; the GPU tier)")
    p.add_argument("--no-tf32", action="store_true", help="full FP32 on GPUs, for exact comparisons")
    args = p.parse_args()
    # Registered first, so it runs last (atexit is LIFO): whether the process group outlived every other
    # exit handler, i.e. would have been left to interpreter finalization.
    atexit.register(record_group_at_exit, Path(args.out))

    calls = {"calls": 0}
    strategy_kwargs = {"powersgd_start_iter": 2} if args.comm_hook == "powersgd" else {}
    if args.count_allreduce:
        strategy_kwargs.update(ddp_comm_state=calls, ddp_comm_hook=counting_allreduce_hook)
    if args.start_method:
        strategy_kwargs["start_method"] = args.start_method
    extra = {}
    if args.subclass:
        extra["strategy"] = UserStrategy(seed=args.seed, **strategy_kwargs)
    if args.scenario == "uneven":
        extra["use_distributed_sampler"] = False  # the user shards by hand, unevenly
    trainer = build_trainer(
        devices=args.devices, accelerator=args.accelerator, precision=args.precision, seed=args.seed,
        tf32=not args.no_tf32,
        sync_batchnorm=args.sync_batchnorm, find_unused_parameters=args.find_unused_parameters,
        comm_hook=args.comm_hook, accumulate_grad_batches=args.accumulate, max_steps=args.steps,
        strategy_kwargs=strategy_kwargs, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, **extra,
    )
    model = Net(batchnorm=args.batchnorm, aux_head=args.scenario == "unused")
    data = dataset()
    if trainer.world_size == 1:
        # The sampler Lightning inserts under DDP, at world size 1: the same permutation (seeded from
        # PL_GLOBAL_SEED, reshuffled per epoch), so W ranks at batch B see exactly the samples of this
        # process at batch W*B, step for step.
        sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=args.seed)
        loader = DataLoader(data, batch_size=args.batch, sampler=sampler)
    elif args.scenario == "uneven":
        # Rank 0 keeps all 64 samples (8 batches), rank 1 drops 8 (7 batches): DDP's classic hang.
        rank = trainer.global_rank
        loader = DataLoader(torch.utils.data.Subset(data, range(N_SAMPLES - 8 * rank)), batch_size=args.batch)
    else:
        loader = DataLoader(data, batch_size=args.batch, shuffle=True)
    trainer.fit(model, loader)
    _RANK["rank"] = trainer.global_rank
    if trainer.global_rank != 0 and args.start_method:
        return  # spawn/fork: the workers' results come back to the main process (rank 0) through Lightning
    model.record["calls"] = calls["calls"]
    model.record["global_step"] = trainer.global_step
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    torch.save({"state": state, "record": model.record, "env_rank": os.environ.get("RANK")},
               out / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main()
