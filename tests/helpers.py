"""Small helpers shared by the tests."""

from __future__ import annotations

import contextlib
import os
import re
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# The real mini-MNIST that tests and CI use (never written to): the repository's sibling folder
# ../shared/data, or the folder DDP_RECIPES_SHARED_DATA names. DDP_RECIPES_SHARED_DATA=none hides it, as on the
# lent GPU machine (only the working tree travels): `make test-stack` runs so, and every test that reads it
# must then skip with its reason (or write made-up digits in its format: write_synthetic_mnist).
SHARED_DATA_ENV = "DDP_RECIPES_SHARED_DATA"


def _shared_data() -> Path:
    where = os.environ.get(SHARED_DATA_ENV, "").strip()
    if where.lower() == "none":
        return Path(os.devnull) / "shared-data-hidden"  # a path under a file: it can never exist
    return Path(where) if where else Path(__file__).resolve().parents[2] / "shared" / "data"


SHARED_DATA = _shared_data()

# The ResNet recipe's smallest run: synthetic 16 px images, 64 to train on and 32 to validate, on CPU.
RESNET_TINY = ["--accelerator", "cpu", "--data", "synthetic", "--image-size", "16", "--synthetic-samples", "64",
               "--synthetic-val-samples", "32", "--batch-size", "16", "--lr", "0.05"]

# The MNIST recipe on the real mini-MNIST, quiet, on CPU: 125 steps per epoch at 1 device.
MNIST_CPU = ["--data-dir", str(SHARED_DATA), "--accelerator", "cpu", "--no-download", "--no-diagnostics",
             "--logger", "none"]


def last_ckpt(out: Path) -> Path:
    """A recipe run's ``last.ckpt`` in its output folder ``out``."""
    return out / "checkpoints" / "last.ckpt"


def files_of(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` and its bytes: equal before and after means nothing there changed."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def refused_mnist(argv: list[str], capsys: Any) -> str:
    """The one line a refused ``recipes.mnist`` run prints (it must exit 2)."""
    import pytest

    from recipes import mnist

    with pytest.raises(SystemExit) as exc:
        mnist.main(argv)
    err = [line for line in capsys.readouterr().err.strip().splitlines() if line]
    assert exc.value.code == 2 and len(err) == 1, err
    return err[0]


def refusal(main: Any, argv: list[str], capsys: Any, prog: str) -> str:
    """What follows ``prog`` on the last line a refused command prints: ``main(argv)`` must exit 2."""
    import pytest

    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines and lines[-1].startswith(prog), lines
    return lines[-1].removeprefix(prog)


def free_port() -> int:
    """A TCP port that was free a moment ago on localhost."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_mnist_subset(dest: Path, n_train: int, n_test: int) -> Path:
    """Write an MNIST-layout folder holding the first ``n_train`` / ``n_test`` images of the shared data."""
    import numpy as np

    raw_in, raw_out = SHARED_DATA / "MNIST" / "raw", dest / "MNIST" / "raw"
    raw_out.mkdir(parents=True, exist_ok=True)
    for split, count in (("train", n_train), ("t10k", n_test)):
        images = (raw_in / f"{split}-images-idx3-ubyte").read_bytes()
        labels = (raw_in / f"{split}-labels-idx1-ubyte").read_bytes()
        header = np.frombuffer(images[:16], dtype=">i4").copy()
        header[1] = count
        (raw_out / f"{split}-images-idx3-ubyte").write_bytes(header.tobytes() + images[16:16 + count * 784])
        lab_header = np.frombuffer(labels[:8], dtype=">i4").copy()
        lab_header[1] = count
        (raw_out / f"{split}-labels-idx1-ubyte").write_bytes(lab_header.tobytes() + labels[8:8 + count])
    return dest


def write_synthetic_mnist(dest: Path, n_train: int, n_test: int, seed: int = 0) -> Path:
    """Write an MNIST-layout folder of made-up, learnable digits (class k: a bright 7x7 patch at the k-th of ten
    places, over noise) for tests that must not need the shared data: it does not travel to a GPU machine."""
    import numpy as np

    rng = np.random.default_rng(seed)
    raw = dest / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for split, count in (("train", n_train), ("t10k", n_test)):
        labels = rng.integers(0, 10, count, dtype=np.uint8)
        images = rng.integers(0, 60, (count, 28, 28), dtype=np.uint8)
        for i, k in enumerate(labels):
            row, col = divmod(int(k), 5)
            images[i, 3 + 12 * row:10 + 12 * row, 1 + 5 * col:8 + 5 * col] = 255
        header = np.array([2051, count, 28, 28], dtype=">i4").tobytes()
        (raw / f"{split}-images-idx3-ubyte").write_bytes(header + images.tobytes())
        lab_header = np.array([2049, count], dtype=">i4").tobytes()
        (raw / f"{split}-labels-idx1-ubyte").write_bytes(lab_header + labels.tobytes())
    return dest


def cli_text(err: BaseException) -> str:
    """The one line the CLI prints for a library error: parameters spelled as ``--flags``. The library's own
    message names the parameter (``devices``); only the CLI layer turns it into ``--devices``."""
    from ddp_recipes.errors import ConfigError

    return err.cli() if isinstance(err, ConfigError) else str(err)


@contextlib.contextmanager
def raises_cli(exc: type[BaseException], match: str | None = None) -> Iterator[Any]:
    """``pytest.raises`` that matches ``match`` against :func:`cli_text` of the error."""
    import pytest

    with pytest.raises(exc) as info:
        yield info
    text = cli_text(info.value)
    assert match is None or re.search(match, text), f"{match!r} not in {text!r}"


def write_jpeg_tree(root: Path, per_class: int, val_per_class: int = 0, side: int = 24, classes: int = 2,
                    seed: int = 0, subsampling: int = -1) -> Path:
    """An ImageFolder tree of small JPEGs of different sizes (``side`` to 1.5 x ``side`` px each way): smooth
    colour fields, so that JPEG's own noise stays small. ``root/train/<class>`` (and ``root/val`` when
    ``val_per_class``); made here, so it travels with the working tree's tests. ``subsampling``: Pillow's
    (-1: its default, 4:2:0 chroma, as most photographs; 0: 4:4:4)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    for split, n in (("train", per_class), ("val", val_per_class)):
        for c in range(classes if n else 0):
            folder = root / split / f"c{c}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                h, w = (side + int(rng.integers(0, side // 2 + 1)) for _ in range(2))
                field = rng.integers(0, 256, (h // 6 + 2, w // 6 + 2, 3), dtype=np.uint8)
                Image.fromarray(field).resize((w, h), Image.BICUBIC).save(folder / f"{i}.jpg", quality=92,
                                                                            subsampling=subsampling)
    return root


def write_odd_images(folder: Path) -> None:
    """Two files named ``.JPEG`` that nvJPEG refuses: a CMYK JPEG (libjpeg decodes it) and a PNG (only
    ``decode_image`` reads it), as ImageNet holds."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(5)
    field = Image.fromarray(rng.integers(0, 256, (8, 9, 3), dtype=np.uint8)).resize((45, 40), Image.BICUBIC)
    field.convert("CMYK").save(folder / "cmyk.JPEG", format="JPEG", quality=95)
    field.save(folder / "png_in_disguise.JPEG", format="PNG")


def weights(path: str | os.PathLike) -> dict[str, Any]:
    """A checkpoint's ``state_dict``, on CPU, read with ``weights_only=True``: every checkpoint the tests
    compare (the recipes' ``last.ckpt`` and ``final.ckpt``, a user's script's on the library path) holds only
    tensors and plain data, as the pack's own reader requires."""
    import torch

    return torch.load(path, map_location="cpu", weights_only=True)["state_dict"]


def assert_same_weights(a: str | os.PathLike, b: str | os.PathLike) -> None:
    """The two checkpoints hold the same weights bit for bit: the same keys, every tensor ``torch.equal``. The
    failure names the tensors that differ and the largest relative difference among them."""
    import torch

    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    different = [k for k in wa if not torch.equal(wa[k], wb[k])]
    if different:
        worst = max((((wa[k].float() - wb[k].float()).abs().max() / wb[k].float().abs().max().clamp_min(1e-12)).item()
                     for k in different if wa[k].is_floating_point() and wa[k].shape == wb[k].shape), default=0.0)
        raise AssertionError(f"{len(different)} tensors differ (max relative difference {worst:.3g}), "
                             f"e.g. {different[:3]}")


def cpu_trainer(**kwargs: Any) -> Any:
    """A quiet one-device CPU ``lightning.Trainer`` for in-process fits: no logger, no checkpoints, no
    progress bar, no model summary; ``kwargs`` add to those."""
    from lightning import Trainer

    return Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False, **kwargs)


class CodeOnLoad:
    """What a malicious pickle (a ``.ckpt``, a weights file) carries: unpickling it calls ``open(path, "w")``,
    creating the file, so a test sees whether a load ran the file's code."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


# ---- decoders compared: nvJPEG (gpu-check) and its CPU stand-in ----------------------------------------------

DECODE_LEVEL = 1 / 255 / min(0.229, 0.224, 0.225)  # one uint8 level after normalizing


def decode_pipelines() -> dict[str, object]:
    """The pipelines two correct JPEG decoders are compared through: crops, flips, resizing, erasing and
    normalizing move a decoder's level or two of rounding by at most as much. No threshold operation
    (TrivialAugmentWide's Solarize or Posterize turn one level into up to ~134), so a correct decoder cannot
    break the bound; the policies themselves are compared bit for bit on one decoded input
    (tests/data/test_device_decode.py)."""
    from ddp_recipes.data.encoded import EvalPipeline, TrainPipeline

    return {"train": TrainPipeline(32, random_erase=0.5), "eval": EvalPipeline(32)}


def comparison_jpegs(root: Path) -> list[str]:
    """The JPEGs two decoders are compared on (tests/gpu/test_gpu_decode.py and its CPU stand-in): 4:4:4, since
    the comparison is about the pipeline. On 4:2:0 JPEGs nvJPEG repeats each chroma sample where libjpeg-turbo
    interpolates: 3.4 levels mean after the eval pipeline, 4.3 after train's (tests/gpucheck/standin.py), a
    decoder's choice, not a pipeline's error."""
    return sorted(str(p) for p in write_jpeg_tree(root, per_class=8, side=40, subsampling=0).rglob("*.jpg"))


def comparison_files_with_refusals(root: Path) -> list[str]:
    """:func:`comparison_jpegs`' kind of JPEGs (4:4:4) beside two files nvJPEG refuses (:func:`write_odd_images`):
    what tests/gpu/test_gpu_decode.py's fallback test decodes on CUDA and on the CPU, and its stand-in twin."""
    tree = write_jpeg_tree(root, per_class=3, side=40, subsampling=0)
    write_odd_images(tree / "train" / "c0")
    return sorted(str(p) for p in tree.rglob("*.*") if p.is_file())


def decoded_batch(files: list[str], pipeline, device: str, jpeg_decoder=None):
    """The encoded batch of ``files`` (sample seeds of epoch 0), decoded and augmented on ``device``."""
    from ddp_recipes.data.device_decode import DeviceDecoder
    from ddp_recipes.data.encoded import EncodedImageFolder
    from ddp_recipes.data.seeding import sample_seed, seed_all

    dataset = EncodedImageFolder([(f, 0) for f in files], pipeline)
    samples = []
    for i in range(len(files)):
        seed_all(sample_seed(0, 0, i))
        samples.append(dataset[i])
    decoder = DeviceDecoder(channels_last=True, jpeg_decoder=jpeg_decoder)
    x, y = decoder(dataset.collate(samples).to(device))
    return x, y, decoder


def decoders_agree(x, reference) -> tuple[bool, float, float]:
    """Whether two decoders' augmented batches agree as two correct JPEG decoders do: mean difference under 1.5
    levels, none over 48 (another crop, flip or erased patch differs by tens of levels on average). Returns
    (agree, mean levels, max levels)."""
    diff = (x.cpu().float() - reference.cpu().float()).abs() / DECODE_LEVEL
    mean, worst = float(diff.mean()), float(diff.max())
    return mean < 1.5 and worst < 48, mean, worst


def run_recipe_with(callback: Any, argv: list[str]) -> None:
    """``python -m recipes.<argv[0]> <argv[1:]>`` with ``callback`` added to every Trainer the recipe builds (its
    own ``make_trainer``, wrapped): how a scenario puts a fault or a stop inside a real recipe run."""
    import importlib

    import ddp_recipes.train.run as runner

    recipe = importlib.import_module(f"recipes.{argv[0]}")
    make_trainer = runner.make_trainer

    def with_callback(cfg: Any, callbacks: list | None = None, **kwargs: Any) -> Any:
        return make_trainer(cfg, callbacks=[*(callbacks or []), callback], **kwargs)

    runner.make_trainer = with_callback
    recipe.main(argv[1:])


def newest_checkpoint(output_dir: str | os.PathLike) -> str | None:
    """The checkpoint ``--resume auto`` takes in a recipe's output folder (None: none yet)."""
    from ddp_recipes.checkpointing.run_folder.ownership import newest_of_run, output_survey

    found = newest_of_run(output_survey(output_dir))
    return found.path if found is not None else None
