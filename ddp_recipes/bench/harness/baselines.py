"""The loops the pack is measured against, each as the write-up writes it: ``raw`` (plain PyTorch DDP),
``writeup`` (its MNIST script as published) and ``dp`` (``torch.nn.DataParallel``); started by
``python -m ddp_recipes.bench.harness.worker`` (:mod:`ddp_recipes.bench.harness.worker`)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from ddp_recipes.bench.harness.measure import (
    StepEnds,
    gather,
    measure_allreduce,
    peak_memory_mb,
    step_stats,
)
from ddp_recipes.bench.harness.workload import (
    Workload,
    build_dataset,
    build_module,
    data_facts,
    module_optimizer,
    write_json,
)
from ddp_recipes.data.samplers import keep_batch
from ddp_recipes.train.perf import configure_tf32


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


def _raw_rank(local_rank: int, w: Workload, out: str, counting: Callable[[], Any] | None = None) -> None:
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
    module = build_module(w)
    model = module.model.to(device)  # the same Parameter objects: the module's optimizer groups stay valid
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
    optimizer = module_optimizer(module)
    autocast, scaler = mixed_precision(w.precision, device)
    if distributed:
        sampler.set_epoch(0)
    timer = StepEnds(device, w.warmup_steps, w.total_steps)
    ends, start = timer.ends, timer.start
    counted = counting() if counting else None  # the clone's count of the iterations after the timed steps
    with counted or contextlib.nullcontext():
        for step, (x, y) in enumerate(loader):
            if step >= w.run_steps:
                break
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            if counted:  # from the batch on the device to the next one; it logs nothing, so has no log step
                counted.mark(step, step=step + 1, logs=False)
            if w.channels_last:
                x = x.contiguous(memory_format=torch.channels_last)  # the module's weights are NHWC already
            with autocast:
                loss = nn.functional.cross_entropy(wrapped(x), y)
            optimizer.zero_grad(set_to_none=True)
            backward_and_step(loss, optimizer, scaler)
            timer.step_end()
    counts = gather(counted.per_step() if counted else None)
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    allreduce = measure_allreduce(numel, device, w.allreduce_iters) if distributed else None
    peaks = gather(round(peak_memory_mb(device), 1))
    threads = gather(timer.threads)
    if local_rank == 0:
        write_json(out, {"impl": "raw" + ("-compiled" if w.compile else ""), "devices": w.devices,
                     "workload": asdict(w), "params": numel, "first_step_s": ends[0] - start if ends else None,
                     "grad_bytes": numel * 4, "torch_threads": torch.get_num_threads(),
                     "peak_mem_mb_per_rank": peaks, "allreduce": allreduce, "threads_per_rank": threads,
                     "step_counts_per_rank": counts if counted else None,
                     "cudnn_benchmark": torch.backends.cudnn.benchmark, **data_facts(data),
                     **step_stats(ends, w.warmup_steps, w.batch_size * w.devices)})
    if distributed:
        dist.destroy_process_group()


def run_raw(w: Workload, out: str, counting: Callable[[], Any] | None = None) -> None:
    """The raw loop at ``w.devices`` ranks; ``counting`` (picklable) makes each rank's iteration counter."""
    if w.devices == 1:
        _raw_rank(0, w, out, counting)
        return
    import torch.multiprocessing as mp

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    mp.start_processes(_raw_rank, args=(w, out, counting), nprocs=w.devices, start_method="spawn")


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
    timer = StepEnds(torch.device("cpu"), w.warmup_steps, w.total_steps)
    ends, epoch = timer.ends, 0
    while len(ends) < w.total_steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            timer.step_end()
            if len(ends) >= w.total_steps:
                break
        epoch += 1
    peaks = gather(round(peak_memory_mb(torch.device("cpu")), 1))
    if rank == 0:
        write_json(out, {"impl": "writeup", "devices": w.devices, "workload": asdict(w),
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
    module = build_module(w)
    net: nn.Module = module.model.to(device)
    probe = DtypeProbe(net)
    dtype = autocast_dtype(w.precision, device)
    if dtype is not None:
        net = AutocastForward(net, device.type, dtype)  # each replica's thread enters the run's dtype
    model = parallel(net, **parallel_kw)
    data = build_dataset(w)
    loader = DataLoader(data, batch_size=w.batch_size * w.devices, shuffle=True, collate_fn=keep_batch)
    optimizer = module_optimizer(module)
    autocast, scaler = mixed_precision(w.precision, device)
    timer = StepEnds(device, w.warmup_steps, w.total_steps)
    ends = timer.ends
    for step, (x, y) in enumerate(loader):
        if step >= w.total_steps:
            break
        with autocast:  # this thread's autocast covers the loss; the replicas enter their own
            loss = nn.functional.cross_entropy(model(x.to(device)), y.to(device))
        optimizer.zero_grad(set_to_none=True)
        backward_and_step(loss, optimizer, scaler)
        probe.close()
        timer.step_end()
    peaks = [round(torch.cuda.max_memory_allocated(i) / 2**20, 1) for i in range(w.devices)] \
        if device.type == "cuda" else [round(peak_memory_mb(device), 1)]
    write_json(out, {"impl": "dp", "devices": w.devices, "workload": asdict(w), "peak_mem_mb_per_rank": peaks,
                 "autocast_dtype": probe.observed(dtype) if dtype is not None else None,
                 "cudnn_benchmark": torch.backends.cudnn.benchmark, **data_facts(data),
                 **step_stats(ends, w.warmup_steps, w.batch_size * w.devices)})


def run_dp(w: Workload, out: str) -> None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < w.devices:
        raise SystemExit(f"--dp needs {w.devices} CUDA GPUs")
    configure_tf32(True, "cuda")
    torch.backends.cudnn.benchmark = True  # as the pack and the raw loop
    dp_loop(w, torch.device("cuda", 0), out, device_ids=list(range(w.devices)))
