"""Per-batch callback hooks that a callback does not implement, kept off the step's path.

Lightning calls every per-batch hook of every callback, implemented or not: for each it looks the hook up,
builds the profiler's action name from ``callback.state_key`` (for ``ModelCheckpoint`` a dict rendered to a
string) and enters the profiler's context, then calls the base class's empty method. Six hooks a training
step, some ten callbacks in a pack run: more host time than an MNIST-MLP step's own hooks. Lightning skips a
hook that is not callable, so for the run a hook the callback's class leaves as :class:`Callback`'s empty one
is set to ``None`` on the instance, and given back at teardown.
"""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

#: Hooks Lightning calls once per batch (each through its callback loop, never directly).
PER_BATCH = ("on_train_batch_start", "on_train_batch_end", "on_before_backward", "on_after_backward",
             "on_before_optimizer_step", "on_before_zero_grad", "on_validation_batch_start",
             "on_validation_batch_end", "on_test_batch_start", "on_test_batch_end", "on_predict_batch_start",
             "on_predict_batch_end")


def unused_hooks(callback: Callback) -> list[str]:
    """The per-batch hooks ``callback`` leaves empty: its class's is :class:`Callback`'s own and the instance
    sets none of its own."""
    return [name for name in PER_BATCH if name not in vars(callback)
            and getattr(type(callback), name, None) is getattr(Callback, name)]


class SkipUnusedHooks(Callback):
    """Takes the per-batch hooks no callback implements off Lightning's callback loop for a fit, validate,
    test or predict (every callback of the trainer, the module's ``configure_callbacks`` ones included: they
    are attached before ``setup``)."""

    def __init__(self) -> None:
        self._skipped: list[tuple[Callback, str]] = []

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._give_back()
        for callback in trainer.callbacks:
            for name in unused_hooks(callback):
                setattr(callback, name, None)  # Lightning's loop: `if callable(fn)`
                self._skipped.append((callback, name))

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._give_back()

    def _give_back(self) -> None:
        # A callback outside the run (a user's wrapper calling it, another Trainer) sees its class's hooks again.
        for callback, name in self._skipped:
            if vars(callback).get(name, ...) is None:
                delattr(callback, name)
        self._skipped = []

    def __getstate__(self) -> dict[str, Any]:
        return {"_skipped": []}  # a pickled trainer (spawn) carries no references to the callbacks
