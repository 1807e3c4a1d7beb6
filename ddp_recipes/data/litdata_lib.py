"""litdata (Lightning's streaming-dataset library), imported on first use: the one place that imports it, that
names the optional ``stream`` extra when it is missing, and that lets it talk to an ``http://`` S3 endpoint."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from ddp_recipes.errors import ConfigError
from ddp_recipes.extras import install_hint

STREAM_EXTRA = install_hint("stream", "litdata")


def import_litdata(needed_for: str = "converting to a streamable dataset") -> ModuleType:
    """The ``litdata`` module, ready for the configured endpoint; a one-line :class:`ConfigError` naming the
    extra when it is not installed."""
    try:
        import litdata
    except ImportError:
        raise ConfigError(f"{needed_for} needs litdata, which is not installed: {STREAM_EXTRA}") from None
    allow_http_endpoint()
    return litdata


def allow_http_endpoint() -> None:
    """Let litdata's obstore client reach a plain-http S3 endpoint (MinIO, moto, a cluster-local gateway).

    By a private name: litdata hands obstore explicit client options, so obstore's own ``AWS_ALLOW_HTTP`` is never
    read. Module state: a spawned worker sets it again through :func:`import_litdata`. Only an ``http://``
    AWS_ENDPOINT_URL turns it on. pyproject caps litdata below 0.3 because of this name.
    """
    endpoint = os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL_S3") or ""
    if endpoint.startswith("http://"):
        from litdata.streaming import downloader

        downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = True


# ---- a user's own litdata loader on the library path ------------------------------------------------------

def is_litdata_loader(loader: object) -> bool:
    """Whether ``loader`` is litdata's ``StreamingDataLoader``. litdata is looked up, never imported: a loader
    of litdata's exists only where the user's code imported it already."""
    litdata = sys.modules.get("litdata")
    return litdata is not None and isinstance(loader, litdata.StreamingDataLoader)


def _streaming_datasets(dataset: Any) -> list[Any]:
    """The ``StreamingDataset``s a litdata loader reads: the dataset, or the parts of a combined/parallel one."""
    parts = getattr(dataset, "_datasets", None)
    return [d for part in parts for d in _streaming_datasets(part)] if parts else [dataset]


def adopt_litdata_loader(loader: Any, world: int, rank: int, seed: int, gather: Callable[[Any], list[Any]]) -> None:
    """Take over a user's ``StreamingDataLoader`` as the training loader of rank ``rank`` of ``world``.

    litdata splits the data by rank itself and Lightning checkpoints the loader's state. What the pack adds:

    * a dataset built before the process group was up (it read world size 1, so ranks read the same samples) is
      refused on every rank (``gather`` is a collective);
    * a state saved with another ``cache_dir`` (a new machine) is loaded into this process's cache, for the same
      URL only: litdata refuses one whose cache path differs;
    * a loader without a ``generator`` gets one seeded with ``seed`` (see the comment there);
    * :func:`end_litdata_epoch`, at each epoch's end.
    """
    built = [(d.distributed_env.world_size, d.distributed_env.global_rank)
             for d in _streaming_datasets(loader.dataset)]
    for other, seen in enumerate(gather(built)):
        wrong = next((pair for pair in seen if pair != (world, other)), None)
        if wrong is not None:
            raise ConfigError(
                f"train_dataloader: its litdata StreamingDataset ({type(loader.dataset).__name__}) split the data for "
                f"world size {wrong[0]}, rank {wrong[1]} on rank {other} of a {world}-rank run, so ranks would read "
                "the same samples: it was built before the process group was up; build it inside "
                "train_dataloader() or setup() (they run on every rank after the ranks connect)")
    if loader.generator is None:
        # Each epoch's iterator draws its workers' base seed from the global stream dropout uses, unless the loader
        # has a generator; resumed mid-epoch, that draw comes after the streams were put back, shifting them by one.
        import torch

        loader.generator = torch.Generator().manual_seed(seed)
    if not getattr(loader, "_ddp_recipes_adopted", False):
        loader.load_state_dict = _LoadHere(loader, loader.load_state_dict, world)
        loader._ddp_recipes_adopted = True


class _LoadHere:
    """``loader.load_state_dict`` that first points a saved state's cache paths at this process's cache
    (:func:`adopt_litdata_loader`)."""

    def __init__(self, loader: Any, load: Callable[[dict[str, Any]], None], world: int) -> None:
        self.loader, self.load, self.world = loader, load, world

    def __call__(self, state: dict[str, Any]) -> None:
        saved = state.get("dataset")
        datasets = _streaming_datasets(self.loader.dataset)
        # a StreamingDataset's state is one dict; a combined one's is a dict of them, in its parts' order
        parts = [saved] if not isinstance(saved, dict) or "input_dir_path" in saved else list(saved.values())
        for part, dataset in zip(parts, datasets, strict=False):
            if isinstance(part, dict) and "cache_dir_path" in part and part.get("input_dir_url") is not None \
                    and part["input_dir_url"] == dataset.input_dir.url:
                part["input_dir_path"], part["cache_dir_path"] = dataset.input_dir.path, dataset.cache_dir.path
        saved_world = next((p.get("world_size") for p in parts if isinstance(p, dict)), self.world)
        if saved_world != self.world:
            rank_zero_warn(f"train_dataloader: litdata resumes a position saved at world size {saved_world} at world "
                           f"size {self.world}: it repeats up to world size x batch size - 1 samples of the epoch "
                           "(exact only at the same world size)")
        self.load(state)


def end_litdata_epoch(loader: object) -> None:
    """The training epoch is over: a litdata loader resumed in it starts the next epoch afresh (litdata keeps a
    loaded position until its iterator is exhausted, which Lightning never does: the next epoch would be empty)."""
    if is_litdata_loader(loader):
        loader.restore = False
