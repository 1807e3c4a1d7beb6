"""``python -m ddp_recipes.bench loader``: can the CPUs decode images as fast as the GPUs train on them?

    python -m ddp_recipes.bench loader --data-dir /data/imagenet/train --workers 0,2,4,8 --image-size 224
    python -m ddp_recipes.bench loader --synthetic 1024 --workers 0,1,2 --decode pil,gpu
    python -m ddp_recipes.bench loader --data-dir DIR --decode tensor,gpu --decoders torchcodec,torchvision
    python -m ddp_recipes.bench loader --data-dir SRC/train --stream s3://bucket/SRC --doc docs/benchmark.md

Images/s of the recipe's ImageFolder training pipeline on real files or ``--synthetic N`` real-size JPEGs, per
DataLoader worker count, decode path (``pil``; ``tensor``: ``decode_image`` then the same transforms on uint8;
``gpu``: the recipe's ``--decode gpu``, on ``--device``, whose CPU stand-in rows say ``gpu (on cpu)``), decoder
library (``--decoders``) and source (``--stream DEST``: the same images as a stream, cold then warm from a
bucket). Cells are interleaved ``--repeats`` times; the report gives median and range, images/s per worker, the
workers each path needs for ``--target-images-per-s``, and the time to the first batch apart (what
``persistent_workers=True`` saves each epoch). docs/benchmark.md explains each row.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from ddp_recipes.bench.cli import measuring_args
from ddp_recipes.config.cli import fail
from ddp_recipes.data.decoders import LIBRARIES, image_decoders
from ddp_recipes.data.device_decode import DeviceDecoder
from ddp_recipes.errors import ConfigError

PROG = "python -m ddp_recipes.bench loader"
DECODERS = ("pil", "tensor", "gpu")
SYNTHETIC_CLASSES = 4
BEGIN, END = "<!-- bench-loader:begin -->", "<!-- bench-loader:end -->"


class _TensorFolder(Dataset):
    """An ImageFolder's samples decoded by ``library``'s ``decode_image`` (RGB), then ``transform``."""

    def __init__(self, samples: list[tuple[str, int]], transform: Any, library: str) -> None:
        self.samples, self.transform, self.library = samples, transform, library

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        path, label = self.samples[index]
        return self.transform(image_decoders(self.library).decode_image(path, mode="RGB")), label


def train_transform(image_size: int):
    """The recipe's ImageFolder training transform (the same object on PIL images and uint8 tensors)."""
    from ddp_recipes.data.images import imagenet_train_transform

    return imagenet_train_transform(image_size)


def folder_dataset(root: Path, decode: str, image_size: int, library: str | None = None) -> Dataset:
    """The ImageFolder's training samples as the ``decode`` path reads them (``tensor``: with ``library``)."""
    from torchvision import datasets

    from ddp_recipes.data.encoded import EncodedImageFolder, TrainPipeline

    folder = datasets.ImageFolder(os.fspath(root), transform=train_transform(image_size))
    if decode == "pil":
        return folder
    if decode == "gpu":  # the recipe's --decode gpu: bytes and draws here, the decode on the device
        return EncodedImageFolder(folder.samples, TrainPipeline(image_size))
    return _TensorFolder(folder.samples, train_transform(image_size), library or image_decoders().name)


def stream_dataset(stream: str, decode: str, image_size: int, cache: str | None) -> Dataset:
    """The recipe's ``--data stream`` training set over ``stream``, a bucket's chunks downloaded into ``cache``."""
    from ddp_recipes.data.stream import StreamImageDataModule

    data = StreamImageDataModule(stream, image_size=image_size, decode="gpu" if decode == "gpu" else "cpu",
                                 cache=cache)
    data.setup("fit")
    return data.train_set


def build_loader(dataset: Dataset, workers: int, batch_size: int, pin_memory: bool = False) -> DataLoader:
    # The same seed for every loader: a cell's passes read the same samples in the same order.
    return DataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers=workers,
                      collate_fn=getattr(dataset, "collate", None), pin_memory=pin_memory, persistent_workers=False,
                      drop_last=True, prefetch_factor=PREFETCH if workers else None,
                      generator=torch.Generator().manual_seed(0))


PREFETCH = 2  # batches in flight per worker (torch's default), skipped untimed by measure()


class GpuDecoder:
    """The ``gpu`` path's main-process side: an :class:`~ddp_recipes.data.encoded.EncodedBatch` to ``device``,
    decoded and augmented there (:class:`~ddp_recipes.data.device_decode.DeviceDecoder`); on CUDA each batch is
    waited for, so that the rate is the decode's own, not the launch's. ``fallbacks``: files decoded on the CPU.
    ``library``: whose ``decode_jpeg`` (:mod:`ddp_recipes.data.decoders`; default: the recipe's)."""

    def __init__(self, device: str | torch.device, library: str | None = None) -> None:
        self.device = torch.device(device)
        self.decoder = DeviceDecoder(jpeg_decoder=image_decoders(library).decode_jpeg)

    @property
    def fallbacks(self) -> int:
        return self.decoder.fallbacks

    def __call__(self, batch: Any) -> torch.Tensor:
        images, _ = self.decoder(batch.to(self.device))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return images


def measure(loader: DataLoader, batches: int, gpu_decoder: GpuDecoder | None = None,
            drain: bool = False) -> tuple[float, float, int]:
    """(images/s over ``batches`` batches in steady state, seconds to the first batch, images timed). The second
    is what starting the workers costs, at every epoch unless ``persistent_workers`` keeps them.

    When the first batch arrives, the workers already have up to ``prefetch_factor`` batches each in
    flight; the clock starts only after those, so the rate is what the pipeline sustains, not a head start.
    """
    in_flight = (loader.prefetch_factor or 0) * loader.num_workers if loader.num_workers else 0
    # (validate sized the folder for this: PREFETCH is the loader's prefetch_factor)
    began = time.perf_counter()
    it = iter(loader)
    images, first, start = 0, None, None
    for i in range(1 + in_flight + batches):
        try:
            batch = next(it)
        except StopIteration:
            break
        x = gpu_decoder(batch) if gpu_decoder is not None else batch[0]
        if i == 0:
            first = time.perf_counter()
        if i == in_flight:
            start = time.perf_counter()
            continue
        if start is not None:
            images += len(x)
    seconds = time.perf_counter() - start if start is not None else 0.0
    if not images or seconds <= 0:  # never a 0 reported as a rate
        raise RuntimeError(f"bench loader timed no batch (the loader gave {i + 1} of {1 + in_flight + batches})")
    for _ in range(in_flight if drain else 0):  # untimed: every sample the workers were sent is read
        next(it, None)
    return images / seconds, (first or began) - began, images


def gpu_device(args: argparse.Namespace) -> torch.device:
    """Where the ``gpu`` path decodes: ``--device``, or CUDA when there is one (``--gpu-decode``: CUDA)."""
    if args.device == "auto":
        return torch.device("cuda" if args.gpu_decode or torch.cuda.is_available() else "cpu")
    return torch.device(args.device)


def decode_label(decode: str, device: str | None) -> str:
    """The row's path name; the ``gpu`` path on a CPU says so."""
    return f"gpu (on {device})" if decode == "gpu" and device == "cpu" else decode


def run(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    from ddp_recipes.data.stream import cached_chunks
    from ddp_recipes.storage import Url, absolute
    from ddp_recipes.storage.store import cache_dir

    decoders = list(dict.fromkeys([d for d in args.decode.split(",") if d] + (["gpu"] if args.gpu_decode else [])))
    device = gpu_device(args)
    # The recipe reads a stream's bytes with PIL (--decode cpu) or decode_jpeg (--decode gpu): no tensor path.
    # The decoder library is a cell's dimension where it decodes (pil: Pillow, no library).
    cells = [(s, d, lib, w) for s in ["folder"] + (["stream"] if args.stream else []) for d in decoders
             for lib in (args.decoders if d != "pil" else [None]) for w in args.workers
             if s == "folder" or d != "tensor"]
    remote = bool(args.stream) and isinstance(absolute(args.stream), Url)
    passes = {"folder": [None], "stream": ["cold", "warm"] if remote else [None]}
    measured: dict[tuple, list[tuple]] = {(s, c, d, lib, w): [] for s, d, lib, w in cells for c in passes[s]}
    # One decoder per row: each counts the files of its own row that fell back to the CPU.
    gpu_decoders = {key: GpuDecoder(device, key[3]) for key in measured if key[2] == "gpu"}
    load_start = round(os.getloadavg()[0], 2)
    for round_no in range(args.repeats):
        for source, decode, library, workers in (cells if round_no % 2 == 0 else cells[::-1]):
            print(f"round {round_no + 1}: {source:<6} {decode:<6} {library or '':<11} {workers} worker(s) ...",
                  file=sys.stderr, flush=True)
            # Cold: an empty cache each round, what a new node or a job restarted after preemption meets. Warm:
            # a second loader with the same seed reads the same samples from what the cold pass downloaded.
            with (tempfile.TemporaryDirectory(prefix="bench-stream-", dir=cache_dir()) if remote and source == "stream"
                  else contextlib.nullcontext()) as cache:
                for cache_pass in passes[source]:
                    dataset = (folder_dataset(root, decode, args.image_size, library) if source == "folder" else
                               stream_dataset(args.stream, decode, args.image_size, cache))
                    loader = build_loader(dataset, workers, args.batch_size,
                                          pin_memory=decode == "gpu" and device.type == "cuda")
                    key, before = (source, cache_pass, decode, library, workers), cached_chunks(cache)
                    # The cold pass drains its workers, so the warm one, sent no sample beyond those, fetches none.
                    timed = measure(loader, args.batches, gpu_decoders.get(key), drain=cache_pass == "cold")
                    measured[key].append((*timed, *(a - b for a, b in zip(cached_chunks(cache), before, strict=True))))
    rows = []
    for (source, cache_pass, decode, library, workers), results in measured.items():
        rates = [rate for rate, *_ in results]
        median = statistics.median(rates)
        row = {"source": source, "cache": cache_pass, "decode": decode, "decoder": library, "workers": workers,
               "images_per_s": round(median, 1), "range": [round(min(rates), 1), round(max(rates), 1)],
               "repeats": len(rates), "images_timed": [r[2] for r in results],
               "images_per_s_rounds": [round(rate, 1) for rate in rates],  # paired across cells by round
               "images_per_s_per_worker": round(median / max(1, workers), 1),
               "first_batch_s": round(statistics.median(r[1] for r in results), 3)}
        if cache_pass:
            row.update(chunks_fetched=[r[3] for r in results], fetched_bytes=[r[4] for r in results])
        if (source, cache_pass, decode, library, workers) in gpu_decoders:
            # The decode runs in the main process: a worker only reads bytes and draws, so no per-worker rate.
            row.update(device=str(device), images_per_s_per_worker=None,  # fallbacks: over the row's rounds
                       cpu_fallbacks=gpu_decoders[(source, cache_pass, decode, library, workers)].fallbacks)
        if args.target_images_per_s and decode != "gpu":
            per_worker = median / max(1, workers) if workers else median
            row["workers_for_target"] = math.ceil(args.target_images_per_s / per_worker) if per_worker else None
        rows.append(row)
    return {"command": " ".join([PROG, *measuring_args(getattr(args, "command_argv", []))]),
            "started": time.strftime("%Y-%m-%d"), "load_average": [load_start, round(os.getloadavg()[0], 2)],
            "data_dir": os.fspath(root) if args.data_dir else None, "synthetic": args.synthetic or None,
            "stream": args.stream, "decoders": args.decoders,
            "images": len(folder_dataset(root, "pil", args.image_size)),
            "batch_size": args.batch_size, "image_size": args.image_size, "batches": args.batches,
            "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "target_images_per_s": args.target_images_per_s, "rows": rows}


def source_label(row: dict[str, Any]) -> str:
    return row["source"] + (f", {row['cache']} cache" if row.get("cache") else "")


def format_rows(result: dict[str, Any]) -> str:
    target, remote = result.get("target_images_per_s"), any(r.get("cache") for r in result["rows"])
    where = (f"{result['images']} synthetic JPEGs (about 500 x 375, made by the bench)" if result.get("synthetic")
             else f"{result['images']} images under {result['data_dir']}")
    lines = [f"Generated by `{result['command']}` ({result['started']}; 1-minute load average "
             f"{result['load_average'][0]} at start, {result['load_average'][1]} at end): {where}, batch "
             f"{result['batch_size']}, {result['image_size']} px, {result['usable_cpus']} usable CPUs, "
             f"{result['torch_threads']} torch thread(s) in the main process (a worker has 1)"
             + (f"; stream: the same images converted, at {result['stream']}" if result.get("stream") else ""), ""]
    if remote:
        lines += ["Cold cache: each round starts from an empty download cache, as a new node or a job restarted after "
                  "preemption does; warm: right after, a loader with the same seed reads the same samples again from "
                  "the chunks the cold pass downloaded. Chunks fetched (MB): the median per round.", ""]
    lines += ["| source | decode | decoder | workers | images/s (median) | range | per worker | first batch s |"
              + (" chunks fetched (MB) |" if remote else "") + (" workers for target |" if target else ""),
              "| --- | --- | --- | ---: | ---: | --- | ---: | ---: |" + (" ---: |" if remote else "")
              + (" ---: |" if target else "")]
    for r in result["rows"]:
        per_worker = r["images_per_s_per_worker"] if r["images_per_s_per_worker"] is not None else "-"
        fetch = (f" {statistics.median(r['chunks_fetched']):g} ({statistics.median(r['fetched_bytes']) / 1e6:.1f}) |"
                 if r.get("cache") else " - |") if remote else ""
        lines.append(f"| {source_label(r)} | {decode_label(r['decode'], r.get('device'))} | {r.get('decoder') or '-'} "
                     f"| {r['workers']} | "
                     f"{r['images_per_s']} | {r['range'][0]}-{r['range'][1]} | {per_worker} | {r['first_batch_s']} |"
                     + fetch + (f" {r.get('workers_for_target', '-')} |" if target else ""))
    gpu = [r for r in result["rows"] if r["decode"] == "gpu"]
    if gpu and gpu[0].get("device") == "cpu":
        lines += ["", "gpu (on cpu): the recipe's --decode gpu path with the CPU decode_jpeg in the main "
                      "process (no CUDA here): it measures that path on this CPU, not nvJPEG on a GPU"]
    fallbacks = {f"{source_label(r)}, {r['decoder']}, {r['workers']}": r["cpu_fallbacks"] for r in gpu
                 if r.get("cpu_fallbacks")}
    if fallbacks:
        lines += ["", "gpu: files decode_jpeg refused were decoded on the CPU instead (counted over the cell's "
                      "rounds): " + ", ".join(f"{w} worker(s): {n}" for w, n in fallbacks.items())]
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``bench loader``."""
    p.add_argument("--data-dir", help="an ImageFolder tree: <dir>/<class>/<image> (e.g. .../train)")
    p.add_argument("--synthetic", type=int, default=0,
                   help="instead of --data-dir: this many real-size synthetic JPEGs (about 500 x 375) the bench writes")
    p.add_argument("--workers", default="0,1,2,4", help="comma list of DataLoader worker counts")
    p.add_argument("--decode", default="pil,tensor,gpu", help="comma list of decode paths: pil, tensor, gpu")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="where the gpu path decodes (auto: CUDA when there is one, else the CPU, labelled so)")
    p.add_argument("--gpu-decode", action="store_true", help="also the gpu path, on CUDA (needs CUDA)")
    p.add_argument("--decoders", default="auto",
                   help="comma list of the libraries the tensor and gpu paths decode with: torchcodec, torchvision "
                        "(auto: both where torchcodec is installed, else torchvision)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--image-size", type=int, default=224, help="RandomResizedCrop output side")
    p.add_argument("--batches", type=int, default=20, help="timed batches per cell (after one untimed)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds per cell (median reported)")
    p.add_argument("--target-images-per-s", type=float, default=0.0,
                   help="images/s the node's GPUs train on: report the workers each CPU path needs")
    p.add_argument("--stream", default="",
                   help="also the same images as a stream (python -m ddp_recipes.data.convert's DEST: a folder or "
                        "s3://bucket/prefix), timed beside --data-dir; a bucket's from a cold and a warm cache")
    p.add_argument("--out", default="bench-results/loader.json")
    p.add_argument("--doc", default="", help=f"a markdown file whose {BEGIN} ... {END} block gets the table")


def validate(args: argparse.Namespace) -> None:
    try:
        args.workers = sorted({int(w) for w in args.workers.split(",") if w.strip()})
    except ValueError:
        fail(f"--workers must be a comma list of integers such as 0,2,4 (got {args.workers!r})", PROG)
    if not args.workers or args.workers[0] < 0:
        fail(f"--workers needs counts >= 0 (got {args.workers})", PROG)
    chosen = [d for d in args.decode.split(",") if d]
    bad = [d for d in chosen if d not in DECODERS]
    if bad:
        fail(f"--decode takes {', '.join(DECODERS)} (got {', '.join(bad)})", PROG)
    if not chosen and not args.gpu_decode:
        fail(f"--decode names no decode path; give one or more of {', '.join(DECODERS)} (or --gpu-decode)", PROG)
    args.decoders = _libraries(args.decoders)
    cuda_asked = args.gpu_decode or args.device == "cuda"
    if cuda_asked and not torch.cuda.is_available():
        flag = "--gpu-decode" if args.gpu_decode else "--device cuda"
        fail(f"{flag} needs a CUDA GPU (none is visible); drop it (--decode gpu then runs on the CPU, labelled so)",
             PROG)
    if args.gpu_decode and args.device == "cpu":
        fail("--gpu-decode decodes on CUDA; drop --device cpu (or --gpu-decode, and give --decode gpu)", PROG)
    for name in ("batch_size", "image_size", "batches", "repeats"):
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(args, name)})", PROG)
    if (args.data_dir is None) == (not args.synthetic):
        fail("give --data-dir DIR (an ImageFolder tree) or --synthetic N (real-size JPEGs the bench writes), "
             "one of them", PROG)
    if args.stream and args.synthetic:
        fail("--stream is timed beside the images it was converted from: pass them as --data-dir (SRC/train of "
             "python -m ddp_recipes.data.convert SRC DEST), not --synthetic", PROG)
    if args.doc and not (Path(args.doc).is_file() and all(m in Path(args.doc).read_text() for m in (BEGIN, END))):
        fail(f"--doc {args.doc} is not a file with a {BEGIN} ... {END} block; add the two markers where the table "
             "goes", PROG)
    # One epoch must hold every batch the clock skips (the first, and what the workers have in flight then)
    # and every timed one: fewer, and the rate would be of a short tail, or 0.
    skipped = 1 + PREFETCH * max(args.workers)
    needed = (skipped + args.batches) * args.batch_size
    why = (f"{skipped} untimed batch(es) (the first, and {PREFETCH} in flight per worker at --workers "
           f"{max(args.workers)}) and --batches {args.batches} timed ones of --batch-size {args.batch_size}: "
           f"{needed} images; pass fewer --batches, a smaller --batch-size or fewer --workers")
    if args.synthetic:
        if args.synthetic < needed:
            fail(f"--synthetic {args.synthetic} is too few images: one epoch must hold {why}", PROG)
        return
    root = Path(args.data_dir)
    if not root.is_dir():
        fail(f"--data-dir {root} is not a folder; pass an ImageFolder tree (<dir>/<class>/<image>)", PROG)
    from torchvision.datasets.folder import IMG_EXTENSIONS  # ImageFolder's and the converter's

    classes = [d for d in root.iterdir() if d.is_dir()]
    found = sum(1 for c in classes for f in c.iterdir() if f.name.lower().endswith(IMG_EXTENSIONS))
    if not classes or found < needed:
        fail(f"--data-dir {root} holds {found} image(s) in {len(classes)} class folder(s); one epoch must hold "
             f"{why}", PROG)
    if args.stream:
        from ddp_recipes.data.litdata_lib import import_litdata
        from ddp_recipes.data.stream import StreamImageDataModule

        try:
            import_litdata("--stream")
            samples = StreamImageDataModule(args.stream).train_size
        except ConfigError as err:
            fail(err.cli({"data_dir": "stream"}), PROG)
        if samples != found:
            fail(f"--stream {args.stream} holds {samples} training images, --data-dir {root} {found}; pass the "
                 "stream converted from --data-dir's images (python -m ddp_recipes.data.convert SRC DEST, with "
                 "--data-dir SRC/train)", PROG)


def _libraries(given: str) -> list[str]:
    """``--decoders`` as a list of :data:`~ddp_recipes.data.decoders.LIBRARIES` that import here."""
    if given == "auto":
        given = ",".join(LIBRARIES) if image_decoders().name == "torchcodec" else "torchvision"
    chosen = list(dict.fromkeys(d for d in given.split(",") if d))
    bad = [d for d in chosen if d not in LIBRARIES]
    if bad or not chosen:
        fail(f"--decoders takes auto or {', '.join(LIBRARIES)} (got {given!r})", PROG)
    if "torchcodec" in chosen:
        try:
            image_decoders("torchcodec")
        except ImportError as error:
            from ddp_recipes.extras import install_hint

            fail(f"--decoders torchcodec: {error}; {install_hint('decode', 'torchcodec')}, or drop it", PROG)
    return chosen


def run_command(args: argparse.Namespace) -> int:
    """``bench loader``: measure every (decode path, workers) cell, write the JSON, print the table."""
    validate(args)
    with tempfile.TemporaryDirectory(prefix="bench-loader-") as tmp:
        if args.synthetic:
            from ddp_recipes.bench.jpeg_folder import write_jpegs

            print(f"writing {args.synthetic} synthetic JPEGs ...", file=sys.stderr, flush=True)
            root = write_jpegs(Path(tmp) / "images", args.synthetic, classes=SYNTHETIC_CLASSES)
        else:
            root = Path(args.data_dir)
        result = run(args, root)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(format_rows(result))
    if args.doc:
        from ddp_recipes.bench.cli import rewrite_doc

        rewrite_doc(Path(args.doc), format_rows(result), BEGIN, END)
    print(f"wrote {out}" + (f" and the table in {args.doc}" if args.doc else ""))
    return 0
