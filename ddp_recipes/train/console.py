"""What a recipe's process prints besides its own lines: Lightning's messages that the pack causes or that name
settings the pack owns, fixed or left out; the pack's warnings without a line of its source under them.

Applied by :func:`~ddp_recipes.train.run.open_run` in every rank, for the rest of the process: a recipe's
own process, or a script that calls a recipe's ``main``. There it filters the two Lightning messages in
:data:`LEFT_OUT` and formats the pack's own warnings; every other warning is formatted as before. The library's
``build_trainer`` alone changes neither.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

PACKAGE = Path(__file__).resolve().parents[1]  # ddp_recipes/

#: Lightning's messages a recipe's user cannot act on, or that name a Trainer argument the recipe owns.
LEFT_OUT = (
    # Lightning 2.6's own call of a torch API it has not moved off yet; nothing in the user's code
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",
    # names Trainer(log_every_n_steps=...), which a recipe refuses; LogCadence says it with the flag
    r"The number of training batches \(\d+\) is smaller than the logging interval",
)

_applied = False


def quiet_recipe_console() -> None:
    """Install the filters and the format, once per process."""
    global _applied
    if _applied:
        return
    _applied = True
    for message in LEFT_OUT:
        warnings.filterwarnings("ignore", message=message)
    shown = warnings.formatwarning

    def formatwarning(message: Any, category: type[Warning], filename: str, lineno: int,
                      line: str | None = None) -> str:
        # The pack's warnings are whole sentences; the source line Python prints under them
        # (rank_zero_warn(f"...)) is noise. Lightning formats its own the same way.
        if Path(filename).resolve().is_relative_to(PACKAGE):
            return f"{filename}:{lineno}: {message}\n"
        return shown(message, category, filename, lineno, line)

    warnings.formatwarning = formatwarning


class LogCadence(Callback):
    """Says, with the recipe's flag, when an epoch has fewer training batches than the logging interval (the
    warning Lightning gives names ``Trainer(log_every_n_steps=...)``, which a recipe takes as ``flag``)."""

    def __init__(self, flag: str = "--log-every-n-steps") -> None:
        self.flag = flag

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        batches, every = trainer.num_training_batches, trainer.log_every_n_steps
        if trainer.loggers and isinstance(batches, int) and 0 < batches < every:
            rank_zero_warn(f"{self.flag} {every} is more than the {batches} training batch(es) of an epoch: the "
                           f"training metrics are logged every {every} steps across epochs; pass {self.flag} "
                           f"{batches} or less to log inside each epoch")
