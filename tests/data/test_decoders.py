"""Which library decodes image bytes (ddp_recipes.data.decoders): TorchCodec's decoders where torchcodec imports,
torchvision.io's where it does not (the lent stack), chosen once per process.

Proves: the choice; the two decode the repo's test JPEGs (smooth fields at 4:2:0, a CMYK one, a grayscale one) and
the bench's real-size ones to the same pixels on the CPU, bit for bit (both are libjpeg-turbo; the CUDA decode is
nvJPEG with either, compared against the CPU in tests/gpu/test_gpu_decode.py); neither turns a JPEG by its EXIF
orientation (TorchCodec's own decoder does), so the crops drawn on the stored size fit; no decode through the pack
warns a deprecation; without torchcodec, where torchvision deprecates its decoders (>= 0.29), one line names the extra,
once per process, however many decodes follow. The pipelines with each library: tests/data/test_device_decode.py.
"""

from __future__ import annotations

import importlib.util
import io
import sys
import warnings

import pytest
import torch
import torchvision
from packaging.version import Version
from PIL import Image

from ddp_recipes.data.decoders import ENV, image_decoders
from ddp_recipes.data.device_decode import DeviceDecoder, decode_images
from ddp_recipes.data.encoded import image_size
from ddp_recipes.extras import install_hint
from tests.helpers import write_jpeg_tree, write_odd_images

HAVE_TORCHCODEC = importlib.util.find_spec("torchcodec") is not None
TORCHVISION_DEPRECATES = Version(torchvision.__version__).release[:2] >= (0, 29)


def _bytes(path) -> torch.Tensor:
    return torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8)


@pytest.fixture
def unchosen(monkeypatch):
    """The choice made afresh (by the code under test), and again after the test."""
    monkeypatch.delenv(ENV, raising=False)
    image_decoders.cache_clear()
    yield
    image_decoders.cache_clear()


def test_torchcodec_where_it_imports_else_torchvision(unchosen, monkeypatch):
    assert image_decoders().name == ("torchcodec" if HAVE_TORCHCODEC else "torchvision")
    image_decoders.cache_clear()
    monkeypatch.setenv(ENV, "torchvision")
    assert image_decoders().name == "torchvision"
    assert image_decoders("torchvision").decode_jpeg.__module__.startswith("torchvision")
    image_decoders.cache_clear()
    monkeypatch.setenv(ENV, "")
    monkeypatch.setitem(sys.modules, "torchcodec.decoders", None)  # `from torchcodec.decoders import` fails
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the missing-extra line (its own test below)
        assert image_decoders().name == "torchvision"
    with pytest.raises(ImportError, match="torchcodec does not import here"):
        image_decoders("torchcodec")


def test_without_torchcodec_one_line_names_the_extra_once_and_the_decodes_are_quiet(unchosen, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "torchcodec.decoders", None)
    files = sorted(write_jpeg_tree(tmp_path, per_class=3, side=24).rglob("*.jpg"))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(3):
            images, fallbacks = decode_images([_bytes(f) for f in files], "cpu")
            assert len(images) == len(files) and fallbacks == 0
    lines = [str(w.message) for w in seen]
    hint = install_hint("decode", "torchcodec")
    if TORCHVISION_DEPRECATES:
        assert lines == [f"images decode with torchvision.io, which torchvision {torchvision.__version__} deprecates: "
                         f"TorchCodec is not installed; for its decoders, {hint}"], lines
    else:  # torchvision 0.26 (the lent stack): nothing to say
        assert lines == [], lines


def test_no_decode_through_the_pack_warns_a_deprecation(image_library, tmp_path):
    root = write_jpeg_tree(tmp_path, per_class=3, side=24)
    write_odd_images(root / "train" / "c0")  # the PNG goes through the fallback
    files = sorted(p for p in root.rglob("*") if p.is_file())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        images = DeviceDecoder().decode([_bytes(f) for f in files], torch.device("cpu"))
        image_decoders().decode_image(str(files[0]), mode="RGB")
    assert len(images) == len(files) and image_decoders().name == image_library
    assert [str(w.message)[:80] for w in seen if issubclass(w.category, DeprecationWarning)] == []


@pytest.mark.skipif(not HAVE_TORCHCODEC, reason="torchcodec is the decode extra: pip install -e '.[decode]'")
def test_both_libraries_decode_the_same_pixels(tmp_path):
    """Bit for bit on the CPU: the same libjpeg-turbo under both (measured 2026-12-06, torchcodec 0.17.0,
    torchvision 0.29.2: max difference 0 on all of these). A difference would show here before it moved the
    device pipeline's bit-for-bit tests."""
    from ddp_recipes.bench.jpeg_folder import write_jpegs

    root = write_jpeg_tree(tmp_path / "tree", per_class=8, side=40)
    write_odd_images(root)
    gray = io.BytesIO()
    Image.new("L", (33, 21), 90).save(gray, format="JPEG")
    (root / "gray.jpg").write_bytes(gray.getvalue())
    files = [*sorted(root.rglob("*.jpg")), root / "cmyk.JPEG", *sorted(write_jpegs(tmp_path / "big", 4).rglob("*.jpg"))]
    codec, vision = image_decoders("torchcodec"), image_decoders("torchvision")
    for path in files:
        data = _bytes(path)
        a, b = codec.decode_jpeg(data, mode="RGB"), vision.decode_jpeg(data, mode="RGB")
        assert a.shape == b.shape and a.shape[0] == 3 and torch.equal(a, b), path.name
        assert torch.equal(codec.decode_image(str(path), mode="RGB"), a)


def _oriented(orientation: int) -> bytes:
    """A JPEG whose EXIF says to turn it (``orientation``: 1 upright, 2-4 flips and 180 degrees, 5-8 a quarter
    turn, which swaps its height and width)."""
    import numpy as np

    field = Image.fromarray(np.random.default_rng(0).integers(0, 256, (5, 7, 3), dtype=np.uint8))
    exif, out = Image.Exif(), io.BytesIO()
    exif[0x0112] = orientation
    field.resize((41, 23), Image.BICUBIC).save(out, format="JPEG", exif=exif.tobytes(), quality=90)
    return out.getvalue()


def test_no_library_turns_a_jpeg_by_its_exif_orientation(image_library, tmp_path):
    """The workers draw the crops on the stored size (the PIL loader of --decode cpu turns nothing either): a
    decoder that turned the image would crop the wrong pixels, or outside it. TorchCodec's own turns it."""
    files = [_oriented(o) for o in range(1, 9)]
    datas = [torch.frombuffer(bytearray(f), dtype=torch.uint8) for f in files]
    upright = DeviceDecoder().decode(datas[:1], torch.device("cpu"))[0]
    assert tuple(upright.shape[1:]) == image_size(files[0]) == (23, 41)
    one_by_one = [decode_images([d], "cpu")[0][0] for d in datas]
    for image in [*DeviceDecoder().decode(datas, torch.device("cpu")), *one_by_one]:
        assert torch.equal(image, upright)
    (tmp_path / "turned.jpg").write_bytes(files[5])
    assert torch.equal(image_decoders().decode_image(str(tmp_path / "turned.jpg"), mode="RGB"), upright)
    if image_library == "torchcodec":  # what the pack keeps it from doing
        from torchcodec.decoders import decode_jpeg

        assert decode_jpeg(datas[5]).shape[1:] == (41, 23)


def test_a_fill_byte_before_the_exif_segment_does_not_let_it_turn_the_image(image_library):
    """A marker may be preceded by any number of 0xFF fill bytes (JPEG B.1.1.2): the EXIF segment after them is
    still hidden from the decoder, and the file decodes as the PIL loader of --decode cpu reads it."""
    from ddp_recipes.data.pixels import open_rgb, to_tensor

    turned = _oriented(6)
    at = turned.index(b"\xff\xe1")
    filled = turned[:at] + b"\xff\xff" + turned[at:]
    data = torch.frombuffer(bytearray(filled), dtype=torch.uint8)
    image = decode_images([data], "cpu")[0][0]
    assert torch.equal(image, to_tensor(open_rgb(filled, "filled.jpg")))
    assert tuple(image.shape[1:]) == image_size(filled) == (23, 41)


@pytest.mark.parametrize("value", ["bogus", "TorchVision", "pil"])
def test_an_unknown_decoder_in_the_environment_is_one_line_naming_the_variable(unchosen, monkeypatch, value):
    """A typo must not silently decode with the other library: the line names the variable and its values."""
    from ddp_recipes.errors import ConfigError

    monkeypatch.setenv(ENV, value)
    with pytest.raises(ConfigError, match=f"{ENV}={value} is not a decoder: set it to torchcodec or torchvision"):
        image_decoders()
