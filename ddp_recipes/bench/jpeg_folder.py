"""Real-size synthetic JPEGs: what ``bench loader --synthetic`` and gpu-check's ``decode-gpu`` check decode.

    python -m ddp_recipes.bench.jpeg_folder OUT_DIR --train 2048 --val 256 [--classes 4]

ImageNet's training images are about 400 x 350 px on average (most 500 x 375 or 375 x 500) and about 110 KB
as JPEG; decode cost grows with the pixels and the entropy of the file. These are 500 x 375 px give or take
(both orientations and a few of ImageNet's other common sizes, so batches hold images of different sizes), a
smooth colour field with fine texture blended in, baseline JPEG quality 90: about 65 KB each. Labels are
arbitrary (the class folders exist for the ImageFolder layout). Deterministic for a seed.
"""

from __future__ import annotations

import argparse
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from ddp_recipes.config.cli import FlagParser, fail

PROG = "python -m ddp_recipes.bench.jpeg_folder"

# (width, height) of the files, cycled: ImageNet's common sizes around 500 x 375.
SIZES = ((500, 375), (375, 500), (500, 333), (500, 400), (333, 500), (500, 500))
QUALITY = 90
PARALLEL_FROM = 256  # fewer files than this are written in this process (a pool costs more to start)


def _write(job: tuple[str, int, int]) -> None:
    import numpy as np
    from PIL import Image

    path, index, seed = job
    width, height = SIZES[index % len(SIZES)]
    rng = np.random.default_rng([seed, index])
    field = Image.fromarray(rng.integers(0, 256, (height // 24 + 2, width // 24 + 2, 3), dtype=np.uint8))
    texture = Image.fromarray(rng.integers(0, 256, (height // 2 + 1, width // 2 + 1, 3), dtype=np.uint8))
    image = Image.blend(field.resize((width, height), Image.BICUBIC), texture.resize((width, height), Image.BILINEAR),
                        0.25)
    image.save(path, format="JPEG", quality=QUALITY)


def write_jpegs(root: str | os.PathLike, count: int, classes: int = 2, seed: int = 0, start: int = 0) -> Path:
    """``count`` JPEGs under ``root/<class>/`` (``c0``, ``c1``, ...), file ``i`` in class ``i % classes``."""
    root = Path(root)
    for c in range(classes):
        (root / f"c{c}").mkdir(parents=True, exist_ok=True)
    jobs = [(os.fspath(root / f"c{i % classes}" / f"{i:06d}.jpg"), start + i, seed) for i in range(count)]
    if count < PARALLEL_FROM:
        for job in jobs:
            _write(job)
    else:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        with ProcessPoolExecutor(max_workers=max(1, min(cpus, 16))) as pool:
            list(pool.map(_write, jobs, chunksize=32))
    return root


def write_image_folder(root: str | os.PathLike, train: int, val: int, classes: int = 2, seed: int = 0) -> Path:
    """An ImageFolder tree ``root/{train,val}/<class>/*.jpg`` for the recipe's ``--data imagefolder``."""
    root = Path(root)
    write_jpegs(root / "train", train, classes, seed)
    write_jpegs(root / "val", val, classes, seed, start=train)  # other files than train's
    return root


def main(argv: list[str] | None = None) -> int:
    p = FlagParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir")
    p.add_argument("--train", type=int, default=2048)
    p.add_argument("--val", type=int, default=256)
    p.add_argument("--classes", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.train < args.classes or args.val < args.classes or args.classes < 1:
        fail("--train and --val need at least one image per class (--classes >= 1)", PROG)
    write_image_folder(args.out_dir, args.train, args.val, args.classes, args.seed)
    print(f"wrote {args.train} + {args.val} JPEGs under {args.out_dir}/{{train,val}}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
