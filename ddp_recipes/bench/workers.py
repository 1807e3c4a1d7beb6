"""The measured runs, each in fresh processes: ``python -m ddp_recipes.bench.workers {pack,raw,dp} ...``.

* ``pack``: the library's path: the recipe's LightningModule, ``build_trainer`` (TunedDDPStrategy at N > 1),
  Lightning launching the ranks.
* ``raw``: the write-up's plain PyTorch DDP loop (init_process_group, DDP wrap, DistributedSampler, the
  same loop) on the same network, synthetic data, batch, precision and thread budget.
* ``dp``: torch.nn.DataParallel over N GPUs in one process (the write-up's DP-vs-DDP comparison).
* ``writeup``: the write-up's MNIST script as published (per-sample PIL transforms, 4 loader workers).

Every path times a step the same way (``ddp_recipes.bench.measure``: barrier + cuda.synchronize at the end
of every step, wall time between consecutive step ends, warm-up steps dropped). Rank 0 writes one JSON
file (``--out``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ddp_recipes.bench.measure import (
    gather,
    measure_allreduce,
    peak_memory_mb,
    step_stats,
    sync_point,
    timed_diagnostics,
    wait_fraction,
)
from ddp_recipes.bench.synthetic import RankShard
from ddp_recipes.data.samplers import TensorBatchDataset, keep_batch
from ddp_recipes.train.perf import configure_tf32


@dataclass
class Workload:
    """What one measured run trains: the same for pack, raw and dp."""

    recipe: str = "resnet"
    arch: str = "resnet18"
    image_size: int = 32
    batch_size: int = 32
    steps: int = 20
    warmup_steps: int = 5
    precision: str = "32-true"
    accelerator: str = "cpu"
    devices: int = 1
    threads: int = 0  # torch threads per rank on CPU (0: leave torch's default)
    seed: int = 0
    allreduce_iters: int = 5
    data_dir: str = ""  # mnist: real MNIST (torchvision layout) instead of synthetic tensors
    diagnostics: int = 1  # pack: keep build_trainer's DDPDiagnostics on (0 to measure its cost)
    compile: int = 0  # torch.compile the model (pack: as --compile does; raw: the DDP-wrapped module)
    channels_last: int = 0  # resnet: NHWC weights and inputs (tensor-core convolutions under AMP)

    @property
    def total_steps(self) -> int:
        return self.warmup_steps + self.steps


def build_module(w: Workload):
    """The recipe's LightningModule for this workload (its ``.model`` is the plain network)."""
    if w.recipe == "mnist":
        from ddp_recipes.modules.mnist import MNISTClassifier

        return MNISTClassifier(arch=w.arch)
    from ddp_recipes.modules.resnet import ResNetClassifier

    return ResNetClassifier(arch=w.arch, num_classes=10, cifar_stem=w.image_size < 64, lr=0.1,  # as the recipe
                            channels_last=bool(w.channels_last))


def build_dataset(w: Workload) -> TensorDataset | RankShard:
    """Fixed-seed synthetic samples, enough for every rank to run all steps inside one epoch, of which each
    rank holds only its own share, on its device (:class:`~ddp_recipes.bench.synthetic.RankShard`); with
    ``data_dir`` (mnist) the real images, normalised in memory exactly as the recipe's DataModule does."""
    if w.recipe == "mnist" and w.data_dir:
        from ddp_recipes.data.mnist import load_split

        return TensorBatchDataset(*load_split(w.data_dir, train=True))
    shape = (1, 28, 28) if w.recipe == "mnist" else (3, w.image_size, w.image_size)
    return RankShard((w.total_steps + 1) * w.batch_size * w.devices, shape, w.seed, device=w.accelerator)


def data_facts(data: object) -> dict[str, Any]:
    """What a run's JSON says about its synthetic data: samples and MB on this rank, and where they live."""
    if not isinstance(data, RankShard) or data.tensors is None:
        return {}
    return {"synthetic_samples_global": len(data), "synthetic_samples_per_rank": len(data.tensors[0]),
            "synthetic_mb_per_rank": round(data.nbytes() / 2**20, 1),
            "synthetic_data_on": str(data.tensors[0].device)}


def _write(path: str, payload: dict) -> None:
    Path(path).write_text(json.dumps(payload, indent=2) + "\n")


# ---- pack: the library's path ---------------------------------------------------------------------------


def run_pack(w: Workload, out: str) -> None:
    from lightning.pytorch.callbacks import Callback

    from ddp_recipes.train.perf import input_wait
    from ddp_recipes.train.trainer import build_trainer

    class StepTimer(Callback):
        def __init__(self) -> None:
            self.ends: list[float] = []
            self.start = 0.0

        def on_train_start(self, trainer, pl_module) -> None:
            self.start = sync_point(trainer.strategy.root_device)

            self.waits: list[float] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.ends.append(sync_point(trainer.strategy.root_device))
            self.waits.append(input_wait(trainer) or 0.0)

    timer = StepTimer()
    diagnostics = timed_diagnostics() if w.diagnostics else None
    trainer = build_trainer(devices=w.devices, accelerator=w.accelerator, precision=w.precision, seed=w.seed,
                            diagnostics=bool(w.diagnostics),
                            benchmark=True,  # cudnn.benchmark on, as the raw and dp loops set it
                            max_steps=w.total_steps, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                            callbacks=[timer, *([diagnostics] if diagnostics else [])])
    module = build_module(w)
    if w.compile:
        module = torch.compile(module)  # what --compile does: Lightning compiles forward and the step methods
    data = None
    if w.recipe == "mnist" and w.data_dir:
        from ddp_recipes.data.mnist import MNISTDataModule

        # The recipe's own data path (recipes.mnist): in-memory tensors, resumable sampler.
        trainer.fit(module, datamodule=MNISTDataModule(w.data_dir, batch_size=w.batch_size, seed=w.seed,
                                                       download=False))
    else:
        data = build_dataset(w)
        trainer.fit(module, DataLoader(data, batch_size=w.batch_size, shuffle=True, collate_fn=keep_batch))
    device = trainer.strategy.root_device
    peaks = trainer.strategy.all_gather(torch.tensor(peak_memory_mb(device), device=device))
    if trainer.is_global_zero:
        name = ("pack" if w.diagnostics else "pack-nodiag") + ("-compiled" if w.compile else "")
        _write(out, {"impl": name, "devices": w.devices, "workload": asdict(w),
                     "first_step_s": timer.ends[0] - timer.start if timer.ends else None,
                     "input_wait_fraction": wait_fraction(timer.ends, timer.waits, w.warmup_steps),
                     "precision_used": str(trainer.precision), "strategy": type(trainer.strategy).__name__,
                     "torch_threads": torch.get_num_threads(),
                     "peak_mem_mb_per_rank": [round(float(p), 1) for p in peaks.reshape(-1)],
                     "diagnostics_s": diagnostics.seconds if diagnostics else None,
                     "steps_run": len(timer.ends), "cudnn_benchmark": torch.backends.cudnn.benchmark,
                     **data_facts(data),
                     **step_stats(timer.ends, w.warmup_steps, w.batch_size * w.devices)})


# ---- raw: the write-up's loop, and DataParallel ---------------------------------------------------------


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype of Lightning's precision plugin for ``precision`` (None: no autocast): fp16 for
    16-mixed on CUDA, bf16 for bf16-mixed (and for 16-mixed on CPU, which the pack switches to bf16-mixed)."""
    if precision == "16-mixed" and device.type == "cuda":
        return torch.float16
    if precision in ("16-mixed", "bf16-mixed"):
        return torch.bfloat16
    return None


def mixed_precision(precision: str, device: torch.device) -> tuple[Any, Any]:
    """The autocast context and GradScaler (or None) of Lightning's precision plugin for ``precision``, so
    the baselines run the arithmetic the pack runs (fp16 autocast comes with a GradScaler)."""
    dtype = autocast_dtype(precision, device)
    if dtype is None:
        return contextlib.nullcontext(), None
    scaler = torch.amp.GradScaler("cuda") if dtype == torch.float16 and device.type == "cuda" else None
    return torch.autocast(device.type, dtype=dtype), scaler


class AutocastForward(nn.Module):
    """Runs ``module``'s forward under autocast with a fixed dtype, entered *inside* the forward.

    autocast's enabled flag and dtype are per thread. ``nn.DataParallel`` runs each replica's forward in a
    thread of its own, which sees none of the caller's ``with torch.autocast(...)``; a replica that enters
    autocast without a dtype gets the device default (fp16 on CUDA), so a bf16 run would silently train in
    fp16. Wrapped like this, every replica's thread enters the run's dtype itself.
    """

    def __init__(self, module: nn.Module, device_type: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.module, self.device_type, self.dtype = module, device_type, dtype

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast(self.device_type, dtype=self.dtype):
            return self.module(*args, **kwargs)


def backward_and_step(loss: torch.Tensor, optimizer: torch.optim.Optimizer, scaler: Any) -> None:
    if scaler is None:
        loss.backward()
        optimizer.step()
        return
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()


def _raw_rank(local_rank: int, w: Workload, out: str) -> None:
    if w.threads:
        torch.set_num_threads(w.threads)
    cuda = w.accelerator == "cuda"
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        configure_tf32(True, "cuda")  # the pack's default (build_trainer): the same arithmetic on both sides
    torch.backends.cudnn.benchmark = True  # as the pack's Trainer(benchmark=True): the same conv algorithms
    distributed = w.devices > 1
    if distributed:
        dist.init_process_group("nccl" if cuda else "gloo", rank=local_rank, world_size=w.devices)
    torch.manual_seed(w.seed)
    model = build_module(w).model.to(device)
    # One device: the single-GPU script the write-up starts from, no process group and no DDP wrap.
    wrapped = nn.parallel.DistributedDataParallel(model, device_ids=[local_rank] if cuda else None) \
        if distributed else model
    if w.compile:
        wrapped = torch.compile(wrapped)  # a compiled DDP module: DDPOptimizer splits at bucket boundaries
    data = build_dataset(w)
    sampler = torch.utils.data.distributed.DistributedSampler(data, shuffle=True, seed=w.seed) \
        if distributed else torch.utils.data.RandomSampler(data)
    # The same batched in-memory fetch as the pack: the ratio then measures framework overhead only.
    loader = DataLoader(data, batch_size=w.batch_size, sampler=sampler, collate_fn=keep_batch)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.01, momentum=0.9)
    autocast, scaler = mixed_precision(w.precision, device)
    if distributed:
        sampler.set_epoch(0)
    ends, start = [], sync_point(device)
    for step, (x, y) in enumerate(loader):
        if step >= w.total_steps:
            break
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        if w.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)  # the module's weights are NHWC already
        with autocast:
            loss = nn.functional.cross_entropy(wrapped(x), y)
        optimizer.zero_grad(set_to_none=True)
        backward_and_step(loss, optimizer, scaler)
        ends.append(sync_point(device))
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    allreduce = measure_allreduce(numel, device, w.allreduce_iters) if distributed else None
    peaks = gather(round(peak_memory_mb(device), 1))
    if local_rank == 0:
        _write(out, {"impl": "raw" + ("-compiled" if w.compile else ""), "devices": w.devices,
                     "workload": asdict(w), "params": numel, "first_step_s": ends[0] - start if ends else None,
                     "grad_bytes": numel * 4, "torch_threads": torch.get_num_threads(),
                     "peak_mem_mb_per_rank": peaks, "allreduce": allreduce,
                     "cudnn_benchmark": torch.backends.cudnn.benchmark, **data_facts(data),
                     **step_stats(ends, w.warmup_steps, w.batch_size * w.devices)})
    if distributed:
        dist.destroy_process_group()


def run_raw(w: Workload, out: str) -> None:
    if w.devices == 1:
        _raw_rank(0, w, out)
        return
    import torch.multiprocessing as mp

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    mp.start_processes(_raw_rank, args=(w, out), nprocs=w.devices, start_method="spawn")


def _writeup_rank(rank: int, w: Workload, out: str) -> None:
    """The write-up's MNIST script as published, on CPU: torchvision MNIST with per-sample
    ToTensor + Normalize, DataLoader(num_workers=4), DistributedSampler, DDP (even at 1 process)."""
    from torchvision import datasets, transforms

    if w.threads:
        torch.set_num_threads(w.threads)
    dist.init_process_group("gloo", rank=rank, world_size=w.devices)
    torch.manual_seed(w.seed)
    transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))])
    data = datasets.MNIST(w.data_dir, train=True, download=False, transform=transform)
    sampler = torch.utils.data.distributed.DistributedSampler(data, shuffle=True, seed=w.seed)
    loader = DataLoader(data, batch_size=w.batch_size, sampler=sampler, num_workers=4)
    model = nn.parallel.DistributedDataParallel(build_module(w).model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    ends: list[float] = []
    epoch = 0
    while len(ends) < w.total_steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            ends.append(sync_point(torch.device("cpu")))
            if len(ends) >= w.total_steps:
                break
        epoch += 1
    peaks = gather(round(peak_memory_mb(torch.device("cpu")), 1))
    if rank == 0:
        _write(out, {"impl": "writeup", "devices": w.devices, "workload": asdict(w),
                     "torch_threads": torch.get_num_threads(), "peak_mem_mb_per_rank": peaks,
                     **step_stats(ends, w.warmup_steps, w.batch_size * w.devices)})
    dist.destroy_process_group()


def run_writeup(w: Workload, out: str) -> None:
    if w.recipe != "mnist" or not w.data_dir:
        raise SystemExit("the write-up baseline is MNIST on real data: pass --recipe mnist --data-dir DIR")
    import torch.multiprocessing as mp

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    mp.start_processes(_writeup_rank, args=(w, out), nprocs=w.devices, start_method="spawn")


class DtypeProbe:
    """The dtypes the network's convolutions and linear layers really computed in, whatever thread ran them.

    A forward hook on each: DataParallel's replicas share their modules' hook dicts (``replicate`` copies
    ``__dict__``), so the hooks fire in every replica's thread too. What ``bench --dp`` reports is this
    observation, not the dtype it asked for. :meth:`close` removes the hooks (after the first step: the
    timed steps carry no hook).
    """

    def __init__(self, net: nn.Module) -> None:
        self.seen: set[torch.dtype] = set()
        self.handles = [module.register_forward_hook(lambda mod, inputs, out: self.seen.add(out.dtype))
                        for module in net.modules() if isinstance(module, (nn.Conv2d, nn.Linear))]

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def observed(self, expected: torch.dtype | None) -> str:
        """The one dtype seen; SystemExit when it is not ``expected`` (None: the run's float32)."""
        want = expected or torch.float32
        if self.seen != {want}:
            got = ", ".join(sorted(str(d).removeprefix("torch.") for d in self.seen)) or "nothing"
            raise SystemExit(f"bench --dp: the replicas computed in {got}, not {str(want).removeprefix('torch.')}: "
                             "autocast did not reach DataParallel's replica threads")
        return str(want).removeprefix("torch.")


def dp_loop(w: Workload, device: torch.device, out: str, parallel: Any = nn.DataParallel, **parallel_kw: Any) -> None:
    """The ``dp`` run on ``device``: ``parallel(net, **parallel_kw)`` (DataParallel over the GPUs) trained for
    the workload's steps; the JSON's ``autocast_dtype`` is what :class:`DtypeProbe` saw."""
    torch.manual_seed(w.seed)
    net: nn.Module = build_module(w).model.to(device)
    probe = DtypeProbe(net)
    dtype = autocast_dtype(w.precision, device)
    if dtype is not None:
        net = AutocastForward(net, device.type, dtype)  # each replica's thread enters the run's dtype
    model = parallel(net, **parallel_kw)
    data = build_dataset(w)
    loader = DataLoader(data, batch_size=w.batch_size * w.devices, shuffle=True, collate_fn=keep_batch)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    autocast, scaler = mixed_precision(w.precision, device)
    ends = []
    for step, (x, y) in enumerate(loader):
        if step >= w.total_steps:
            break
        with autocast:  # this thread's autocast covers the loss; the replicas enter their own
            loss = nn.functional.cross_entropy(model(x.to(device)), y.to(device))
        optimizer.zero_grad(set_to_none=True)
        backward_and_step(loss, optimizer, scaler)
        probe.close()
        ends.append(sync_point(device))
    peaks = [round(torch.cuda.max_memory_allocated(i) / 2**20, 1) for i in range(w.devices)] \
        if device.type == "cuda" else [round(peak_memory_mb(device), 1)]
    _write(out, {"impl": "dp", "devices": w.devices, "workload": asdict(w), "peak_mem_mb_per_rank": peaks,
                 "autocast_dtype": probe.observed(dtype) if dtype is not None else None,
                 "cudnn_benchmark": torch.backends.cudnn.benchmark, **data_facts(data),
                 **step_stats(ends, w.warmup_steps, w.batch_size * w.devices)})


def run_dp(w: Workload, out: str) -> None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < w.devices:
        raise SystemExit(f"--dp needs {w.devices} CUDA GPUs")
    configure_tf32(True, "cuda")
    torch.backends.cudnn.benchmark = True  # as the pack and the raw loop
    dp_loop(w, torch.device("cuda", 0), out, device_ids=list(range(w.devices)))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ddp_recipes.bench.workers")
    parser.add_argument("impl", choices=["pack", "raw", "dp", "writeup", "pack-compiled", "raw-compiled"])
    parser.add_argument("--out", required=True)
    for name, value in asdict(Workload()).items():
        parser.add_argument("--" + name.replace("_", "-"), dest=name, type=type(value), default=value)
    args = vars(parser.parse_args(argv))
    impl, out = args.pop("impl"), args.pop("out")
    if impl.endswith("-compiled"):
        impl, args["compile"] = impl.removesuffix("-compiled"), 1
    w = Workload(**args)
    {"pack": run_pack, "raw": run_raw, "dp": run_dp, "writeup": run_writeup}[impl](w, out)


if __name__ == "__main__":
    main(sys.argv[1:])
