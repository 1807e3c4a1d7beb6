"""What a checkpoint must carry, beyond Lightning's, for a resumed run to continue exactly.

:class:`ResumeState` saves and puts back at the *training boundary* (``on_train_start``: after every set-up hook
and Lightning's restore, before the first batch) every rank's random streams (a fresh run gets ``seed + rank``
there, so set-up hooks see the same RNG on every rank), the training loader's position (Lightning builds the
iterator before it restores the loop state: :func:`reposition_train_loader`), the new run's scaled learning
rates and the comm hook's state. The whole list and why: docs/resume-and-preemption.md.
"""

from __future__ import annotations

import random
from typing import Any

import lightning as L
import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.optim.lr_scheduler import LambdaLR
from typing_extensions import override

from ddp_recipes.checkpointing.checkpoint import TrainerStateCallback
from ddp_recipes.checkpointing.position import open_next_epoch, reopen_cut_epoch
from ddp_recipes.data.litdata_lib import end_litdata_epoch
from ddp_recipes.data.samplers import loader_batch_size
from ddp_recipes.data.seeding import seed_rank
from ddp_recipes.lightning_seam import reach
from ddp_recipes.optim.schedules import schedule_length, steps_per_epoch

PREBUILT = "_ddp_recipes_built_before"  # the mark build_trainer(seed=...) leaves on a model built before it


def rng_state(device: torch.device | None = None) -> dict[str, Any]:
    """This process's random streams, as plain lists and tensors (loadable with ``weights_only=True``). CUDA:
    only ``device``'s generator (every visible device's would initialise CUDA on all of them in every rank)."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    cuda = torch.cuda.get_rng_state(device) if device is not None and device.type == "cuda" else None
    return {"python": random.getstate(), "numpy": (name, keys.tolist(), pos, has_gauss, gauss),
            "torch": torch.get_rng_state(), "cuda": cuda}


def set_rng_state(state: dict[str, Any], device: torch.device | None = None) -> None:
    """Put back what :func:`rng_state` saved; CUDA only into ``device``, and only when it is a CUDA device."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if device is None or device.type != "cuda":
        return  # a CPU run never touches CUDA, whatever the checkpoint holds
    cuda = _own_cuda_state(state.get("cuda"), device)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)


def _own_cuda_state(saved: Any, device: torch.device) -> torch.Tensor | None:
    """The saved state of ``device``'s generator. A checkpoint that holds a list has every visible device's
    state by position: that position is this device's only when the process sees as many devices as the
    saving one did."""
    if saved is None or isinstance(saved, torch.Tensor):
        return saved
    if not saved:  # a list of no device states: a CPU run
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if len(saved) == torch.cuda.device_count() and index < len(saved):
        return saved[index]
    rank_zero_warn(f"the checkpoint holds the CUDA random states of {len(saved)} visible device(s) by position "
                   f"(ddp-recipes <= 0.2) and this process sees {torch.cuda.device_count()}: which one was "
                   f"{device}'s is unknown, so its CUDA stream is not restored (CUDA-side random ops such as "
                   "dropout on the GPU will differ from the uninterrupted run; CPU-side streams are restored)")
    return None


def gather_to_rank0(obj: Any) -> list[Any] | None:
    """Every rank's ``obj`` on rank 0 (None elsewhere); ``[obj]`` without a process group. Collective."""
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def completed_epochs(trainer: L.Trainer) -> int:
    """Whole epochs trained: ``trainer.current_epoch``, except after a fit that stopped inside an epoch
    (``max_steps``, ``max_time``), which Lightning counts as done and a continued run does not; so one checkpoint
    gives one count, whichever run wrote it. A fit that trained nothing keeps the checkpoint's counters (one
    written in ``on_train_epoch_end`` is one epoch short there; its batch progress says if the epoch ended).
    """
    fit_loop = trainer.fit_loop
    progress = fit_loop.epoch_progress.current
    if progress.processed > progress.completed:
        return progress.processed - int(not reach.epoch_batches_done(trainer))
    state = next((c for c in trainer.callbacks if isinstance(c, ResumeState)), None)
    return trainer.current_epoch - int(state is not None and state.epoch_cut_short)


def reposition_train_loader(trainer: L.Trainer, new_epoch: bool = False) -> None:
    """Load the checkpoint's loader states Lightning skipped, set the resumed epoch, rebuild the iterator."""
    loaders, fetcher = reach.train_loaders(trainer), reach.train_fetcher(trainer)
    if not loaders or fetcher is None:
        return
    reach.load_skipped_loader_states(trainer)  # no-op when Lightning loaded them itself, or there are none
    epoch = trainer.fit_loop.epoch_progress.current.processed  # what on_advance_start will give set_epoch
    for loader in loaders:
        reach.set_sampler_epoch(loader, epoch)
    stream = torch.get_rng_state()
    iter(fetcher)  # a fresh iterator: workers start at the restored position and epoch
    # Building it draws the workers' base seed from the global stream for a loader without a generator of its
    # own (the pack's loaders have one). The uninterrupted run drew it at the epoch's start: before the
    # checkpoint saved the streams when this continues an epoch (the restored stream must not pay for it a second
    # time), after it when this starts a new one (the draw is the new epoch's, as in that run).
    if not new_epoch:
        torch.set_rng_state(stream)


def close_finished_epoch(trainer: L.Trainer) -> None:
    """Resumed from a checkpoint written after an epoch's last batch, start the next epoch at its first batch.

    Lightning 2.6 restarts the epoch loop "on last" there: at the end of an epoch that does not validate it trains
    another batch inside it; after ``fit`` returned (``final.ckpt``) the next epoch trains one fewer.
    """
    fit_loop = trainer.fit_loop
    loop, fetcher = fit_loop.epoch_loop, reach.train_fetcher(trainer)
    if fetcher is None or not loop.restarted_on_last or not loop.batch_progress.is_last_batch:
        return
    if fit_loop.restarted_on_epoch_end:
        if reach.iteration_based(trainer):
            # The restored epoch's end hooks run again and count it processed a second time (the checkpoint,
            # written in on_train_epoch_end, counted it already): max_epochs would stop one epoch early.
            fit_loop.epoch_progress.current.processed -= 1
            fit_loop.epoch_progress.total.processed -= 1
        if reach.validation_due(trainer, fetcher):
            return  # the epoch's validation is still due: Lightning runs it (or skips it when it already ran)
        fetcher.done = True  # the next fetch ends the epoch (StopIteration), as the uninterrupted run's did
        if getattr(fetcher, "batches", None):
            fetcher.batches.clear()  # batches an iterable loader prefetched belong to no epoch of this run
    elif not (fit_loop.restarted_mid_epoch or fit_loop.restarted_on_epoch_start):
        # the epoch is over in every counter: this fit starts a new one, as a fresh epoch does
        loop.batch_progress.reset_on_run()
        loop.scheduler_progress.reset_on_run()
        loop.automatic_optimization.optim_progress.reset_on_run()
        loop.val_loop.batch_progress.total.reset()


def _schedule_steps(trainer: L.Trainer) -> list[int | None]:
    """The run length each LR schedule was sized for (the pack's cosine decays over the run), None for a schedule
    that does not depend on it."""
    return [schedule_length(config.scheduler) for config in trainer.lr_scheduler_configs]


def _warn_resized_schedule(trainer: L.Trainer, saved: list[int | None] | None, now: list[int | None]) -> None:
    """A run continued with another limit re-sizes a schedule that decays over the run: say that the steps
    before the checkpoint followed the other curve, so the end differs from a run with this limit throughout."""
    changed = [(old, new) for old, new in zip(saved or [], now, strict=False) if old and new and old != new]
    if changed:
        old, new = changed[0]
        rank_zero_warn(f"the LR schedule decays over the whole run: it was sized for {old} steps when the checkpoint "
                       f"was written and is sized for {new} now (another step or epoch limit); from step "
                       f"{trainer.global_step} the LR follows the {new}-step curve, but the steps before followed the "
                       f"{old}-step one, so the weights will differ from a run that had this limit from the start (a "
                       "schedule that does not depend on the run's length, e.g. without cosine decay, continues "
                       "exactly)")


def _warn_unresumable_loader(trainer: L.Trainer) -> None:
    """A mid-epoch resume with a loader that cannot skip what it already gave: say so, once."""
    from ddp_recipes.data.litdata_lib import is_litdata_loader
    from ddp_recipes.data.resumable import ResumableDataLoader

    done, total = trainer.fit_loop.epoch_loop.batch_progress.current.completed, trainer.num_training_batches
    loader = trainer.train_dataloader
    if (isinstance(total, int) and 0 < done < total and loader is not None
            and not isinstance(loader, ResumableDataLoader) and not is_litdata_loader(loader)):
        rank_zero_warn(f"resumed in the middle of epoch {trainer.current_epoch} with a training loader that cannot "
                       f"skip the batches it already gave ({type(loader).__name__}): this epoch revisits its first "
                       "batches instead of "
                       "continuing after the last one; build it with ddp_recipes.data.samplers.resumable_train_loader "
                       "(or subclass SplitDataModule) for an exact resume")


class ResumeState(TrainerStateCallback):
    """Saves and restores the random streams, LR facts and comm-hook state; seeds ``seed + rank`` (``seed`` None:
    streams left alone on a fresh run). Its ``state_dict`` gathers every rank's state to rank 0: a collective, so
    never from a signal handler (:mod:`ddp_recipes.checkpointing.preemption`)."""

    def __init__(self, seed: int | None = None, prebuilt: str | None = None) -> None:
        self.seed = seed
        # the mark of the LightningModules built before build_trainer(seed=...) seeded, or None
        self.prebuilt = prebuilt
        self._pending: dict[str, Any] | None = None
        self._fresh_lrs: list[list[float]] = []
        self._schedule: list[int | None] = []
        self.epoch_cut_short = False  # this fit's last epoch ended before its last batch (a limit, should_stop)

    # ---- saving --------------------------------------------------------------------------------------

    @override
    def state_dict(self) -> dict[str, Any]:
        trainer = self._trainer
        device = trainer.strategy.root_device if trainer is not None else None
        state: dict[str, Any] = {"rng": gather_to_rank0(rng_state(device))}
        if trainer is None:
            return state
        state["world_size"] = trainer.world_size
        per_device = loader_batch_size(trainer.train_dataloader)
        state["global_batch_size"] = (per_device * trainer.world_size * trainer.accumulate_grad_batches
                                      if isinstance(per_device, int) else None)
        state["steps_per_epoch"] = steps_per_epoch(trainer, size_loader=False)
        state["schedule_steps"] = self._schedule
        hook_state = getattr(trainer.strategy, "comm_hook_state_dict", None)
        if callable(hook_state):
            state["comm_hook"] = hook_state()
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._pending = state_dict

    # ---- restoring, at the training boundary ------------------------------------------------------------

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # configure_optimizers has run, the checkpoint's optimizer state is not loaded yet: these are the
        # LRs this run was configured with.
        self._fresh_lrs = [[g.get("initial_lr", g["lr"]) for g in opt.param_groups] for opt in trainer.optimizers]
        self._schedule = _schedule_steps(trainer)  # the restore of the scheduler state replaces run_steps
        built_before = self.prebuilt is not None and getattr(pl_module, PREBUILT, None) == self.prebuilt
        if built_before and trainer.ckpt_path is None:
            rank_zero_warn(f"{type(pl_module).__name__} was built before build_trainer(seed={self.seed}) seeded the "
                           "random streams, so its initial weights (all not loaded from a file) differ from run to "
                           "run; build the model after build_trainer(...), or call lightning.seed_everything(seed) "
                           "before building it (every rank still starts from rank 0's weights: DDP copies them)")

    @override
    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.epoch_cut_short = not reach.epoch_batches_done(trainer)
        for loader in reach.train_loaders(trainer):
            end_litdata_epoch(loader)

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.epoch_cut_short = False
        pending, self._pending = self._pending, None
        resuming = trainer.ckpt_path is not None
        saved_world = (pending or {}).get("world_size")
        same_world = pending is not None and saved_world == trainer.world_size
        if same_world and pending.get("rng") and len(pending["rng"]) == trainer.world_size:
            set_rng_state(pending["rng"][trainer.global_rank], trainer.strategy.root_device)
        elif self.seed is not None:
            seed_rank(self.seed, trainer.global_rank, step=trainer.global_step if resuming else 0)
        if not resuming:
            return
        reopen_cut_epoch(trainer)
        opened = open_next_epoch(trainer)
        reposition_train_loader(trainer, new_epoch=opened)
        close_finished_epoch(trainer)
        _warn_unresumable_loader(trainer)
        lr_change = self._reapply_lrs(trainer, pending or {})
        _warn_resized_schedule(trainer, (pending or {}).get("schedule_steps"), self._schedule)
        if same_world and pending.get("comm_hook") is not None:
            loader = getattr(trainer.strategy, "load_comm_hook_state_dict", None)
            if callable(loader):
                loader(pending["comm_hook"])
        if pending is not None and not same_world:
            self._report_resize(trainer, pending, lr_change)

    @override
    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Lightning 2.6 gives set_epoch the count of processed epochs; resumed from a checkpoint taken at
        # an epoch end of a --max-steps run ("restarted on epoch end") that count runs one ahead of the
        # epoch it trains, and the sampler would shuffle another epoch's order. The trained epoch decides.
        for loader in reach.train_loaders(trainer):
            reach.set_sampler_epoch(loader, trainer.current_epoch)

    def _reapply_lrs(self, trainer: L.Trainer, pending: dict[str, Any]) -> str:
        """Put this run's LRs back over the checkpoint's and re-index step schedules; returns a summary."""
        old_spe, new_spe = int(pending.get("steps_per_epoch") or 0), steps_per_epoch(trainer, size_loader=False)
        reindex = old_spe > 0 and new_spe > 0 and old_spe != new_spe and trainer.max_steps == -1
        scheduled: set[int] = set()
        notes = []
        for config in trainer.lr_scheduler_configs:
            sched = config.scheduler
            opt = sched.optimizer
            if opt not in trainer.optimizers or not hasattr(sched, "base_lrs"):
                continue
            fresh = self._fresh_lrs[trainer.optimizers.index(opt)]
            old_base = list(sched.base_lrs)
            sched.base_lrs = list(fresh)
            if isinstance(sched, LambdaLR):
                if reindex and config.interval == "step":
                    before = sched.last_epoch
                    sched.last_epoch = round(before * new_spe / old_spe)
                    notes.append(f"LR schedule at step {sched.last_epoch} of this run (step {before} of the "
                                 f"checkpoint's, {old_spe} -> {new_spe} steps per epoch)")
                lrs = [base * fn(sched.last_epoch) for base, fn in zip(sched.base_lrs, sched.lr_lambdas, strict=True)]
            else:  # any other multiplicative schedule: keep its position, rescale by the new base LR
                lrs = [g["lr"] * (new / old if old else 1.0)
                       for g, new, old in zip(opt.param_groups, fresh, old_base, strict=True)]
            for group, base, lr in zip(opt.param_groups, fresh, lrs, strict=True):
                group["initial_lr"], group["lr"] = base, lr
            sched._last_lr = [g["lr"] for g in opt.param_groups]
            scheduled.add(id(opt))
            if any(abs(a - b) > 1e-12 * max(abs(a), 1e-30) for a, b in zip(old_base, fresh, strict=True)):
                notes.insert(0, f"peak LR {old_base[0]:g} -> {fresh[0]:g} re-applied")
        for opt, fresh in zip(trainer.optimizers, self._fresh_lrs, strict=True):
            if id(opt) not in scheduled:
                for group, lr in zip(opt.param_groups, fresh, strict=True):
                    group["lr"] = lr
        return "; ".join(notes)

    @staticmethod
    def _report_resize(trainer: L.Trainer, pending: dict[str, Any], lr_change: str) -> None:
        old_world, old_batch = pending.get("world_size"), pending.get("global_batch_size")
        per_device = loader_batch_size(trainer.train_dataloader)
        new_batch = per_device * trainer.world_size * trainer.accumulate_grad_batches if per_device else None
        batch = (f"global batch {new_batch} kept" if old_batch == new_batch
                 else f"global batch {old_batch} -> {new_batch} (keep it with --global-batch-size)")
        parts = [f"resumed at world size {trainer.world_size} from a world-size-{old_world} checkpoint: {batch} "
                 f"({per_device} per device x {trainer.world_size} x {trainer.accumulate_grad_batches} "
                 "accumulation)", lr_change, "the epoch's remaining samples re-sharded, per-rank random streams "
                 "re-seeded (exact weights need the same world size)"]
        rank_zero_info("; ".join(p for p in parts if p))
        if old_world is None:
            rank_zero_warn("the checkpoint records no world size (not written by ddp-recipes >= 0.2)")
