"""Per-batch callback hooks that a callback does not implement, kept off the step's path.

Lightning calls every per-batch hook of every callback, implemented or not: for each it looks the hook up,
builds the profiler's action name from ``callback.state_key`` (for ``ModelCheckpoint`` a dict rendered to a
string) and enters the profiler's context, then calls the base class's empty method. Six hooks a training
step, some ten callbacks in a pack run: more host time than an MNIST-MLP step's own hooks. Lightning skips a
hook that is not callable, so for the run a hook the callback's class leaves as :class:`Callback`'s empty one
is set to ``None`` on the instance, and given back when the run ends (teardown, or an exception).

Only callbacks of Lightning's and of the pack's own classes are touched: a user's callback class keeps every
hook it inherits (code of the user's may call it directly). During the run a touched callback's unimplemented
per-batch hook is ``None``: code that calls such a hook of another callback directly should test ``callable``
first, or take this callback out (``trainer.callbacks = [c for c in trainer.callbacks if not isinstance(c,
SkipUnusedHooks)]`` before ``fit``).
"""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from ddp_recipes.lightning_seam import reach

#: Hooks Lightning calls once per batch (each through its callback loop, never directly).
PER_BATCH = ("on_train_batch_start", "on_train_batch_end", "on_before_backward", "on_after_backward",
             "on_before_optimizer_step", "on_before_zero_grad", "on_validation_batch_start",
             "on_validation_batch_end", "on_test_batch_start", "on_test_batch_end", "on_predict_batch_start",
             "on_predict_batch_end")


#: Where the classes come from whose callbacks are touched: Lightning's own and the pack's.
OWN_PACKAGES = ("lightning.", "pytorch_lightning.", "ddp_recipes.")


def unused_hooks(callback: Callback) -> list[str]:
    """The per-batch hooks ``callback`` leaves empty: its class's is :class:`Callback`'s own and the instance
    sets none of its own (a ``None`` left there by a run that ended without giving it back counts as none)."""
    return [name for name in PER_BATCH if vars(callback).get(name) is None
            and getattr(type(callback), name, None) is getattr(Callback, name)]


def touched(callback: Callback) -> bool:
    """Whether :class:`SkipUnusedHooks` takes ``callback``'s unused hooks off: a class of Lightning's or the pack's."""
    return type(callback).__module__.startswith(OWN_PACKAGES)


class SkipUnusedHooks(Callback):
    """Takes the per-batch hooks no callback implements off Lightning's callback loop for a fit, validate,
    test or predict: of every callback of Lightning's or the pack's classes in the trainer, the module's
    ``configure_callbacks`` ones included (they are attached before ``setup``)."""

    def __init__(self) -> None:
        self._skipped: list[tuple[Callback, str]] = []

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._give_back()
        for callback in trainer.callbacks:
            if not touched(callback):
                continue
            for name in unused_hooks(callback):
                reach.switch_off_hook(callback, name)
                self._skipped.append((callback, name))

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._give_back()

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._give_back()  # Lightning calls no teardown hook of a run that raised

    def _give_back(self) -> None:
        # A callback outside the run (a user's wrapper calling it, another Trainer) sees its class's hooks again.
        for callback, name in self._skipped:
            reach.switch_on_hook(callback, name)
        self._skipped = []

    def __getstate__(self) -> dict[str, Any]:
        return {"_skipped": []}  # a pickled trainer (spawn) carries no references to the callbacks
