"""``--data stream``: train from a dataset written by ``python -m ddp_recipes.data.convert``, local or in a bucket.

litdata is storage only (``StreamingDataset(shuffle=False)[i]``), never the order: its shuffle and resume are
exact at one world size only. The converter keeps ImageFolder's sample order, so the resumable sampler, seeds and
exact evaluation apply unchanged (docs/streaming.md). Each process opens the stream on first use (pickling drops an
opened one). A bucket's chunks come through the pack's storage layer into the node's cache, once per node.
"""

from __future__ import annotations

import bisect
import errno
import itertools
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset
from typing_extensions import override

from ddp_recipes.data.convert_dest import CLASSES_FILE, FORMAT, missing_chunks
from ddp_recipes.data.encoded import EncodedImageFolder, EvalPipeline, TrainPipeline
from ddp_recipes.data.images import ImageFolderDataModule, warn_not_jpeg
from ddp_recipes.data.litdata_lib import import_litdata
from ddp_recipes.data.node_cache import dataset_key, join
from ddp_recipes.data.pixels import open_rgb
from ddp_recipes.errors import MissingDataError, lit
from ddp_recipes.storage import Url, absolute
from ddp_recipes.storage.retry import StorageError, filesystem, reason, retrying
from ddp_recipes.storage.store import CACHE_ENV, download, read_bytes, size

CONVERT = "python -m ddp_recipes.data.convert SRC DIR"
# litdata's boto3 client retries 1000 times by default (a store that is down hangs the run); these bound it.
S3_RETRIES = {"max_attempts": 3, "mode": "standard"}


class StreamSplit:
    """One split of a converted stream (``<data_dir>/<split>``) by index; opened in the process that reads it."""

    def __init__(self, url: str, length: int, cache: str | None) -> None:
        self.url, self.length, self.cache = url, length, cache
        self._dataset: Any = None
        self._chunks: tuple[str, list[int], list[str]] | None = None  # cache folder, first sample and file per chunk

    def __len__(self) -> int:
        return self.length

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_dataset": None, "_chunks": None}  # an opened dataset stays in its process

    def open(self) -> Any:
        if self._dataset is None:
            # Opening reads index.json through boto3 (litdata's, 3 attempts): a loader worker that opens its split
            # during a blip of 503s would end the run with a raw traceback; retried as the chunks are instead.
            try:
                self._dataset = retrying(f"opening {self.url}", self._new_dataset, param="data_dir")
            except StorageError as err:
                split = self.url.rstrip("/").rsplit("/", 1)[-1]
                raise StreamUnavailable(f"opening {split} failed: {str(err).removeprefix('data_dir: ')}") from None
            if self.cache is not None:
                folder = self._dataset.input_dir.path  # where litdata put index.json and looks for the chunks
                chunks = json.loads(Path(folder, "index.json").read_text())["chunks"]
                firsts = [0, *itertools.accumulate(int(chunk["chunk_size"]) for chunk in chunks)][:-1]
                self._chunks = (folder, firsts, [chunk["filename"] for chunk in chunks])
        return self._dataset

    def fetch_index(self) -> None:
        """Bring a bucket split's ``index.json`` into the cache, in the rank, before its loader workers open the
        split: litdata waits 1 s for its file lock, then reads the file whether or not it is there."""
        if self.cache is not None:
            self._new_dataset()

    def _new_dataset(self) -> Any:
        litdata = import_litdata("--data stream")  # also in a spawned worker: the http switch is per process
        options: dict[str, Any] = {}
        if isinstance(absolute(self.url), Url):
            from botocore.config import Config

            options["storage_options"] = {"config": Config(retries=S3_RETRIES, connect_timeout=10, read_timeout=60)}
        # drop_last left to litdata: it shapes only litdata's own iteration, which the pack never uses (samples are
        # read by index in the pack's order); set to False it made litdata warn in every rank and loader worker.
        dataset = litdata.StreamingDataset(self.url, shuffle=False, cache_dir=self.cache, **options)
        # The converter's samples carry bytes: read by litdata's item-range path (its default for a remote split)
        # they come back empty in 0.2.76 ("unpack_from requires a buffer"); whole chunks it reads.
        dataset._on_demand_bytes = False
        return dataset

    def __getitem__(self, index: int) -> dict[str, Any]:
        dataset = self.open()
        split = self.url.rstrip("/").rsplit("/", 1)[-1]
        if self._chunks is not None:
            self._download_chunk(int(index), split)
        try:
            return dataset[int(index)]
        except (OSError, RuntimeError) as err:  # litdata's own failures (a chunk it had to fetch again, say)
            raise StreamUnavailable(f"reading {split} sample {int(index)} failed ({outage_reason(err)})") from None

    def _download_chunk(self, index: int, split: str) -> None:
        """The sample's chunk into litdata's cache folder, unless it is there: through the pack's storage layer, so
        a store that is down is retried and ends in one line here (litdata's obstore gave up after 2 to 4 s of 503s,
        with a traceback from every loader worker)."""
        assert self._chunks is not None
        folder, firsts, names = self._chunks
        name = names[bisect.bisect_right(firsts, index) - 1]
        local = os.path.join(folder, name)
        if os.path.exists(local):  # downloaded before, by this process or another worker of the rank
            return
        from filelock import FileLock  # litdata's own dependency

        # litdata's lock for this chunk: two workers wanting it download it once, and litdata never starts its own.
        try:
            with FileLock(local + ".lock"):
                if not os.path.exists(local):
                    download(f"{self.url.rstrip('/')}/{name}", local)  # via a temp name: never a cut chunk
        except StorageError as err:
            local_fault = _local_fault(err)
            if local_fault is not None:  # the node's disk, not the store: waiting for the store would not help
                raise StreamCacheError(f"{CACHE_ENV} {folder}: chunk {name} cannot be written there ({local_fault}); "
                                       f"free space there or point {CACHE_ENV} at a larger writable local disk, then "
                                       "rerun with --resume auto") from None
            what = str(err).removeprefix("output_dir: ")  # "download of URL failed after 8 attempts (why)"
            raise StreamUnavailable(f"reading {split} sample {index} failed: {what}") from None


def _local_fault(err: BaseException) -> str | None:
    """Why the cache folder refused a chunk (a full disk, a quota, read-only, no permission), or None."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in _LOCAL_ERRNOS:
            return seen.strerror or errno.errorcode.get(seen.errno, str(seen.errno))
        seen = seen.__cause__ or seen.__context__
    return None


_LOCAL_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM}


class StreamUnavailable(OSError):
    """A sample the store did not deliver (after the storage layer's retries). ``str()`` is one line; re-raised
    from a loader worker, the worker's traceback ends with it."""


class StreamCacheError(StreamUnavailable):
    """The node's stream cache refused a chunk (full, read-only, not this user's): the line names the cache."""


UNAVAILABLE_MARK = "StreamUnavailable: "


def outage_reason(err: BaseException) -> str:
    """The first line of what litdata raised (for its download thread's failure: the original error's)."""
    text = str(err)
    return reason(RuntimeError(text.split("Original error: ", 1)[-1]))


def describe_outage(err: BaseException) -> str | None:
    """The one line of a :class:`StreamUnavailable`, raised here or re-raised from a loader worker; None for any
    other error."""
    if not isinstance(err, StreamUnavailable):
        return None
    text = str(err).strip()
    last = text.splitlines()[-1] if text else ""
    mark = next((m for m in (f"{type(err).__name__}: ", UNAVAILABLE_MARK) if m in last), None)
    return last.split(mark, 1)[1] if mark else last


class StreamImages(Dataset):
    """A split's samples decoded by PIL as ``(transform(image), label)``: ImageFolder's ``__getitem__`` on the
    stream's bytes, with the folder's loader (:func:`~ddp_recipes.data.pixels.open_rgb`), so the same file gives the
    same tensor."""

    def __init__(self, split: StreamSplit, transform: Any) -> None:
        self.split, self.transform = split, transform

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        sample = self.split[index]
        image = open_rgb(sample["image"], sample["path"])
        return self.transform(image), int(sample["label"])


class EncodedStream(EncodedImageFolder):
    """``--decode gpu`` on a stream: :class:`EncodedImageFolder` fed the stream's bytes instead of files."""

    def __init__(self, split: StreamSplit, pipeline: TrainPipeline | EvalPipeline, not_jpeg: int = 0) -> None:
        super().__init__([], pipeline)
        self.split, self._not_jpeg = split, not_jpeg

    @override
    def __len__(self) -> int:
        return len(self.split)

    @override
    def read(self, index: int) -> tuple[bytes, int, str]:
        sample = self.split[index]
        return bytes(sample["image"]), int(sample["label"]), sample["path"]

    @override
    def not_jpeg(self) -> int:
        return self._not_jpeg  # counted by the converter (classes.json): the names themselves are in the chunks


def read_record(data_dir: str | os.PathLike) -> dict[str, Any]:
    """The stream's ``classes.json``, after proving that ``train/index.json`` is there; one line naming
    ``{data_dir}`` (a :class:`MissingDataError`) for a missing folder or bucket, refused credentials, or a
    folder or URL that holds no converted dataset."""
    where = absolute(data_dir)
    no_dataset = (f"{{data_dir}} {lit(where)} holds no dataset written by the converter ({{what}}); convert an "
                  f"ImageFolder there first: {CONVERT}")
    if isinstance(where, Path) and not where.is_dir():
        raise MissingDataError(f"{{data_dir}} {lit(where)} does not exist; pass the DEST of {CONVERT}", "data_dir")
    text = _read(where / CLASSES_FILE)
    if text is None:
        raise MissingDataError(no_dataset.replace("{what}", f"no {CLASSES_FILE}"), "data_dir") from None
    try:
        record = json.loads(text)
        ours = isinstance(record, dict) and record.get("format") == FORMAT and bool(record["classes"])
        ours = ours and int(record["splits"]["train"]["samples"]) >= 1
    except (ValueError, UnicodeDecodeError, KeyError, TypeError):
        ours = False
    if not ours:  # (not an assert: python -O would skip the check)
        raise MissingDataError(no_dataset.replace("{what}", f"{CLASSES_FILE} is not the converter's, or lists no "
                                                              "train split"), "data_dir")
    for split in record["splits"]:
        if _checked(size, where / split / "index.json") is None:
            raise MissingDataError(no_dataset.replace("{what}", f"{split}/index.json is missing"), "data_dir")
        # A chunk gone (a lifecycle rule, a partial sync) would otherwise surface mid-epoch as litdata's timeout.
        missing = _checked(missing_chunks, where / split)
        if missing:
            shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
            raise MissingDataError(f"{{data_dir}} {lit(where)}: {split}/index.json names {len(missing)} chunk(s) "
                                   f"that are missing or cut short ({lit(shown)}); rerun {CONVERT} with the same SRC "
                                   "to convert that split again", "data_dir")
    return record


def _checked(read: Callable[[Path | Url], Any], path: Path | Url) -> Any:
    """``read(path)``, a store's failure one line naming ``{data_dir}``."""
    try:
        return read(path)
    except StorageError as err:
        raise MissingDataError(f"{{data_dir}}: {lit(reason(err))}", "data_dir") from None


def _read(path: Path | Url) -> bytes | None:
    """The file's bytes, None when there is none; a missing bucket or refused credentials: one line."""
    if isinstance(path, Path):
        return read_bytes(path) if path.is_file() else None
    fs, inside = filesystem(path, "data_dir")
    bucket = inside.strip("/").split("/", 1)[0]
    try:
        return retrying(f"read of {path}", lambda: fs.cat_file(inside), param="data_dir")
    except StorageError as err:
        cause = err.__cause__
        folder = path.parent
        if isinstance(cause, PermissionError) or "credentials" in str(cause).lower():
            raise MissingDataError(f"{{data_dir}} {lit(folder)}: access denied ({lit(reason(cause))}); check the "
                                   "credentials (AWS_ACCESS_KEY_ID/AWS_PROFILE, the pod's service account) or pass "
                                   "another {data_dir}", "data_dir") from None
        if not isinstance(cause, FileNotFoundError):
            raise
        if not _bucket_exists(fs, bucket):
            raise MissingDataError(f"{{data_dir}} {lit(folder)}: bucket {lit(bucket)} does not exist; pass the "
                                   f"DEST of {CONVERT}", "data_dir") from None
        return None


def _bucket_exists(fs: Any, bucket: str) -> bool:
    try:
        fs.ls(bucket, refresh=True)
    except FileNotFoundError:
        return False
    except Exception:  # noqa: BLE001 - anything else (a listing refused): the bucket is there
        return True
    return True


def cached_chunks(cache: str | os.PathLike | None) -> tuple[int, int]:
    """(chunk files, bytes) in a stream's download cache (litdata keeps them in subfolders of it)."""
    chunks = list(Path(cache).rglob("chunk-*.bin")) if cache else []
    return len(chunks), sum(chunk.stat().st_size for chunk in chunks)


class StreamImageDataModule(ImageFolderDataModule):
    """:class:`ImageFolderDataModule` (its pipelines, ``--decode gpu``, its loaders) over a converted stream.

    ``data_dir``: the converter's DEST, local or a bucket URL; class names and sample counts come from its
    ``classes.json``, checked before any rank starts. ``cache``: where a bucket's chunks go (default: the node's
    folder, :mod:`ddp_recipes.data.node_cache`; a folder given is the caller's to remove).
    """

    def __init__(self, data_dir: str | os.PathLike, *args: Any, cache: str | os.PathLike | None = None,
                 **kwargs: Any) -> None:
        super().__init__(data_dir, *args, **kwargs)
        self.data_dir = absolute(data_dir)  # type: ignore[assignment] - a Url too, not only a Path
        self._record: dict[str, Any] | None = None
        self.cache: Path | None = None if cache is None else Path(cache)

    @property
    def record(self) -> dict[str, Any]:
        """The stream's ``classes.json`` (read on first use)."""
        if self._record is None:
            self._record = read_record(self.data_dir)
        return self._record

    @override
    def check_layout(self) -> None:
        """A one-line :class:`MissingDataError` naming ``--data-dir`` unless it holds a converted stream."""
        import_litdata("--data stream")  # the missing extra is one line here too, not one per rank later
        self.record  # noqa: B018 - read and checked

    @override
    def _train_classes(self) -> list[str]:
        return list(self.record["classes"])

    @property
    @override
    def train_size(self) -> int:
        return int(self.record["splits"]["train"]["samples"])

    def has_split(self, split: str) -> bool:
        return split in self.record["splits"]

    @override
    def check_files(self) -> None:
        self.check_layout()  # the converter checked the folders it read; the record is what there is

    @override
    def eval_sizes(self) -> dict[str, int]:
        val = int(self.record["splits"].get("val", {}).get("samples", 0))
        return {"validation": val, "test": val}

    @override
    def more_eval_samples(self, what: str, need: int) -> str:
        return f"convert a folder whose val/ holds at least {need} images into {{data_dir}}"

    @override
    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        url = str(self.data_dir)
        if isinstance(self.data_dir, Url) and self.cache is None:  # (a cache given: the caller's, e.g. the bench's)
            splits_read = [name for name in self.record["splits"] if name in ("train", "val")]
            indexes = {name: read_bytes(self.data_dir / name / "index.json") for name in splits_read}
            self.cache = join(dataset_key(url, indexes))
        elif not isinstance(self.data_dir, Url):
            self.cache = None
        splits = {name: StreamSplit(f"{url.rstrip('/')}/{name}", int(entry["samples"]),
                                    None if self.cache is None else str(self.cache / name))
                  for name, entry in self.record["splits"].items() if name in ("train", "val")}
        for split in splits.values():
            split.fetch_index()
        empty = StreamSplit(f"{url}/val", 0, None)
        if self.decode == "gpu":
            counts = {name: int(entry.get("not_jpeg", 0)) for name, entry in self.record["splits"].items()}
            train = EncodedStream(splits["train"], self.train_pipeline(), counts["train"])
            val = EncodedStream(splits.get("val", empty), self.eval_pipeline(), counts.get("val", 0))
            warn_not_jpeg(train, val, self.data_dir)
        else:
            train = StreamImages(splits["train"], self.train_transform())
            val = StreamImages(splits.get("val", empty), self.val_transform())
        self.train_set, self.val_set = train, val
        self.test_set = self.val_set
