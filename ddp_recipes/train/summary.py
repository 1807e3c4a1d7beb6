"""``summary.json``: the fields a finished run reports, gathered over the ranks."""

from __future__ import annotations

import time
from typing import Any

import lightning as L
import torch

from ddp_recipes.checkpointing.exact_continuation import completed_epochs
from ddp_recipes.checkpointing.run_folder.ownership import ATTEMPTS_DIR
from ddp_recipes.config.run_config import RunConfig
from ddp_recipes.storage import location
from ddp_recipes.train.attempts import read_attempts, trainer_run_id
from ddp_recipes.train.callbacks import ThroughputMeter
from ddp_recipes.train.rank_watch import RankWatch


def scalar_metrics(trainer: L.Trainer) -> dict[str, float]:
    """The trainer's current logged scalars (epoch values are already synced across ranks)."""
    return {k: float(v) for k, v in trainer.callback_metrics.items() if torch.is_tensor(v) and v.numel() == 1}



def summarize(cfg: RunConfig, trainer: L.Trainer, meter: ThroughputMeter, fit_seconds: float,
              metrics: dict[str, float], test_metrics: dict[str, float],
              extra: dict[str, Any] | None = None, flops: dict[str, Any] | None = None,
              attempts: bool = True) -> dict[str, Any]:
    """The fields of summary.json (see docs/recipes.md#summaryjson for each one). Every rank calls it (one
    collective). ``attempts``: whether the run left attempt records (``stops``; a debugging run leaves none)."""
    wait = worst_rank(trainer, meter.input_wait_fraction)
    batch = cfg.plan.batch
    stops = (stop_costs(read_attempts(location(cfg.output_dir) / ATTEMPTS_DIR, trainer_run_id(trainer)), time.time())
             if attempts and trainer.is_global_zero else None)  # the records are rank 0's
    return {
        "world_size": trainer.world_size,
        "num_nodes": trainer.num_nodes,
        "devices_per_node": trainer.num_devices,
        "per_device_batch_size": batch.per_device,
        "accumulate_grad_batches": batch.accumulation,
        "global_batch_size": batch.global_batch,
        "precision": trainer.precision,
        "epochs": completed_epochs(trainer),
        "steps": trainer.global_step,
        "fit_seconds": round(fit_seconds, 3),
        "train_samples_per_sec": round(meter.samples_per_sec, 1) if meter.samples_per_sec else None,
        "input_wait_fraction": round(wait, 4) if wait is not None else None,
        "first_step_seconds": round(meter.first_step_s, 3) if meter.first_step_s is not None else None,
        # The first step's excess over a steady one: tracing and code generation (recompiles for other
        # shapes, e.g. a short last batch or evaluation, come on top and are not counted here).
        "compile_seconds": (round(max(0.0, meter.first_step_s - (meter.step_s_median or 0.0)), 3)
                            if cfg.plan.compile_backend and meter.first_step_s is not None else None),
        **(flops or {}),
        "final_train_loss": metrics.get("train_loss_epoch", metrics.get("train_loss")),
        **{k: v for k, v in test_metrics.items()},
        "metrics": metrics,
        "config": cfg.to_dict(),
        "torch_version": torch.__version__,
        "lightning_version": L.__version__,
        **{k: (v.total(trainer) if isinstance(v, RankCounts) else v) for k, v in (extra or {}).items()},
        **({"stops": stops} if stops is not None else {}),
        # rank 0's straggler figures (per-step input wait and forward per rank; slowest/fastest and their ratio)
        "ranks": next((c.figures or None for c in trainer.callbacks if isinstance(c, RankWatch)), None),
    }


class RankCounts:
    """A process's counters (a dict its owner fills during the run, e.g. the device decoder's images and CPU
    fallbacks), summed over the ranks when summary.json is made: a PNG in rank 1's shard counts too.
    Non-numeric values are rank 0's."""

    def __init__(self, source: dict[str, Any]) -> None:
        self.source = source

    def total(self, trainer: L.Trainer) -> dict[str, Any]:
        """Every rank calls it (one collective)."""
        keys = sorted(k for k, v in self.source.items() if isinstance(v, int | float) and not isinstance(v, bool))
        local = torch.tensor([float(self.source[k]) for k in keys] or [0.0], dtype=torch.float64,
                             device=trainer.strategy.root_device)
        summed = trainer.strategy.reduce(local, reduce_op="sum").tolist() if trainer.world_size > 1 else local.tolist()
        out = dict(self.source)
        out.update({k: (int(v) if isinstance(self.source[k], int) else v) for k, v in zip(keys, summed, strict=False)})
        return out



def worst_rank(trainer: L.Trainer, value: float | None) -> float | None:
    """The largest of the ranks' ``value`` (None where a rank has none): a rank whose loader is slow shows
    it in its own wait, while the others wait in the all-reduce. Every rank must call it."""
    local = torch.tensor(-1.0 if value is None else float(value), dtype=torch.float64,
                         device=trainer.strategy.root_device)
    worst = float(trainer.strategy.reduce(local, reduce_op="max"))
    return None if worst < 0 else worst


def stop_costs(records: list[dict[str, Any]], ended_at: float | None = None) -> dict[str, Any]:
    """summary.json's ``stops`` block: the run's wall and training time over its attempts, the goodput, and per
    stop how it ended, the steps redone and the seconds from the stop to the resumed attempt's first step."""
    if not records:
        return {}
    stops = []
    for before, after in zip(records, records[1:], strict=False):
        stopped_at = before.get("ended_at") or before.get("last_step_at")
        first = after.get("first_step_at")
        stops.append({
            "attempt": before["attempt"],
            "how": before.get("ended") or "killed (no clean exit: SIGKILL, a lost rank or machine)",
            "at_step": before.get("last_step"),
            "resumed_from_step": after.get("start_step"),
            "steps_redone": max(0, int(before.get("last_step") or 0) - int(after.get("start_step") or 0)),
            "seconds_to_first_step": round(first - stopped_at, 3) if first and stopped_at else None,
        })
    last = records[-1]
    end = ended_at or last.get("ended_at") or last.get("last_step_at")
    wall = end - records[0]["started_at"] if end else None
    training = sum(max(0.0, (r.get("ended_at") or r.get("last_step_at") or 0) - r["train_started_at"])
                   for r in records if r.get("train_started_at"))
    return {"attempts": len(records), "wall_seconds": round(wall, 3) if wall else None,
            "training_seconds": round(training, 3),
            "goodput": round(training / wall, 4) if wall else None,
            "steps_redone": sum(s["steps_redone"] for s in stops), "stops": stops}
