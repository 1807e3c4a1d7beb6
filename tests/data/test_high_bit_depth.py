"""16-bit and float images are scaled to 8 bits, not clipped at 255, on every path that decodes them: the folder's
PIL loader, ``--decode gpu``'s CPU fallback (non-JPEG files), a converted stream; an image with no faithful 8-bit
picture is named with its mode. The rules are ``ddp_recipes/data/pixels.py``'s (to_dtype's: 16-bit ``v >> 8``,
float ``[0, 1]``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from ddp_recipes.data.device_decode import decode_one
from ddp_recipes.data.images import ImageFolderDataModule
from ddp_recipes.data.pixels import named_loader
from ddp_recipes.data.unreadable import UnreadableImage
from tests.marks import needs_litdata

SIDE = 24
# One uint8 level after normalizing by the smallest ImageNet std (tests/data/test_device_decode.py): PIL's
# antialiased resize and torch's differ by a level or two on a few pixels.
LEVEL = 1 / 255 / min(0.229, 0.224, 0.225)


def _sixteen_bit(seed: int) -> np.ndarray:
    """Values 1000..60000, all above 8 bits but the first rows: clipped at 255, the picture is 99% white."""
    rng = np.random.default_rng(seed)
    ramp = np.linspace(1000, 60000, SIDE * SIDE).reshape(SIDE, SIDE)
    return (ramp + rng.integers(0, 500, (SIDE, SIDE))).clip(0, 65535).astype(np.uint16)


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> tuple[Path, dict[str, np.ndarray]]:
    """A folder of 16-bit grayscale PNGs (2 classes; 3 train and 2 val images each) and each file's expected
    8-bit picture (``v >> 8``, grey in all three channels)."""
    root = tmp_path_factory.mktemp("sixteen")
    expected = {}
    for split, count in (("train", 3), ("val", 2)):
        for c in range(2):
            folder = root / split / f"c{c}"
            folder.mkdir(parents=True)
            for i in range(count):
                values = _sixteen_bit(100 * c + 10 * i + (split == "val"))
                image = Image.fromarray(values)
                assert image.mode == "I;16"
                image.save(folder / f"{i}.png")
                expected[str(folder / f"{i}.png")] = np.repeat((values >> 8).astype(np.uint8)[..., None], 3, axis=2)
    return root, expected


def _eval_batch(dm, paths: list[str], expected: dict[str, np.ndarray]) -> torch.Tensor:
    transform = dm.val_transform()
    return torch.stack([transform(Image.fromarray(expected[p])) for p in paths])


def test_the_folder_loader_scales_16_bit_pngs_instead_of_clipping_them(tree):
    root, expected = tree
    dm = ImageFolderDataModule(root, batch_size=4, image_size=16, num_workers=0)
    dm.setup("fit")
    for path, _ in dm.train_set.samples:
        pixels = np.asarray(dm.train_set.loader(path))
        assert (pixels == 255).mean() < 0.01, "clipped at 255: a white square"
        assert np.array_equal(pixels, expected[path])
    x, _ = next(iter(dm.val_dataloader()))  # the recipe's evaluation pipeline on the loader's picture
    assert torch.equal(x, _eval_batch(dm, [p for p, _ in dm.val_set.samples[:4]], expected))


def test_decode_gpus_cpu_fallback_scales_them_as_the_folder_loader_does(tree):
    root, expected = tree
    path = next(iter(expected))
    data = torch.frombuffer(bytearray(Path(path).read_bytes()), dtype=torch.uint8)
    image, fell_back = decode_one(data, "cpu", name="x.png")  # decode_jpeg: "Not a JPEG file"
    assert fell_back and image.dtype == torch.uint8
    assert torch.equal(image, torch.from_numpy(expected[path]).permute(2, 0, 1))
    common = dict(batch_size=4, image_size=16, num_workers=0, seed=2)
    cpu, gpu = ImageFolderDataModule(root, **common), ImageFolderDataModule(root, decode="gpu", **common)
    for dm in (cpu, gpu):
        dm.setup("fit")
    for stage in ("train_dataloader", "val_dataloader"):
        for batch, (x_cpu, _) in zip(getattr(gpu, stage)(), getattr(cpu, stage)(), strict=True):
            x, _ = gpu.on_after_batch_transfer(batch.to("cpu"), 0)
            assert (x - x_cpu).abs().max() <= 2.01 * LEVEL, stage
    assert gpu.decoder.fallbacks == len(expected)


@needs_litdata
def test_a_converted_stream_of_16_bit_pngs_reads_as_the_folder_does(tree, tmp_path):
    """The converter keeps the file's bytes; the stream's reader scales them as the folder's loader does."""
    from ddp_recipes.data.convert import main as convert
    from ddp_recipes.data.stream import StreamImageDataModule

    root, expected = tree
    assert convert([str(root), str(tmp_path / "dest"), "--chunk-bytes", "8KB", "--workers", "1"]) == 0
    dm = StreamImageDataModule(tmp_path / "dest", batch_size=4, image_size=16, num_workers=0)
    dm.setup("fit")
    for i in range(len(dm.val_set)):
        x, _ = dm.val_set[i]
        path = str(root / dm.val_set.split[i]["path"])
        assert torch.equal(x, _eval_batch(dm, [path], expected)[0])


def _tiff(path: Path, values: np.ndarray) -> Path:
    Image.fromarray(values).save(path, format="TIFF")
    return path


def test_32_bit_and_float_images_within_range_scale_by_to_dtypes_rule(tmp_path):
    wide = _tiff(tmp_path / "i.tif", np.array([[0, 255, 256, 65535]], dtype=np.int32))
    assert Image.open(wide).mode == "I"
    assert np.asarray(named_loader(str(wide)))[0, :, 0].tolist() == [0, 0, 1, 255]
    floats = _tiff(tmp_path / "f.tif", np.array([[0.0, 0.5, 0.999, 1.0]], dtype=np.float32))
    assert Image.open(floats).mode == "F"
    assert np.asarray(named_loader(str(floats)))[0, :, 0].tolist() == [0, 127, 255, 255]


def test_8_bit_levels_in_a_32_bit_file_stay_as_they_are_and_a_16_bit_pgm_is_16_bit(tmp_path):
    """A 32-bit file says nothing of its range: 8-bit levels saved in it (``convert("I")``, ``convert("F")``) are
    kept as torchvision's loader kept them, never scaled to black; a file stored with 16 bits a sample (a PGM
    Pillow opens as ``I``) is 16-bit whatever its values."""
    levels = np.array([[0, 17, 128, 255]], dtype=np.uint8)
    for mode in ("I", "F"):
        path = tmp_path / f"eight-{mode}.tif"
        Image.fromarray(levels).convert(mode).save(path, format="TIFF")
        assert Image.open(path).mode == mode
        assert np.asarray(named_loader(str(path)))[0, :, 0].tolist() == [0, 17, 128, 255]
    dark = tmp_path / "dark.pgm"
    Image.fromarray(np.array([[0, 255, 512, 65535]], dtype=np.uint16)).save(dark)
    assert Image.open(dark).mode == "I"
    assert np.asarray(named_loader(str(dark)))[0, :, 0].tolist() == [0, 0, 2, 255]
    Image.fromarray(np.array([[0, 100, 200, 255]], dtype=np.uint16)).save(dark)  # maxval 65535, values all low
    assert np.asarray(named_loader(str(dark)))[0, :, 0].tolist() == [0, 0, 0, 0]


@pytest.mark.parametrize(("values", "needle"), [
    (np.array([[-5, 70000]], dtype=np.int32), "image mode I (32-bit integer) with values -5..70000"),
    (np.array([[0.0, 1000.0]], dtype=np.float32), "image mode F (32-bit float) with values 0..1000"),
    (np.array([[0.0, np.nan]], dtype=np.float32), "image mode F (32-bit float) with values"),
])
def test_an_image_with_no_faithful_8_bit_picture_is_named_with_its_mode(tmp_path, values, needle):
    """Never a silent clipped picture: the file and its mode, on the folder's path and the converter's."""
    from ddp_recipes.data.convert_source import encode

    folder = tmp_path / "train" / "c0"
    folder.mkdir(parents=True)
    bad = _tiff(folder / "scan.tif", values)
    with pytest.raises(UnreadableImage) as raised:
        named_loader(str(bad), root=str(tmp_path))
    assert str(raised.value).startswith(f"train/c0/scan.tif ({needle}")
    assert "save it as 8-bit, 16-bit, or float in [0, 1]" in str(raised.value)
    assert encode([str(bad), 0, "train/c0/scan.tif"], str(tmp_path / "log")) is None  # left out, named
    logged = next((tmp_path / "log").glob("worker-*.txt")).read_text()
    assert logged.startswith(f"train/c0/scan.tif ({needle}")
