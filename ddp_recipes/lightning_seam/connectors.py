"""The Trainer's connectors the pack swaps in: its state is kept, only the class changes (Lightning creates its
connectors in ``Trainer.__init__`` and offers no argument for another one). Checked on Lightning 2.6.6.

* signals: handlers that only record the signal (Lightning's broadcast from its SIGTERM handler and save a
  checkpoint from its SLURM one, Lightning#21406, PR#21407 open);
* data: a hook where Lightning re-creates a loader under DDP (its DistributedSampler pads evaluation data
  with duplicates, Lightning#5060, #2398; its training loaders cannot resume mid-epoch);
* checkpoint: a route for ``ckpt_path`` (Lightning resolves ``"last"`` in every rank before the process group
  exists; no upstream issue found).
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable
from typing import Any

from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from ddp_recipes.lightning_seam.reach import cluster_environment, private

_SignalConnector = private("lightning.pytorch.trainer.connectors.signal_connector", "_SignalConnector")
_DataConnector = private("lightning.pytorch.trainer.connectors.data_connector", "_DataConnector")
_CheckpointConnector = private("lightning.pytorch.trainer.connectors.checkpoint_connector", "_CheckpointConnector")


class FlagSignalConnector(_SignalConnector):
    """Handlers that only record the signal, while fitting (outside ``fit`` SIGTERM keeps its default action)."""

    def __init__(self, trainer: Any) -> None:
        super().__init__(trainer)
        self.signum: int | None = None

    def signals(self) -> list[int]:
        env = cluster_environment(self.trainer)
        wanted = [signal.SIGTERM]
        if isinstance(env, SLURMEnvironment) and env.requeue_signal is not None:
            wanted.append(env.requeue_signal)
        return wanted

    @override
    def register_signal_handlers(self) -> None:
        self.received_sigterm = False  # Lightning's own SIGTERM path stays off: we act at step boundaries
        self.signum = None
        if self.trainer.state.fn != TrainerFn.FITTING or sys.platform == "win32":
            return
        self._original_handlers = self._get_current_signal_handlers()
        for signum in self.signals():
            self._register_signal(signum, self._record)

    def _record(self, signum: int, frame: Any) -> None:
        if self.signum is None or signum == signal.SIGTERM:  # SIGTERM (the kill is coming) wins
            self.signum = int(signum)


def install_flag_signals(trainer: Any) -> FlagSignalConnector:
    """Give ``trainer`` a :class:`FlagSignalConnector` (before ``Trainer._run`` registers any handler)."""
    if not isinstance(trainer._signal_connector, FlagSignalConnector):
        trainer._signal_connector = FlagSignalConnector(trainer)
    return trainer._signal_connector


class _HookedDataConnector(_DataConnector):
    """Lightning's data connector; ``loader_hook(dataloader, shuffle, mode, default)`` prepares each loader it
    re-creates (``default`` is Lightning's own preparation)."""

    loader_hook: Callable[..., object]

    @override
    def _prepare_dataloader(self, dataloader: object, shuffle: bool, mode: Any) -> object:
        return self.loader_hook(dataloader, shuffle, mode, super()._prepare_dataloader)


def install_loader_hook(trainer: Any, hook: Callable[..., object]) -> None:
    """Route the loaders ``trainer`` re-creates through ``hook`` (a user's own connector class is left alone)."""
    connector = trainer._data_connector
    if type(connector) in (_DataConnector, _HookedDataConnector):
        connector.__class__ = _HookedDataConnector
        connector.loader_hook = hook


def remove_loader_hook(trainer: Any) -> None:
    """Give ``trainer`` Lightning's own data connector back."""
    if type(trainer._data_connector) is _HookedDataConnector:
        trainer._data_connector.__class__ = _DataConnector


class _RoutedCheckpointConnector(_CheckpointConnector):
    """Lightning's checkpoint connector; ``route.parse(trainer, state_fn, ckpt_path, default)`` resolves
    ``ckpt_path`` and ``route.resume(trainer, checkpoint_path)`` decides the file when the ranks load it."""

    route: Any

    @override
    def _parse_ckpt_path(self, state_fn: TrainerFn, ckpt_path: Any, model_provided: bool,
                         model_connected: bool) -> Any:
        def default(path: Any) -> Any:
            return super(_RoutedCheckpointConnector, self)._parse_ckpt_path(state_fn, path, model_provided,
                                                                             model_connected)
        return self.route.parse(self.trainer, state_fn, ckpt_path, default)

    @override
    def resume_start(self, checkpoint_path: Any = None, weights_only: bool | None = None) -> None:
        super().resume_start(self.route.resume(self.trainer, checkpoint_path), weights_only=weights_only)


def install_checkpoint_route(trainer: Any, route: Any) -> None:
    """Route ``trainer``'s ``ckpt_path`` through ``route`` (see :class:`_RoutedCheckpointConnector`)."""
    connector = trainer._checkpoint_connector
    if type(connector) in (_CheckpointConnector, _RoutedCheckpointConnector):
        connector.__class__ = _RoutedCheckpointConnector
        connector.route = route
