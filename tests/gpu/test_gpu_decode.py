"""``--decode gpu`` on a real GPU (nvJPEG): the CUDA twins of tests/data/test_device_decode.py; skip without CUDA.

Proves, with each decoder library (TorchCodec's nvJPEG path, torchvision's; the ``image_library`` fixture): the
same encoded batch decoded and augmented on CUDA equals the CPU device's result (libjpeg-turbo)
within a few levels of JPEG decoder rounding, for the same draws; nvJPEG's refusals (a PNG named .JPEG, a
CMYK JPEG) fall back to the CPU, are counted and keep every image. (The pack's side of the step makes no host
read: tests/cross_cutting/test_host_sync.py, on the CPU; torchvision's nvJPEG call itself waits for its decode
on the host.)
"""

from __future__ import annotations

import pytest
import torch

from ddp_recipes.data.encoded import EvalPipeline
from tests.helpers import (
    comparison_files_with_refusals,
    comparison_jpegs,
    decode_pipelines,
    decoded_batch,
    decoders_agree,
)

pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

@needs_cuda
@pytest.mark.parametrize("name", sorted(decode_pipelines()))
def test_nvjpeg_gives_the_cpu_decoders_batch_for_the_same_draws(tmp_path, name, image_library):
    """Same files, same draws: CUDA against the CPU device, through pipelines without threshold operations (see
    tests.helpers.decode_pipelines; the CPU twin holds the bound with a decoder that adds +-1 level noise)."""
    pipeline = decode_pipelines()[name]
    files = comparison_jpegs(tmp_path)
    on_cpu, _, _ = decoded_batch(files, pipeline, "cpu")
    x, y, decoder = decoded_batch(files, pipeline, "cuda")
    torch.cuda.synchronize()
    assert x.is_cuda and y.is_cuda and x.is_contiguous(memory_format=torch.channels_last)
    agree, mean, worst = decoders_agree(x, on_cpu)
    assert agree, (mean, worst)
    assert decoder.fallbacks == 0 and decoder.images == len(files)


@needs_cuda
def test_files_nvjpeg_refuses_are_decoded_on_the_cpu_and_counted(tmp_path, image_library):
    files = comparison_files_with_refusals(tmp_path)  # 4:4:4 JPEGs: on 4:2:0 nvJPEG's chroma differs (helpers)
    x, _, decoder = decoded_batch(files, EvalPipeline(32), "cuda")
    on_cpu, _, _ = decoded_batch(files, EvalPipeline(32), "cpu")
    torch.cuda.synchronize()
    assert x.shape == (len(files), 3, 32, 32)
    assert 1 <= decoder.fallbacks <= 2  # the PNG always; the CMYK JPEG where nvJPEG refuses it
    assert decoders_agree(x, on_cpu)[0]
