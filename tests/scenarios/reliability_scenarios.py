"""A recipe with one injected fault, for tests/ddp/test_reliability.py:
``python tests/scenarios/reliability_scenarios.py RECIPE [recipe flags...]`` runs ``recipes.RECIPE.main`` with a
callback that, on rank ``REL_RANK`` (default 1) when ``trainer.global_step == REL_STEP``, does what ``REL_FAULT``
says:

* ``stop``:  stop calling collectives: write ``REL_DIR/rank<r>.pid`` (pid and time), sleep ``REL_WAIT_S``
  seconds (the test may SIGKILL it meanwhile), then exit 3;
* ``crash``: ``os._exit(1)``, but only once: ``REL_MARKER`` is created first and its presence disables the fault;
* ``term``: send this rank SIGTERM (as a launcher would), once, like ``crash``.

Lightning's launcher re-runs this same command line for every extra rank and torchrun runs it per rank, so
the environment reaches every rank. No fault is injected when ``REL_FAULT`` is unset.

``python tests/scenarios/reliability_scenarios.py slow-save TARGET READY`` saves a 16 MiB checkpoint to TARGET through
AtomicCheckpointIO, but stalls after the first MiB written (creating READY), so the test can kill it mid-save.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning.pytorch.callbacks import Callback  # noqa: E402

from tests.helpers import run_recipe_with  # noqa: E402


class Fault(Callback):
    def __init__(self) -> None:
        self.kind = os.environ.get("REL_FAULT", "")
        self.rank = int(os.environ.get("REL_RANK", "1"))
        self.step = int(os.environ.get("REL_STEP", "1"))
        self.wait_s = float(os.environ.get("REL_WAIT_S", "120"))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if not self.kind or trainer.global_rank != self.rank or trainer.global_step != self.step:
            return
        if self.kind == "term":  # the launcher's SIGTERM, as this rank receives it, once (REL_MARKER)
            marker = Path(os.environ["REL_MARKER"])
            if marker.exists():
                return
            marker.write_text(str(os.getpid()))
            print(f"[scenario] rank {self.rank} gets SIGTERM during step {self.step + 1}", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        if self.kind == "crash":
            marker = Path(os.environ["REL_MARKER"])
            if marker.exists():
                return
            marker.write_text(str(os.getpid()))
            print(f"[scenario] rank {self.rank} crashes at step {self.step}", file=sys.stderr, flush=True)
            os._exit(1)
        pid_file = Path(os.environ["REL_DIR"]) / f"rank{self.rank}.pid"
        tmp = pid_file.with_suffix(".tmp")
        tmp.write_text(f"{os.getpid()} {time.time()}")
        tmp.replace(pid_file)
        print(f"[scenario] rank {self.rank} stops at step {self.step}", file=sys.stderr, flush=True)
        time.sleep(self.wait_s)
        os._exit(3)


class StallingFile:
    """A file that stops for good (creating ``ready``) once more than 1 MiB has been written to it."""

    def __init__(self, file, ready: Path) -> None:
        self.file, self.ready, self.written = file, ready, 0

    def write(self, data) -> int:
        n = self.file.write(data)
        self.written += n
        if self.written > 1 << 20:
            self.file.flush()
            os.fsync(self.file.fileno())
            self.ready.write_text(str(self.written))
            time.sleep(600)
        return n

    def __getattr__(self, name):
        return getattr(self.file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.file.close()


def slow_save(target: Path, ready: Path) -> None:
    import torch

    from ddp_recipes import atomic
    from ddp_recipes.checkpointing import checkpoint

    atomic.open = lambda path, mode="r": StallingFile(open(path, mode), ready)  # module global beats builtin
    checkpoint.AtomicCheckpointIO().save_checkpoint({"state_dict": {"w": torch.full((4 << 20,), 2.0)}, "step": 2},
                                                    target)


def main() -> None:
    if sys.argv[1] == "slow-save":
        slow_save(Path(sys.argv[2]), Path(sys.argv[3]))
        return
    run_recipe_with(Fault(), sys.argv[1:])


if __name__ == "__main__":
    main()
