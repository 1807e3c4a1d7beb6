"""DDPDiagnostics: the write-up's troubleshooting table as checks that run during real training.

Each row is detected from what the run does (batches, gradients, weights, losses, memory) and reported once, on
rank 0, as a ``DDPDiagnosticWarning`` starting ``"DDPDiagnostics: [code]"`` and ending with the fix
(:data:`FIXES`); the codes and their thresholds are docs/diagnostics-and-doctor.md's table. Cost: an all-gather of
8 numbers at the first batch and at each epoch end, on every rank in the same order; per step only a local loss
sum. One process skips the cross-rank checks. ``findings`` holds ``(code, message)`` on every rank; ``checked``
names the checks that ran.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from typing_extensions import override

from ddp_recipes.config.choices import LR_SCALING_RULES, check_choice
from ddp_recipes.ddp.syncbn import CPUSyncBatchNorm
from ddp_recipes.errors import _PARAM, flag
from ddp_recipes.train.diagnostic_rules import (
    batch_fingerprint,
    batch_size_of,
    describe_sampler,
    extremes,
    first_few,
    gather_rows,
    loss_diverged,
    memory_imbalance,
    name_ranks,
    parameter_checksum,
    params_drifted,
    sampler_sharding,
    sampler_shuffles,
    shuffle_coincidence_chance,
    train_sampler,
    unsharded_ranks,
)
from ddp_recipes.train.perf import input_wait

PREFIX = "DDPDiagnostics:"
SMALL_BN_BATCH = 16
# Below this chance that two honest shuffles start with the same batch, "same first batch" means "stale".
COINCIDENCE_LIMIT = 1e-6
# Input-bound: more than this share of the step spent waiting for data, over at least INPUT_MIN_STEPS steps
# after the first INPUT_WARMUP_STEPS of an epoch (workers starting, first prefetch).
INPUT_BOUND_FRACTION = 0.2
# ... and more than this many seconds per step: below it the loader costs less than a launch overhead, and a
# toy model's sub-millisecond step makes any fetch a large share (a 676-parameter MLP "input-bound" at 0.6 ms).
INPUT_MIN_WAIT_S = 0.002
INPUT_MIN_STEPS, INPUT_WARMUP_STEPS = 10, 5  # timed steps needed; intervals skipped at the start of the fit

# The troubleshooting table's fix for each finding, appended to its message. A setting is written {name}:
# a recipe run reads it as its flag (--name), a build_trainer run as LIBRARY_SPELLING says.
FIXES = {
    "unsharded-data": "let Lightning insert a DistributedSampler (Trainer(use_distributed_sampler=True), the "
                      "default) or build DistributedSampler(dataset) with its default num_replicas and rank.",
    "sampler-epoch": "call sampler.set_epoch(epoch) before each epoch (Lightning does, for samplers whose "
                     "set_epoch works) and do not iterate the DataLoader outside Lightning's fit loop.",
    "param-drift": "something changes weights outside DDP (an optimizer step or weight edit on some ranks "
                   "only, e.g. under `if rank == 0`, or models built differently per rank); every rank must "
                   "build the same model and step the same optimizer after DDP's all-reduce.",
    "loss-divergence": "check the data sharding (DistributedSampler), per-rank data differences (another "
                       "file, split or transform on some rank) and that every rank maps labels the same way.",
    "unused-params": "use them in the loss, freeze them (requires_grad=False) or remove them; keep "
                     "{find_unused_parameters} only if some steps use them (without it DDP fails next step).",
    "small-batch-bn": f"{{sync_batchnorm}} or a per-device batch >= {SMALL_BN_BATCH}.",
    "lr-not-scaled": "{lr_scaling} linear (SGD) or sqrt (adaptive optimizers), and/or {warmup_epochs} (e.g. 1-5).",
    "accum-remainder": "make batches per epoch a multiple of {accumulate_grad_batches} (another {batch_size} or "
                       "{global_batch_size}, or Trainer(limit_train_batches=<a multiple>)).",
    "input-bound": "in this order: more {num_workers} per rank (up to the CPU cores per device), "
                   "persistent_workers=True (workers kept across epochs), pin_memory=True on CUDA, then cheaper "
                   "decoding (images stored at training size, TorchCodec's decode_image on tensors, or GPU "
                   "decoding: the ResNet recipe's --decode gpu with --data imagefolder, elsewhere "
                   "torchcodec.decoders.decode_jpeg(device='cuda')); `python -m ddp_recipes.bench loader` "
                   "measures images/s per worker count; on one rank only: that node's disk, network mount or "
                   "CPU load.",
    "compute-bound": "a throttled or different device on that rank (nvidia-smi -q -d PERFORMANCE,CLOCK on its "
                     "node), or code that does more there (work under `if rank == 0`, per-rank logging or "
                     "evaluation inside the step).",
    "memory-imbalance": "side work (evaluation, logging, metrics) belongs under torch.no_grad(), on CPU, or on "
                        "all ranks, not on rank 0 only with autograd on the GPU.",
}
LIBRARY_SPELLING = {
    "find_unused_parameters": "find_unused_parameters=True", "sync_batchnorm": "build_trainer(sync_batchnorm=True)",
    "lr_scaling": "lr_scaling", "accumulate_grad_batches": "accumulate_grad_batches",
    "batch_size": "DataLoader batch_size", "global_batch_size": "global_batch",
    "num_workers": "DataLoader(num_workers=...)",
}
# Fixes that read otherwise for a build_trainer script (there lr_scaling only describes the module's LR).
LIBRARY_FIXES = {
    "lr-not-scaled": "scale the module's LR with the global batch, linearly (SGD) or by its square root (adaptive "
                     "optimizers), and/or warm it up over 1-5 epochs; build_trainer(lr_scaling=..., "
                     "warmup_epochs=...) tells these checks what the module does.",
}


def spell(text: str, library: bool) -> str:
    """``text`` with each ``{setting}`` as the recipe's flag, or (``library``) as a build_trainer script sets it."""
    return _PARAM.sub(lambda m: (LIBRARY_SPELLING.get(m.group(1), m.group(1)) if library else flag(m.group(1)))
                      if m.group(1) else m.group(0)[0], text)


class DDPDiagnosticWarning(UserWarning):
    """A DDP setup problem found while training; the message names the fix."""


# ---- pure decisions (unit-tested with made-up numbers) ------------------------------------------------


class DDPDiagnostics(Callback):
    """Finds the troubleshooting table's DDP mistakes in a running fit; see the module docstring.

    ``lr_scaling``, ``warmup_epochs``, ``reference_batch`` and ``global_batch`` are the run's LR facts
    (``--lr-scaling`` etc.); the lr-not-scaled check runs only when ``lr_scaling`` and ``reference_batch``
    are given (``global_batch`` defaults to per-device batch x world size x accumulation, ``warmup_epochs``
    to 0).
    """

    def __init__(self, *, lr_scaling: str | None = None, warmup_epochs: float | None = None,
                 reference_batch: int | None = None, global_batch: int | None = None, library: bool = False) -> None:
        if lr_scaling is not None:
            check_choice("lr_scaling", lr_scaling, LR_SCALING_RULES)
        self.lr_scaling, self.warmup_epochs = lr_scaling, warmup_epochs
        self.reference_batch, self.global_batch = reference_batch, global_batch
        self.library = library  # a build_trainer script: fixes name its arguments, not a recipe's flags
        self.findings: list[tuple[str, str]] = []
        self.checked: set[str] = set()
        self.on_train_start()

    @override
    def on_train_start(self, trainer: L.Trainer | None = None, pl_module: L.LightningModule | None = None) -> None:
        # Per-fit state; findings persist across fits (each is reported once per callback).
        self._started = False
        self._epoch_start: tuple[int, Tensor] | None = None  # (epoch, its first batch's fingerprint)
        self._previous_start: tuple[int, Tensor] | None = None  # the epoch before's, until compared
        self._stale_epoch = 0.0  # 1.0 when this epoch began like the previous one (gathered at epoch end)
        self._grads_checked: set[int] = set()
        self._loss_sum: Tensor | None = None
        self._loss_count = 0
        # The epoch's mean loss is compared across ranks: one process has nothing to compare it with.
        self._track_loss = trainer is None or trainer.world_size > 1
        self._wait = [0.0, 0.0, 0]  # steady seconds waiting, steady seconds in steps, steps timed (per fit)
        self._intervals = 0
        self._batch_end: float | None = None

    def report(self, code: str, problem: str) -> None:
        """Record a finding (the problem, then its fix) on this rank and warn on rank 0, once per code."""
        if any(c == code for c, _ in self.findings):
            return
        fix = LIBRARY_FIXES.get(code, FIXES[code]) if self.library else FIXES[code]
        message = spell(f"{problem} Fix: {fix}", self.library)
        self.findings.append((code, message))
        rank_zero_warn(f"{PREFIX} [{code}] {message}", category=DDPDiagnosticWarning)

    @override
    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._stale_epoch = 0.0
        self._loss_sum, self._loss_count = None, 0

    # ---- first batch of the fit: sharding, BatchNorm, LR facts; of each epoch: the sampler's order ----

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        fingerprint = None
        if not self._started:
            self._started = True
            fingerprint = batch_fingerprint(batch)
            if trainer.world_size > 1:
                self._check_sharding(trainer, fingerprint)
                self._check_batchnorm(trainer, pl_module, batch_size_of(batch))
            self._check_lr_facts(trainer, batch_size_of(batch))
            self._check_accumulation(trainer.accumulate_grad_batches, trainer.num_training_batches)
        if batch_idx == 0:
            self._check_epoch_order(trainer, batch, fingerprint)

    def _check_sharding(self, trainer: L.Trainer, fingerprint: Tensor) -> None:
        # Every rank reaches its first batch, so this gather is matched on all ranks.
        self.checked.add("unsharded-data")
        sampler, expected = train_sampler(trainer), trainer.distributed_sampler_kwargs
        flag = torch.tensor([sampler_sharding(sampler, expected)], dtype=torch.float64, device=fingerprint.device)
        wrong, same = unsharded_ranks(gather_rows(trainer, torch.cat([fingerprint, flag])))
        problems = [f"{name_ranks(ranks, trainer.world_size)} {what}" for ranks, what in (
            (same, "got the very same first training batch"),
            (wrong, "use a DistributedSampler built for another world (this run needs num_replicas="
                    f"{(expected or {}).get('num_replicas')}, rank=the global rank)")) if ranks]
        if problems:
            self.report("unsharded-data", (
                f"{'; '.join(problems)} (sampler: {describe_sampler(sampler)}): the data is not sharded, so "
                "the ranks repeat each other's work."))

    def _check_batchnorm(self, trainer: L.Trainer, pl_module: L.LightningModule, per_device: int | None) -> None:
        if per_device is None:
            return
        self.checked.add("small-batch-bn")
        # Lightning converts the layers for sync_batchnorm before training starts, so the type tells.
        local = [name for name, m in pl_module.named_modules() if isinstance(m, _BatchNorm) and m.training
                 and not isinstance(m, nn.SyncBatchNorm | CPUSyncBatchNorm)]
        if local and per_device < SMALL_BN_BATCH:
            self.report("small-batch-bn", (
                f"{len(local)} BatchNorm layer(s) ({first_few(local, 3)}) normalise over a per-device batch "
                f"of {per_device} at world size {trainer.world_size} without sync: each rank's statistics come "
                f"from {per_device} samples (noisy, and not what one process at the global batch would learn)."))

    def _check_lr_facts(self, trainer: L.Trainer, per_device: int | None) -> None:
        derived = per_device * trainer.world_size * trainer.accumulate_grad_batches if per_device else None
        global_batch = self.global_batch or derived
        if self.lr_scaling is None or self.reference_batch is None or not global_batch:
            return
        self.checked.add("lr-not-scaled")
        if global_batch != self.reference_batch and self.lr_scaling == "none" and not self.warmup_epochs:
            self.report("lr-not-scaled", (
                f"the global batch is {global_batch} but the LR was tuned for batch {self.reference_batch}, "
                f"with {{lr_scaling}} none and no warm-up: each step averages "
                f"{global_batch / self.reference_batch:.3g}x the samples at the same LR."))

    def _check_accumulation(self, accum: int, batches: Any) -> None:
        if accum > 1 and isinstance(batches, int):
            self.checked.add("accum-remainder")
            if batches % accum:  # Lightning divides every micro-batch's loss by accum, the last window's too
                self.report("accum-remainder", (
                    f"{batches} batches per epoch with accumulation {accum}: each epoch's last optimizer step "
                    f"sums {batches % accum} micro-batch(es) but divides by {accum}, so its gradient is "
                    f"{batches % accum}/{accum} of a full step's."))

    def _check_epoch_order(self, trainer: L.Trainer, batch: Any, fingerprint: Tensor | None) -> None:
        sampler = train_sampler(trainer)
        if not sampler_shuffles(sampler):
            return
        if shuffle_coincidence_chance(len(sampler), batch_size_of(batch) or 1) > COINCIDENCE_LIMIT:
            return  # too few samples: two honest shuffles may well start alike
        epoch = trainer.current_epoch
        current = batch_fingerprint(batch) if fingerprint is None else fingerprint
        self._previous_start, self._epoch_start = self._epoch_start, (epoch, current)

    def _compare_epoch_starts(self, trainer: L.Trainer) -> None:
        """Whether this epoch began like the previous one: compared at the epoch end (on the device, read once
        there), not at the epoch's first step."""
        previous, current = self._previous_start, self._epoch_start
        self._previous_start = None
        if previous is None or current is None or previous[0] != current[0] - 1:
            return
        self.checked.add("sampler-epoch")
        a, b = previous[1], current[1].to(previous[1].device)
        self._stale_epoch = float(torch.equal(a, b) and not torch.isnan(b).any())
        if trainer.world_size == 1 and self._stale_epoch:
            self._report_stale_order(trainer, [0])

    def _report_stale_order(self, trainer: L.Trainer, ranks: list[int]) -> None:
        epoch = trainer.current_epoch
        self.report("sampler-epoch", (
            f"epoch {epoch} began with the same batch as epoch {epoch - 1} on "
            f"{name_ranks(ranks, trainer.world_size)} although the training sampler "
            f"({describe_sampler(train_sampler(trainer))}) shuffles: every epoch repeats one order."))

    # ---- per step: the loss (local) and, at the first optimizer step, the gradients ------------------

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not self._track_loss:
            self._time_input_wait(trainer)
            return
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if isinstance(loss, Tensor) and loss.numel() == 1:
            value = loss.detach()
            if self._loss_sum is None:  # stays on the device: no sync per step
                self._loss_sum = value.to(torch.float64, copy=True).reshape(())
            else:  # one in-place op per step (computed in float64, as the sum's dtype)
                self._loss_sum.add_(value.reshape(()) if value.ndim else value)
            self._loss_count += 1
        self._time_input_wait(trainer)

    def _time_input_wait(self, trainer: L.Trainer) -> None:
        wait, now = input_wait(trainer), time.perf_counter()
        if wait is None:
            return
        if self._batch_end is not None:
            self._intervals += 1
            if self._intervals > INPUT_WARMUP_STEPS:  # once per fit: allocator, first all-reduce, workers
                self._wait[0] += wait
                self._wait[1] += now - self._batch_end
                self._wait[2] += 1
        self._batch_end = now

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._batch_end = None  # a validation pass inside the epoch is not a training step

    def _check_input_wait(self, trainer: L.Trainer, rows: Tensor | None = None) -> None:
        """Over the fit so far, on the rank that waited most (``rows``: every rank's [waited s, stepped s,
        steps] from the epoch-end gather; one process: its own). A rank whose loader is slow makes the
        others wait in the all-reduce instead, so only the slow rank's own wait shows it."""
        self._batch_end = None  # the next epoch's first interval would span the epoch boundary
        if rows is None:
            rows = torch.tensor([self._wait], dtype=torch.float64)
        ready = [(r[0] / r[1], rank, r) for rank, r in enumerate(rows.tolist()) if r[2] >= INPUT_MIN_STEPS and r[1] > 0]
        if not ready:
            return
        self.checked.add("input-bound")
        fraction, rank, (waited, _, steps) = max(ready)
        if fraction > INPUT_BOUND_FRACTION and waited / steps > INPUT_MIN_WAIT_S:
            self.report("input-bound", (
                f"the training loop waited for its next batch {fraction:.0%} of the step time on rank {rank} "
                f"({1000 * waited / steps:.1f} ms per step over {steps:.0f} steps): the devices idle while the "
                "loader reads and decodes."))

    @override
    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        if id(optimizer) in self._grads_checked:
            return
        self._grads_checked.add(id(optimizer))
        self.checked.add("unused-params")
        # Only this optimizer's parameters: another optimizer's (a GAN's) may rightly have no grad now.
        stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
        missing = [name for name, p in pl_module.named_parameters()
                   if p.requires_grad and id(p) in stepped and p.grad is None]
        if missing:
            self.report("unused-params", (
                f"{len(missing)} parameter(s) received no gradient in the first optimizer step: "
                f"{first_few(missing, 5)}. They take memory and optimizer state for nothing (and, with "
                "{find_unused_parameters}, an extra autograd traversal every step)."))

    # ---- epoch end: one gather for weights, loss, memory and the sampler's order ---------------------

    @override
    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._compare_epoch_starts(trainer)
        if trainer.world_size < 2:
            self._check_input_wait(trainer)
            return
        device = trainer.strategy.root_device
        cuda = device.type == "cuda"
        loss = (self._loss_sum / self._loss_count).item() if self._loss_sum is not None else math.nan
        peak = float(torch.cuda.max_memory_allocated(device)) if cuda else 0.0
        row = torch.tensor([*parameter_checksum(pl_module), loss, peak, self._stale_epoch, *self._wait],
                           dtype=torch.float64)
        rows, epoch = gather_rows(trainer, row), trainer.current_epoch
        self._check_input_wait(trainer, rows[:, 5:8])
        self.checked.update(("param-drift", "loss-divergence"))
        if params_drifted(rows[:, :2]):
            self.report("param-drift", (
                f"the parameters differ across ranks at the end of epoch {epoch} (checksums "
                f"{extremes(rows[:, 0].tolist(), '.12g')}): the replicas have drifted apart and each rank "
                "now trains its own model."))
        if loss_diverged(rows[:, 2].tolist()):
            self.report("loss-divergence", (
                f"the mean training loss of epoch {epoch} differs widely across ranks "
                f"({extremes(rows[:, 2].tolist(), '.4g')}): the ranks do not see comparable data."))
        if cuda:
            self.checked.add("memory-imbalance")
            if memory_imbalance(rows[:, 3].tolist()):
                self.report("memory-imbalance", (
                    f"peak CUDA memory differs across ranks ({extremes((rows[:, 3] / 2**30).tolist(), '.2f')} "
                    "GiB): one rank does extra work and will run out of memory first."))
        stale = [r for r in range(rows.shape[0]) if rows[r, 4].item() > 0]
        if stale:
            self._report_stale_order(trainer, stale)
