"""The measured runs, each in fresh processes: ``python -m ddp_recipes.bench.workers {pack,plain,raw,dp} ...``.

* ``pack``: the library's path: the recipe's LightningModule and Trainer (``make_trainer``: TunedDDPStrategy
  at N > 1, every callback a recipe run has), Lightning launching the ranks; ``--without`` switches parts
  off (:mod:`ddp_recipes.bench.components`).
* ``plain``: plain Lightning, ``L.Trainer(strategy="ddp")``, on the same LightningModule and data.
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
    StepEnds,
    gather,
    measure_allreduce,
    peak_memory_mb,
    step_stats,
    sync_point,
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
    without: str = ""  # pack: parts switched off, comma list of bench.components.PACK_COMPONENTS
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


def module_optimizer(module: Any) -> torch.optim.Optimizer:
    """The optimizer the pack's ``configure_optimizers`` builds (its parameter groups: weight decay on weights
    only, none on norms and biases; its SGD settings), without the LR schedule: the raw and dp loops then do
    the same arithmetic per step as the pack, so the ratio measures the framework, not the optimizer."""
    return module.build_optimizer(module.param_groups())


def data_facts(data: object) -> dict[str, Any]:
    """What a run's JSON says about its synthetic data: samples and MB on this rank, and where they live."""
    if not isinstance(data, RankShard) or data.tensors is None:
        return {}
    return {"synthetic_samples_global": len(data), "synthetic_samples_per_rank": len(data.tensors[0]),
            "synthetic_mb_per_rank": round(data.nbytes() / 2**20, 1),
            "synthetic_data_on": str(data.tensors[0].device)}


def _write(path: str, payload: dict) -> None:
    Path(path).write_text(json.dumps(payload, indent=2) + "\n")


# ---- pack and plain: Lightning -------------------------------------------------------------------------


def run_pack(w: Workload, out: str) -> None:
    """The recipe's Trainer (make_trainer) with the parts ``w.without`` names switched off."""
    from ddp_recipes.bench.components import (
        LOG_EVERY_N_STEPS,
        finish,
        parse_without,
        scratch_dir,
        step_timer,
        switch_off,
    )
    from ddp_recipes.config.run_config import RunConfig
    from ddp_recipes.train.callbacks import ThroughputMeter
    from ddp_recipes.train.run import make_trainer

    without = parse_without(w.without)
    scratch = scratch_dir(out)
    cfg = RunConfig(devices=w.devices, accelerator=w.accelerator, precision=w.precision, max_steps=w.total_steps,
                    batch_size=w.batch_size, seed=w.seed, output_dir=str(scratch), num_workers=0,
                    log_every_n_steps=LOG_EVERY_N_STEPS, diagnostics=True)
    timer = step_timer(w)
    # No FLOP count in the meter: it runs once at the first live report, inside the timed window (the
    # recipes count at that moment too; here it would be one step's outlier, not a per-step cost).
    trainer = make_trainer(cfg, callbacks=[ThroughputMeter(), timer],
                           benchmark=True,  # cudnn.benchmark on, as the raw and dp loops set it
                           enable_model_summary=False, num_sanity_val_steps=0)
    switch_off(trainer, without)
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
    name = "pack" + (f"-without-{'+'.join(without)}" if without else "") + ("-compiled" if w.compile else "")
    finish(w, out, name, trainer, timer, data_facts(data))


def run_plain(w: Workload, out: str) -> None:
    """Plain Lightning: L.Trainer(strategy="ddp"), logging and drawing at the pack's cadence."""
    import lightning as L
    from lightning.pytorch.callbacks import TQDMProgressBar
    from lightning.pytorch.loggers import CSVLogger

    from ddp_recipes.bench.components import (
        LOG_EVERY_N_STEPS,
        PROGRESS_REFRESH,
        finish,
        scratch_dir,
        step_timer,
    )

    L.seed_everything(w.seed, verbose=False)
    timer = step_timer(w)
    trainer = L.Trainer(accelerator="gpu" if w.accelerator == "cuda" else "cpu", devices=w.devices,
                        strategy="ddp" if w.devices > 1 else "auto", precision=w.precision,
                        max_steps=w.total_steps, benchmark=True, default_root_dir=scratch_dir(out),
                        logger=CSVLogger(scratch_dir(out), name="logs"), log_every_n_steps=LOG_EVERY_N_STEPS,
                        callbacks=[TQDMProgressBar(refresh_rate=PROGRESS_REFRESH), timer],
                        enable_checkpointing=False, enable_model_summary=False, num_sanity_val_steps=0)
    module = build_module(w)
    if w.compile:
        module = torch.compile(module)
    data = build_dataset(w)
    trainer.fit(module, DataLoader(data, batch_size=w.batch_size, shuffle=True, collate_fn=keep_batch))
    finish(w, out, "plain" + ("-compiled" if w.compile else ""), trainer, timer, data_facts(data))


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
        timer.step_end()
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    allreduce = measure_allreduce(numel, device, w.allreduce_iters) if distributed else None
    peaks = gather(round(peak_memory_mb(device), 1))
    threads = gather(timer.threads)
    if local_rank == 0:
        _write(out, {"impl": "raw" + ("-compiled" if w.compile else ""), "devices": w.devices,
                     "workload": asdict(w), "params": numel, "first_step_s": ends[0] - start if ends else None,
                     "grad_bytes": numel * 4, "torch_threads": torch.get_num_threads(),
                     "peak_mem_mb_per_rank": peaks, "allreduce": allreduce, "threads_per_rank": threads,
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
    parser.add_argument("impl", choices=["pack", "plain", "raw", "dp", "writeup", "pack-compiled", "plain-compiled",
                                         "raw-compiled"])
    parser.add_argument("--out", required=True)
    for name, value in asdict(Workload()).items():
        parser.add_argument("--" + name.replace("_", "-"), dest=name, type=type(value), default=value)
    args = vars(parser.parse_args(argv))
    impl, out = args.pop("impl"), args.pop("out")
    if impl.endswith("-compiled"):
        impl, args["compile"] = impl.removesuffix("-compiled"), 1
    w = Workload(**args)
    {"pack": run_pack, "plain": run_plain, "raw": run_raw, "dp": run_dp, "writeup": run_writeup}[impl](w, out)


if __name__ == "__main__":
    main(sys.argv[1:])
