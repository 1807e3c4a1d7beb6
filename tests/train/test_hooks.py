"""Per-batch hooks no callback implements are off Lightning's callback loop for the run, and back after it."""

from __future__ import annotations

from lightning.pytorch.callbacks import Callback, ModelSummary
from lightning.pytorch.profilers import PassThroughProfiler

from ddp_recipes.train.hooks import PER_BATCH, SkipUnusedHooks, touched, unused_hooks
from ddp_recipes.train.trainer import build_trainer
from tests.tiny_modules import tiny_module_and_data


class Actions(PassThroughProfiler):
    """Lightning enters the profiler once for every callback hook it calls: the names it entered."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def profile(self, action_name: str):
        self.names.append(action_name)
        return super().profile(action_name)


class Counting(Callback):
    """A user's callback: two per-batch hooks of its own, one set on the instance."""

    def __init__(self) -> None:
        self.calls = {"on_before_backward": 0, "on_train_batch_end": 0, "on_after_backward": 0}
        self.seen_during_fit: dict[str, object] = {}
        self.on_after_backward = self._after  # an instance's own hook: left alone

    def _after(self, trainer, pl_module) -> None:
        self.calls["on_after_backward"] += 1

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self.calls["on_before_backward"] += 1

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.calls["on_train_batch_end"] += 1
        summary = [c for c in trainer.callbacks if isinstance(c, ModelSummary)][0]  # Lightning's, as the pack's table
        self.seen_during_fit = {name: getattr(summary, name) for name in ("on_before_backward", "on_fit_start")}
        self.seen_during_fit["own_zero_grad"] = self.on_before_zero_grad


def _fit(tmp_path, callbacks, steps=6):
    profiler = Actions()
    trainer = build_trainer(accelerator="cpu", devices=1, max_steps=steps, callbacks=callbacks, logger=False,
                            enable_progress_bar=False, default_root_dir=tmp_path, profiler=profiler)
    module, data = tiny_module_and_data()
    trainer.fit(module, data)
    return trainer, profiler


def test_unused_hooks_are_skipped_during_the_fit_and_given_back_after(tmp_path):
    user = Counting()
    trainer, profiler = _fit(tmp_path, [user])
    # the user's hooks, the class's and the instance's, ran at every step
    assert user.calls == {"on_before_backward": 6, "on_train_batch_end": 6, "on_after_backward": 6}
    # inside the fit the model summary's empty on_before_backward was off the loop, its own hooks not
    assert user.seen_during_fit["on_before_backward"] is None
    assert callable(user.seen_during_fit["on_fit_start"])
    entered = [n for n in profiler.names if n.startswith("[Callback]")]
    # no callback of Lightning's or the pack's implements on_before_zero_grad: only the user's class is entered
    # (its inherited hooks are left as they are: code of the user's may call them)
    assert [n for n in entered if n.endswith(".on_before_zero_grad")] == ["[Callback]Counting.on_before_zero_grad"] * 6
    assert [n for n in entered if n.endswith(".on_after_backward")] == ["[Callback]Counting.on_after_backward"] * 6
    assert callable(user.seen_during_fit["own_zero_grad"])
    summary = [c for c in trainer.callbacks if isinstance(c, ModelSummary)][0]
    assert touched(summary) and not touched(user)
    # after the fit every callback has its class's hooks again
    for callback in trainer.callbacks:  # (a callback may take its own hook off itself: RunPosition)
        assert not [name for name in PER_BATCH if vars(callback).get(name, ...) is None
                    and getattr(type(callback), name) is getattr(Callback, name)], type(callback).__name__
    summary.on_before_backward(trainer, trainer.lightning_module, None)  # a wrapper may call it directly


def test_a_modules_own_callbacks_are_covered_and_a_second_trainer_starts_alike(tmp_path):
    module, data = tiny_module_and_data()
    own = Counting()
    module.configure_callbacks = lambda: [own]  # attached by Lightning before setup
    for run in (1, 2):  # the same callback in a second Trainer: skipped and given back again
        trainer = build_trainer(accelerator="cpu", devices=1, max_steps=4, logger=False, enable_progress_bar=False,
                                default_root_dir=tmp_path / str(run))
        trainer.fit(module, data)
        assert own.calls["on_before_backward"] == 4 * run
        assert own.seen_during_fit["on_before_backward"] is None


def test_what_counts_as_unused():
    class Partial(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            pass

    class Sub(Partial):
        pass

    unused = unused_hooks(Sub())
    assert "on_train_batch_start" not in unused  # implemented by a base class of the user's
    assert "on_before_backward" in unused
    assert set(unused_hooks(SkipUnusedHooks())) == set(PER_BATCH)


class _Fails(Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx == 1:
            raise RuntimeError("boom")


def test_a_fit_that_raises_gives_the_hooks_back_and_a_leftover_none_is_taken_over(tmp_path):
    from lightning.pytorch.callbacks import EarlyStopping

    early = EarlyStopping(monitor="train_loss_never_logged", check_on_train_epoch_end=False)
    module, data = tiny_module_and_data()
    trainer = build_trainer(accelerator="cpu", devices=1, max_steps=4, logger=False, enable_progress_bar=False,
                            default_root_dir=tmp_path / "a", callbacks=[early, _Fails()])
    try:
        trainer.fit(module, data)
    except RuntimeError as err:
        assert "boom" in str(err)
    assert not [name for name in PER_BATCH if vars(early).get(name, ...) is None]  # given back on the exception
    # a None left by a run that could not give it back (a killed process's pickled callback, say) is the
    # class's hook for the next run: taken off and given back like any other
    early.on_before_backward = None
    assert "on_before_backward" in unused_hooks(early)
    trainer = build_trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_progress_bar=False,
                            default_root_dir=tmp_path / "b", callbacks=[early])
    trainer.fit(module, data)
    assert "on_before_backward" not in vars(early)
    early.on_before_backward(trainer, module, None)
