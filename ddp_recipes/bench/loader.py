"""``python -m ddp_recipes.bench loader``: can the CPUs decode images as fast as the GPUs train on them?

    python -m ddp_recipes.bench loader --data-dir /data/imagenet/train --workers 0,2,4,8 --image-size 224
    python -m ddp_recipes.bench loader --data-dir DIR --decode pil,tensor --target-images-per-s 3000

Measures images/s of the recipe's ImageFolder training pipeline (decode, RandomResizedCrop, flip, to float,
normalize; batches collated) on real image files, per DataLoader worker count and per decode path:

* ``pil``: PIL decodes (the recipe's ``ImageFolderDataModule``, torchvision's default loader);
* ``tensor``: ``torchvision.io.decode_image`` on the file's bytes, the same transforms on uint8 tensors;
* ``--gpu-decode`` (CUDA only): workers read bytes, the main process decodes the batch on the GPU with
  ``torchvision.io.decode_jpeg(..., device="cuda", mode=RGB)`` and transforms it there (files named
  .jpg/.jpeg). A file nvJPEG rejects (ImageNet holds PNG and CMYK files named ``.JPEG``) is decoded on the
  CPU instead and moved to the GPU; the row counts these ``cpu_fallbacks``.

Each (path, workers) cell is measured ``--repeats`` times, interleaved; the report gives the median and
range, images/s per worker, and with ``--target-images-per-s`` (e.g. one GPU's training rate x GPUs per
node) the workers each path needs. Worker start-up and the first batch are not in the rate; the time to
the first batch is reported apart: it is what ``persistent_workers=True`` (the pack's loaders) saves at
every epoch after the first.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from ddp_recipes.config.cli import fail

PROG = "python -m ddp_recipes.bench loader"
DECODERS = ("pil", "tensor")
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png")


class _BytesFolder(Dataset):
    """(file bytes as a uint8 tensor, label) of an ImageFolder's samples: decoding happens elsewhere."""

    def __init__(self, samples: list[tuple[str, int]], transform: Any = None, decode: bool = False) -> None:
        self.samples, self.transform, self.decode = samples, transform, decode

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        from torchvision.io import ImageReadMode, decode_image, read_file

        path, label = self.samples[index]
        data = read_file(path)
        if not self.decode:
            return data, label
        image = decode_image(data, mode=ImageReadMode.RGB)
        return (self.transform(image) if self.transform else image), label


def _keep_list(batch: list) -> tuple[list, torch.Tensor]:
    return [item[0] for item in batch], torch.tensor([item[1] for item in batch])


def train_transform(image_size: int):
    """The recipe's ImageFolder training transform (the same object on PIL images and uint8 tensors)."""
    from ddp_recipes.data.images import imagenet_train_transform

    return imagenet_train_transform(image_size)


def build_loader(root: Path, decode: str, workers: int, batch_size: int, image_size: int) -> DataLoader:
    from torchvision import datasets

    folder = datasets.ImageFolder(os.fspath(root), transform=train_transform(image_size))
    if decode == "pil":
        dataset: Dataset = folder
    elif decode == "gpu":  # nvJPEG decodes JPEGs only
        jpegs = [(path, label) for path, label in folder.samples if path.lower().endswith((".jpg", ".jpeg"))]
        dataset = _BytesFolder(jpegs)
    else:
        dataset = _BytesFolder(folder.samples, train_transform(image_size), decode=True)
    collate = _keep_list if decode == "gpu" else None
    return DataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers=workers, collate_fn=collate,
                      persistent_workers=False, drop_last=True, generator=torch.Generator().manual_seed(0))


def decode_one(data: torch.Tensor, device: str | torch.device, jpeg_decoder: Callable[..., Any]) -> tuple[torch.Tensor, bool]:
    """One file's bytes as an RGB uint8 image on ``device``, and whether it needed the CPU fallback:
    ``jpeg_decoder`` (nvJPEG) first; a file it rejects is decoded by ``decode_image`` on the CPU."""
    from torchvision.io import ImageReadMode, decode_image

    try:
        return jpeg_decoder(data, device=device, mode=ImageReadMode.RGB), False
    except (RuntimeError, ValueError):  # torchvision's "Not a JPEG file", nvJPEG's unsupported layouts
        return decode_image(data, mode=ImageReadMode.RGB).to(device), True


class GpuDecoder:
    """Decodes a batch of file bytes on the GPU and applies the training transform there.

    The whole batch goes to nvJPEG in one call; when that call rejects a file, the batch is decoded file
    by file (:func:`decode_one`) so one PNG named ``.JPEG`` costs one CPU decode, not the sweep.
    ``fallbacks`` counts the files decoded on the CPU.
    """

    def __init__(self, transform: Any, device: str | torch.device = "cuda",
                 jpeg_decoder: Callable[..., Any] | None = None) -> None:
        from torchvision.io import decode_jpeg

        self.transform, self.device = transform, device
        self.jpeg_decoder = jpeg_decoder or decode_jpeg
        self.fallbacks = 0

    def decode(self, datas: list[torch.Tensor]) -> list[torch.Tensor]:
        from torchvision.io import ImageReadMode

        try:
            # RGB: ImageNet holds grayscale and CMYK JPEGs, which would otherwise decode to 1 or 4 channels.
            return list(self.jpeg_decoder(datas, device=self.device, mode=ImageReadMode.RGB))
        except (RuntimeError, ValueError):
            images = []
            for data in datas:
                image, fell_back = decode_one(data, self.device, self.jpeg_decoder)
                images.append(image)
                self.fallbacks += fell_back
            return images

    def __call__(self, datas: list[torch.Tensor]) -> torch.Tensor:
        batch = torch.stack([self.transform(img) for img in self.decode(datas)])
        if torch.device(self.device).type == "cuda":
            torch.cuda.synchronize()
        return batch


def measure(loader: DataLoader, batches: int, gpu_decoder: GpuDecoder | None = None) -> tuple[float, float]:
    """(images/s over ``batches`` batches in steady state, seconds to the first batch). The second is what
    starting the workers costs, at every epoch unless ``persistent_workers`` keeps them.

    When the first batch arrives, the workers already have up to ``prefetch_factor`` batches each in
    flight; the clock starts only after those, so the rate is what the pipeline sustains, not a head start.
    """
    in_flight = (loader.prefetch_factor or 0) * loader.num_workers if loader.num_workers else 0
    began = time.perf_counter()
    it = iter(loader)
    images, first, start = 0, None, None
    for i in range(1 + in_flight + batches):
        try:
            x, _ = next(it)
        except StopIteration:
            break
        if gpu_decoder is not None:
            x = gpu_decoder(x)
        if i == 0:
            first = time.perf_counter()
        if i == in_flight:
            start = time.perf_counter()
            continue
        if start is not None:
            images += len(x)
    seconds = time.perf_counter() - start if start is not None else 0.0
    return (images / seconds if images and seconds > 0 else 0.0), (first or began) - began


def run(args: argparse.Namespace) -> dict[str, Any]:
    root = Path(args.data_dir)
    decoders = [d for d in args.decode.split(",") if d] + (["gpu"] if args.gpu_decode else [])
    cells = [(d, w) for d in decoders for w in args.workers]
    measured: dict[tuple[str, int], list[tuple[float, float]]] = {cell: [] for cell in cells}
    # One decoder per cell: each counts the files of its own cell that fell back to the CPU.
    gpu_decoders = {cell: GpuDecoder(train_transform(args.image_size)) for cell in cells if cell[0] == "gpu"}
    for round_no in range(args.repeats):
        for decode, workers in (cells if round_no % 2 == 0 else cells[::-1]):
            print(f"round {round_no + 1}: {decode:<6} {workers} worker(s) ...", file=sys.stderr, flush=True)
            loader = build_loader(root, decode, workers, args.batch_size, args.image_size)
            measured[(decode, workers)].append(
                measure(loader, args.batches, gpu_decoders.get((decode, workers))))
    rows = []
    for (decode, workers), results in measured.items():
        rates = [rate for rate, _ in results]
        median = statistics.median(rates)
        row = {"decode": decode, "workers": workers, "images_per_s": round(median, 1),
               "range": [round(min(rates), 1), round(max(rates), 1)], "repeats": len(rates),
               "images_per_s_per_worker": round(median / max(1, workers), 1),
               "first_batch_s": round(statistics.median(first for _, first in results), 3)}
        if (decode, workers) in gpu_decoders:
            row["cpu_fallbacks"] = gpu_decoders[(decode, workers)].fallbacks  # over the cell's rounds
        if args.target_images_per_s:
            per_worker = median / max(1, workers) if workers else median
            row["workers_for_target"] = math.ceil(args.target_images_per_s / per_worker) if per_worker else None
        rows.append(row)
    return {"data_dir": os.fspath(root), "images": len(build_loader(root, "pil", 0, 1, args.image_size).dataset),
            "batch_size": args.batch_size, "image_size": args.image_size, "batches": args.batches,
            "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "target_images_per_s": args.target_images_per_s, "rows": rows}


def format_rows(result: dict[str, Any]) -> str:
    target = result.get("target_images_per_s")
    lines = [f"{result['images']} images under {result['data_dir']}, batch {result['batch_size']}, "
             f"{result['image_size']} px, {result['usable_cpus']} usable CPUs", "",
             "| decode | workers | images/s (median) | range | per worker | first batch s |"
             + (" workers for target |" if target else ""),
             "| --- | ---: | ---: | --- | ---: | ---: |" + (" ---: |" if target else "")]
    for r in result["rows"]:
        lines.append(f"| {r['decode']} | {r['workers']} | {r['images_per_s']} | {r['range'][0]}-{r['range'][1]} | "
                     f"{r['images_per_s_per_worker']} | {r['first_batch_s']} |"
                     + (f" {r.get('workers_for_target')} |" if target else ""))
    fallbacks = {r["workers"]: r["cpu_fallbacks"] for r in result["rows"] if r.get("cpu_fallbacks")}
    if fallbacks:
        lines += ["", "GPU decode: files nvJPEG rejected were decoded on the CPU instead (counted over the "
                      "cell's rounds): " + ", ".join(f"{w} worker(s): {n}" for w, n in fallbacks.items())]
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    class OneLine(argparse.ArgumentParser):
        def error(self, message: str) -> Any:  # type: ignore[override]
            fail(message, PROG)

    p = OneLine(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", required=True, help="an ImageFolder tree: <dir>/<class>/<image> (e.g. .../train)")
    p.add_argument("--workers", default="0,1,2,4", help="comma list of DataLoader worker counts")
    p.add_argument("--decode", default="pil,tensor", help="comma list of decode paths: pil, tensor")
    p.add_argument("--gpu-decode", action="store_true", help="also decode JPEGs on the GPU (needs CUDA)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--image-size", type=int, default=224, help="RandomResizedCrop output side")
    p.add_argument("--batches", type=int, default=20, help="timed batches per cell (after one untimed)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds per cell (median reported)")
    p.add_argument("--target-images-per-s", type=float, default=0.0,
                   help="images/s the node's GPUs train on: report the workers each path needs")
    p.add_argument("--out", default="bench-results/loader.json")
    return p


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
    if args.gpu_decode and not torch.cuda.is_available():
        fail("--gpu-decode needs a CUDA GPU (none is visible); drop the flag", PROG)
    for name in ("batch_size", "image_size", "batches", "repeats"):
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(args, name)})", PROG)
    root = Path(args.data_dir)
    if not root.is_dir():
        fail(f"--data-dir {root} is not a folder; pass an ImageFolder tree (<dir>/<class>/<image>)", PROG)
    classes = [d for d in root.iterdir() if d.is_dir()]
    found = sum(1 for c in classes for f in c.iterdir() if f.suffix.lower() in IMAGE_EXTENSIONS)
    if not classes or found < args.batch_size * 2:
        fail(f"--data-dir {root} holds {found} image(s) in {len(classes)} class folder(s); it needs class folders "
             f"with at least 2 x --batch-size ({2 * args.batch_size}) images", PROG)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    validate(args)
    result = run(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(format_rows(result))
    print(f"wrote {out}")
    return 0
