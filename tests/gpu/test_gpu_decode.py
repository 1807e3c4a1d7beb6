"""``--decode gpu`` on a real GPU (nvJPEG): the CUDA twins of tests/data/test_device_decode.py; skip without CUDA.

Proves: the same encoded batch decoded and augmented on CUDA equals the CPU device's result (libjpeg-turbo)
within a few levels of JPEG decoder rounding, for the same draws; nvJPEG's refusals (a PNG named .JPEG, a
CMYK JPEG) fall back to the CPU, are counted and keep every image. (The pack's side of the step makes no host
read: tests/cross_cutting/test_host_sync.py, on the CPU; torchvision's nvJPEG call itself waits for its decode
on the host.)
"""

from __future__ import annotations

import pytest
import torch

from ddp_recipes.data.device_decode import DeviceDecoder
from ddp_recipes.data.encoded import EncodedImageFolder, EvalPipeline, TrainPipeline
from ddp_recipes.data.seeding import sample_seed, seed_all
from tests.helpers import write_jpeg_tree, write_odd_images

pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

LEVEL = 1 / 255 / min(0.229, 0.224, 0.225)  # one uint8 level after normalizing


def _batch(files: list[str], pipeline, device: str):
    dataset = EncodedImageFolder([(f, 0) for f in files], pipeline)
    samples = []
    for i in range(len(files)):
        seed_all(sample_seed(0, 0, i))
        samples.append(dataset[i])
    return dataset.collate(samples).to(device)


@needs_cuda
@pytest.mark.parametrize("pipeline", [TrainPipeline(32, auto_augment="ta_wide", random_erase=0.5), EvalPipeline(32)],
                         ids=["train", "eval"])
def test_nvjpeg_gives_the_cpu_decoders_batch_for_the_same_draws(tmp_path, pipeline):
    """Same files, same draws: CUDA against the CPU device. A different crop, flip or policy operation would
    differ by tens of levels on average; the decoders' IDCT and chroma upsampling differ by a level or two."""
    root = write_jpeg_tree(tmp_path, per_class=8, side=40)
    files = sorted(str(p) for p in root.rglob("*.jpg"))
    on_cpu, _ = DeviceDecoder(channels_last=True)(_batch(files, pipeline, "cpu"))
    decoder = DeviceDecoder(channels_last=True)
    x, y = decoder(_batch(files, pipeline, "cuda"))
    torch.cuda.synchronize()
    assert x.is_cuda and y.is_cuda and x.is_contiguous(memory_format=torch.channels_last)
    diff = (x.cpu() - on_cpu).abs()
    assert diff.mean() < 1.5 * LEVEL and diff.max() < 48 * LEVEL, (diff.mean() / LEVEL, diff.max() / LEVEL)
    assert decoder.fallbacks == 0 and decoder.images == len(files)


@needs_cuda
def test_files_nvjpeg_refuses_are_decoded_on_the_cpu_and_counted(tmp_path):
    root = write_jpeg_tree(tmp_path, per_class=3, side=40)
    write_odd_images(root / "train" / "c0")
    files = sorted(str(p) for p in root.rglob("*.*") if p.is_file())
    decoder = DeviceDecoder()
    x, _ = decoder(_batch(files, EvalPipeline(32), "cuda"))
    on_cpu, _ = DeviceDecoder()(_batch(files, EvalPipeline(32), "cpu"))
    torch.cuda.synchronize()
    assert x.shape == (len(files), 3, 32, 32)
    assert 1 <= decoder.fallbacks <= 2  # the PNG always; the CMYK JPEG where nvJPEG refuses it
    assert (x.cpu() - on_cpu).abs().mean() < 1.5 * LEVEL
