"""litdata (Lightning's streaming-dataset library), imported on first use: the one place that imports it, that
names the ``stream`` extra when it is missing, and that lets it talk to an ``http://`` S3 endpoint.

litdata is the pack's optional ``stream`` extra (:data:`STREAM_EXTRA`); the lent GPU machine has no registry and no
litdata, so nothing imports it at module level.
"""

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

    Why here, and by a private name: litdata hands obstore explicit client options, so obstore's own switch
    (``AWS_ALLOW_HTTP``) is never read, and obstore refuses ``http://`` ("builder error") for every chunk
    upload and most downloads. The option dict is module state inherited by forked workers; a spawned worker
    that imports litdata through :func:`import_litdata` sets it again. Only an ``http://`` AWS_ENDPOINT_URL
    turns it on: real S3 over https is untouched. pyproject caps litdata below 0.3 because of this name.
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

    litdata splits the data by rank itself and Lightning saves and loads the loader's state (the position
    of the batches handed to the loop) in the checkpoint, so the loader stays as it is. What the pack adds:

    * a dataset that split the data for another world or rank is refused (``gather`` is a collective: every
      rank says what its datasets were built for, so every rank fails with the same line). litdata reads the
      world once, when the dataset is built: built before the process group is up (at a script's top level,
      in ``__init__``), it records world size 1 (or ``WORLD_SIZE`` with rank 0 under torchrun) and the ranks
      read the same samples;
    * a state saved with another ``cache_dir`` (a new machine, a fresh temp folder) is loaded into this
      process's cache: litdata refuses a state whose cache path differs ("The provided `input_dir` path state
      doesn't match"), though an empty cache is re-downloaded anyway. Only the cache location is rewritten,
      and only for the same URL; another dataset is still litdata's refusal;
    * a loader without a ``generator`` gets one seeded with ``seed``, to keep training's random streams exact
      over a resume (see the comment there); :func:`end_litdata_epoch` is the fourth, at each epoch's end.
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
        # Each epoch's iterator draws its workers' base seed when its first batch is fetched: from the global
        # stream that dropout uses, unless the loader has a generator. Resumed mid-epoch, that draw comes after
        # the checkpoint's streams were put back (the uninterrupted run made it before they were saved), and
        # every later random draw of training would shift by one.
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
    """The training epoch is over: a litdata loader resumed in it starts the next epoch afresh.

    litdata keeps a loaded position (``restore``) until its iterator runs to exhaustion, and Lightning stops
    fetching from a sized loader after its last batch without exhausting it: the epoch after a resumed one
    would start from the loaded position again, at its end, and train no batch at all.
    """
    if is_litdata_loader(loader):
        loader.restore = False
