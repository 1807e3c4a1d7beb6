"""Host reads and collectives of whole loop iterations, counted alike for the raw loop, plain Lightning and the pack.

An iteration runs from one training batch's start to the next one's (for Lightning: ``on_train_batch_start``, after
the fetch and the transfer; for a hand-written loop: the same point in its body), so it holds everything a step
costs: the forward, the backward, the optimizer, every hook of every callback, Lightning's own batch-end work
(its logger connector, the progress bar) and the next batch's fetch. Per iteration it counts

* ``reads``: the ops that read a tensor's value on the host (``aten::_local_scalar_dense`` for ``.item()``,
  ``float(t)``; ``aten::is_nonzero`` for ``bool(t)``, ``if t:``), seen by a ``TorchDispatchMode`` on the
  training thread: on CUDA each is a stream stall;
* ``python``: the ``torch.distributed`` functions called from Python (wrapped for the counter's lifetime, given
  back after); DDP's gradient all-reduces are C++ and are not among them, its buffer broadcast
  (:data:`DDP_OWN`) is;
* ``issued``: the collectives issued on every process group (each group's sequence number, DDP's C++
  reducer included; ``None`` without a process group).

Counting goes through Python for every aten op: the bench counts iterations after its timed ones, never during.
"""

from __future__ import annotations

import functools
import statistics
from collections import Counter
from typing import Any

import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch.utils._python_dispatch import TorchDispatchMode
from typing_extensions import override

from ddp_recipes.lightning_seam.reach import logs_this_step

HOST_READS = ("aten::_local_scalar_dense", "aten::is_nonzero")
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast",
               "broadcast_object_list", "barrier", "gather", "gather_object", "scatter", "scatter_object_list",
               "reduce", "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "send",
               "recv", "isend", "irecv", "batch_isend_irecv", "monitored_barrier", "_broadcast_coalesced",
               "new_group")
#: DDP's own Python call in every forward (its buffer broadcast, ``broadcast_buffers=True``): raw, plain and pack
#: alike, so "beyond DDP's own" leaves it out.
DDP_OWN = ("_broadcast_coalesced",)


class OpCounts(TorchDispatchMode):
    """Every aten op dispatched on this thread while entered, by schema name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func._schema.name] += 1
        return func(*args, **(kwargs or {}))

    def host_reads(self) -> int:
        return sum(self.ops[name] for name in HOST_READS)


class PythonCollectives:
    """Records the :data:`COLLECTIVES` of ``torch.distributed`` called from Python while ``recording``.

    The module's functions are replaced while entered and the originals put back on exit (code that imported a
    function by name before is not seen: the sequence numbers still count what it issues)."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.recording = False
        self._originals: dict[str, Any] = {}

    def __enter__(self) -> PythonCollectives:
        for name in COLLECTIVES:
            fn = getattr(dist, name, None)
            if callable(fn) and name not in self._originals:
                self._originals[name] = fn
                setattr(dist, name, self._wrap(name, fn))
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, fn in self._originals.items():
            setattr(dist, name, fn)
        self._originals.clear()

    def _wrap(self, name: str, fn: Any) -> Any:
        @functools.wraps(fn)
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self.recording:
                self.names.append(name)
            return fn(*args, **kwargs)
        return counted


def issued() -> int | None:
    """Collectives issued so far on every process group of this process (None without a process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    from torch.distributed.distributed_c10d import _world

    return sum(pg._get_sequence_number_for_group() for pg in list(_world.pg_map))


def group_count() -> int:
    """Process groups of this process (0 without one)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    from torch.distributed.distributed_c10d import _world

    return len(_world.pg_map)


class WholeIterations:
    """Counts the iterations of a loop between consecutive :meth:`mark` calls, for the iterations that begin
    after ``after`` steps, ``count`` of them (None: all). One row per iteration: what :meth:`mark` was given
    at its start, ``reads``, ``python``, ``issued``, ``groups``, ``spans`` (``"step"``, or what closed it
    instead: ``"epoch_end"``, ``"fit_end"``) and ``ops`` (every aten op of it, by name)."""

    def __init__(self, calls: PythonCollectives, after: int = 0, count: int | None = None) -> None:
        self.calls, self.after, self.count = calls, after, count
        self.rows: list[dict[str, Any]] = []
        self._mode: OpCounts | None = None
        self._row: dict[str, Any] = {}
        self._issued: int | None = None

    def wants(self, steps_done: int) -> bool:
        """Whether the iteration that begins after ``steps_done`` steps is counted."""
        return steps_done >= self.after and (self.count is None or steps_done < self.after + self.count)

    def mark(self, steps_done: int, spans: str = "step", **row: Any) -> None:
        """An iteration boundary: closes the open iteration (as ``spans``) and opens the next if it is wanted."""
        self.close(spans)
        if self.wants(steps_done):
            self._row = {**row, "steps_done": steps_done}
            self.calls.names.clear()
            self.calls.recording = True
            self._mode = OpCounts()
            self._mode.__enter__()
            self._issued = issued()  # after this hook's own bookkeeping

    def note(self, **row: Any) -> None:
        """Sets fields of the open iteration's row (nothing when none is open)."""
        if self._mode is not None:
            self._row.update(row)

    def add(self, key: str, n: int) -> None:
        """Adds ``n`` to a field of the open iteration's row (nothing when none is open)."""
        if self._mode is not None:
            self._row[key] = self._row.get(key, 0) + n

    def close(self, spans: str) -> None:
        """Ends the open iteration (if any) as one row; ``spans`` says what ended it."""
        if self._mode is None:
            return
        now = issued()
        self._mode.__exit__(None, None, None)
        self.calls.recording = False
        mode, self._mode = self._mode, None
        self.rows.append({**self._row, "spans": spans, "reads": mode.host_reads(),
                          "python": list(self.calls.names), "groups": group_count(),
                          "issued": None if now is None or self._issued is None else now - self._issued,
                          "ops": dict(mode.ops)})

    def per_step(self) -> dict[str, Any]:
        """:func:`per_step` of the rows."""
        return per_step(self.rows)

    def compact(self) -> list[dict[str, Any]]:
        """:func:`compact` of the rows."""
        return compact(self.rows)

    def ops(self) -> Counter[str]:
        """Every aten op of every counted iteration together."""
        total: Counter[str] = Counter()
        for row in self.rows:
            total.update(row["ops"])
        return total


class LoopCount(WholeIterations):
    """:class:`WholeIterations` of a hand-written loop with its own :class:`PythonCollectives`, as a context; the
    open iteration closes as ``"fit_end"`` on exit."""

    def __init__(self, after: int = 0, count: int | None = None) -> None:
        super().__init__(PythonCollectives(), after, count)

    def __enter__(self) -> LoopCount:
        self.calls.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close("fit_end")
        self.calls.__exit__(*exc)


class StepCounts(Callback):
    """:class:`WholeIterations` over a Lightning fit: an iteration begins at ``on_train_batch_start`` once
    ``after`` optimizer steps are done (``count`` iterations; None: every one). Each row also says the
    iteration's ``epoch``, ``batch_idx``, ``step`` (the optimizer step it makes), whether the logger wrote at it
    (``logs``, Lightning's own test) and how many values it handed the first logger (``written``: the values a
    log step may read). An epoch's last iteration closes at the next epoch's first batch start as
    ``"epoch_end"`` (it holds the epoch end and validation); the fit's last one at ``on_train_end``."""

    def __init__(self, after: int = 0, count: int | None = None) -> None:
        self.calls = PythonCollectives()
        self.iterations = WholeIterations(self.calls, after, count)
        self._epoch: int | None = None
        self._logger: tuple[Any, Any] | None = None

    @property
    def rows(self) -> list[dict[str, Any]]:
        return self.iterations.rows

    def per_step(self) -> dict[str, Any]:
        return per_step(self.rows)

    def compact(self) -> list[dict[str, Any]]:
        return compact(self.rows)

    @override
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":
            self.calls.__enter__()

    @override
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if trainer.loggers and self._logger is None:
            logger = trainer.loggers[0]
            before = logger.__dict__.get("log_metrics")  # another callback's wrapper, or None: the class's

            def log_metrics(metrics: dict[str, Any], step: int | None = None) -> None:
                self.iterations.add("written", len(set(metrics) - {"epoch"}))
                (before or type(logger).log_metrics.__get__(logger))(metrics, step)

            logger.log_metrics = log_metrics
            self._logger = (logger, before)

    @override
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        epoch = trainer.current_epoch
        spans = "epoch_end" if self._epoch is not None and epoch != self._epoch else "step"
        self._epoch = epoch
        self.iterations.mark(trainer.global_step, spans, epoch=epoch, batch_idx=batch_idx,
                             step=trainer.global_step + 1, logs=False, written=0)

    @override
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        # Lightning's own test of a log step, before its _batches_that_stepped moves on.
        self.iterations.note(logs=logs_this_step(trainer))

    @override
    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.iterations.close("fit_end")
        self._give_back()

    @override
    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.iterations.close("fit_end")
        self._give_back()

    @override
    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":
            self.iterations.close("fit_end")
            self._give_back()
            self.calls.__exit__(None, None, None)

    def _give_back(self) -> None:
        if self._logger is not None:
            logger, before = self._logger
            if before is None:
                logger.__dict__.pop("log_metrics", None)
            else:
                logger.log_metrics = before
            self._logger = None


def _per_step(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    if not rows:
        return None
    beyond = [[n for n in row["python"] if n not in DDP_OWN] for row in rows]
    issued_ = [row["issued"] for row in rows]
    return {"iterations": len(rows),
            "reads": statistics.fmean(row["reads"] for row in rows), "reads_max": max(row["reads"] for row in rows),
            "python": statistics.fmean(len(b) for b in beyond), "python_max": max(len(b) for b in beyond),
            "python_names": sorted({n for row in rows for n in row["python"]}),
            "issued": None if None in issued_ else statistics.fmean(issued_)}


def per_step(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per step over the steady iterations (``spans == "step"``): ``quiet`` (the logger did not write) and
    ``log`` (it did; None when none did): iterations, mean and most host reads, mean and most Python collectives
    beyond DDP's own (:data:`DDP_OWN`), the names called (DDP's included), mean collectives issued."""
    steady = [row for row in rows if row["spans"] == "step"]
    return {"quiet": _per_step([row for row in steady if not row.get("logs")]),
            "log": _per_step([row for row in steady if row.get("logs")])}


def compact(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows without their op tables (what a run's JSON keeps)."""
    return [{k: v for k, v in row.items() if k != "ops"} for row in rows]
