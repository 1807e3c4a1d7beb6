"""What a run that fails mid-training leaves to continue from, for the one line that ends it: the checkpoint it last
saved, or the one it resumed from, or none.

Recorded by :class:`~ddp_recipes.checkpointing.last.LastCheckpoint` in every rank after the save's barrier, so each
rank knows it without reading the store (which, in a bucket's outage, would not answer).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Kept:
    """This process's fit: whether training started, and the checkpoint a rerun continues from (None: none)."""

    started: bool = False
    path: str | None = None
    step: int | None = None
    own: bool = False  # the path is in this run's checkpoint folder, where --resume auto looks

    def words(self, how: str) -> str | None:
        """The end of a failed run's line (``how``: what to wait for, e.g. "once the store answers"); None
        before training started (nothing was trained, nothing is lost: the failure says enough)."""
        if not self.started:
            return None
        if self.path is None:
            return f"training stopped before its first checkpoint (none was saved): rerun the same command {how}"
        if not self.own:  # the checkpoint it resumed from, elsewhere: --resume auto would not find it here
            return (f"training stopped before its first checkpoint; the one it resumed from is kept ({self.path}, "
                    f"step {self.step}): rerun the same command {how}")
        return f"training stopped; its last checkpoint is kept ({self.path}, step {self.step}): rerun with " \
               f"--resume auto {how}"


_kept = Kept()


def current() -> Kept:
    """What this process's run has kept so far."""
    return _kept


def reset() -> None:
    """A new run in this process: nothing started, nothing kept."""
    _kept.started, _kept.path, _kept.step, _kept.own = False, None, None, False


def started(resumed_from: str | None, step: int, own: bool = False) -> None:
    """Training starts, from the checkpoint ``resumed_from`` (at ``step``; ``own``: in this run's checkpoint
    folder) or from scratch (None)."""
    _kept.started = True
    _kept.path, _kept.step = (str(resumed_from), step) if resumed_from else (None, None)
    _kept.own = bool(resumed_from) and own


def saved(path: str, step: int) -> None:
    """A checkpoint was written (and every rank passed its barrier)."""
    _kept.path, _kept.step, _kept.own = str(path), step, True
