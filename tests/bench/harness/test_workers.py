"""The bench workers' building blocks: DataParallel's per-thread autocast, per-rank synthetic data."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from ddp_recipes.bench.harness.baselines import AutocastForward, autocast_dtype, dp_loop
from ddp_recipes.bench.harness.synthetic import RankShard, shard_size
from ddp_recipes.bench.harness.workload import Workload, build_dataset


class SeesDtype(nn.Module):
    """A Linear that records the autocast state and output dtype its forward ran with."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.seen: dict[str, object] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        self.seen = {"enabled": torch.is_autocast_enabled("cpu"), "out": y.dtype}
        return y


def _forward_in_thread(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """What DataParallel does with each replica: its forward in a thread of its own."""
    result: list[torch.Tensor] = []
    thread = threading.Thread(target=lambda: result.append(module(x)))
    thread.start()
    thread.join()
    return result[0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_replica_thread_runs_in_the_runs_dtype_only_when_autocast_is_entered_inside(dtype):
    x = torch.randn(2, 4)
    plain = SeesDtype()
    with torch.autocast("cpu", dtype=dtype):  # the caller's autocast: this thread only
        assert plain(x).dtype == dtype
        _forward_in_thread(plain, x)
        assert plain.seen == {"enabled": False, "out": torch.float32}  # the trap: the thread saw no autocast
        wrapped = AutocastForward(plain, "cpu", dtype)
        out = _forward_in_thread(wrapped, x)
    assert plain.seen == {"enabled": True, "out": dtype} and out.dtype == dtype


def test_autocast_dtype_follows_lightnings_plugins():
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert autocast_dtype("bf16-mixed", gpu) is torch.bfloat16  # never the CUDA default (fp16)
    assert autocast_dtype("16-mixed", gpu) is torch.float16
    assert autocast_dtype("16-mixed", cpu) is torch.bfloat16
    assert autocast_dtype("32-true", gpu) is None


def test_two_ranks_hold_the_global_synthetic_set_between_them():
    w = Workload(recipe="resnet", image_size=16, batch_size=4, steps=3, warmup_steps=1, devices=2)
    data = build_dataset(w)
    assert isinstance(data, RankShard) and len(data) == (w.total_steps + 1) * w.batch_size * w.devices == 40
    x0, y0 = data.materialize(rank=0, world_size=2)
    other = build_dataset(w)
    x1, _ = other.materialize(rank=1, world_size=2)
    assert len(x0) + len(x1) == len(data) and x0.shape[1:] == (3, 16, 16) and len(y0) == len(x0)
    assert not torch.equal(x0, x1)  # each rank its own samples
    assert data.nbytes() == (x0.numel() * 4 + y0.numel() * 8)
    # The sampler's global indices fold onto the rank's samples.
    xb, yb = data.__getitems__([0, 19, 20, 39])
    assert torch.equal(xb[0], x0[0]) and torch.equal(xb[2], x0[0]) and torch.equal(xb[3], x0[19])
    assert shard_size(41, 2) == 21 and shard_size(40, 1) == 40


def test_one_process_without_a_group_materializes_everything_lazily():
    data = RankShard(10, (2,), seed=0)
    assert data.tensors is None and data.nbytes() == 0
    x, _ = data[3]  # first fetch builds it: no process group -> rank 0 of 1
    assert data.world_size == 1 and len(data.tensors[0]) == 10 and x.shape == (2,)


class ThreadReplica(nn.Module):
    """What nn.DataParallel does with a replica, on CPU: its forward in a thread of its own, which sees none
    of the caller's autocast (``replica``: what the thread runs, default the wrapped module itself)."""

    def __init__(self, module: nn.Module, replica=None) -> None:
        super().__init__()
        self.module, self.replica = module, replica

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _forward_in_thread(self.replica(self.module) if self.replica else self.module, x)


DP_TINY = Workload(recipe="resnet", arch="resnet18", image_size=16, batch_size=4, steps=2, warmup_steps=1,
                   precision="bf16-mixed")


def test_bench_dp_reports_the_dtype_its_replica_threads_computed_in(tmp_path):
    import json

    out = tmp_path / "dp.json"
    dp_loop(DP_TINY, torch.device("cpu"), str(out), parallel=ThreadReplica)
    run = json.loads(out.read_text())
    assert run["impl"] == "dp" and run["autocast_dtype"] == "bfloat16" and run["measured_steps"] == 2


def test_bench_dp_refuses_a_replica_that_computed_in_another_dtype(tmp_path):
    """A replica thread that runs the bare network (autocast lost): the run says so instead of reporting the
    dtype it asked for."""
    unwrapped = lambda module: module.module  # noqa: E731 - AutocastForward's inner network, as a lost wrap
    with pytest.raises(SystemExit, match="replicas computed in float32, not bfloat16"):
        dp_loop(DP_TINY, torch.device("cpu"), str(tmp_path / "dp.json"),
                parallel=lambda net: ThreadReplica(net, unwrapped))
    assert not (tmp_path / "dp.json").exists()


def test_synthetic_fetch_copies_its_indices_without_blocking():
    """The batch's indices reach the device with a non-blocking copy (pinned first on CUDA): a pageable,
    blocking one synchronises the host with the GPU at every step (sync-debug's finding). Seen on CPU through
    the meta device, which dispatches the same copy."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Copies(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.copies: list[dict] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._to_copy.default:
                self.copies.append(dict(kwargs or {}))
            return func(*args, **(kwargs or {}))

    data = RankShard(10, (2,), seed=0, device="meta")
    data.materialize()
    with Copies() as seen:
        x, y = data.__getitems__([1, 12])
    assert x.shape == (2, 2) and x.device.type == "meta"
    assert [(c["device"].type, c["non_blocking"]) for c in seen.copies] == [("meta", True)]


def test_synthetic_data_is_not_seeded_per_batch():
    """In-memory synthetic samples draw no random numbers: the pack's resumable loader then neither seeds nor
    saves and restores RNG state per batch (the raw loop does neither), and its sampler yields plain ints."""
    from ddp_recipes.data.resumable import ResumableSampler, SeededDataset, draws_random_numbers

    data = RankShard(8, (2,), seed=0)
    assert draws_random_numbers(data) is False
    seeded = SeededDataset(data, seed=0)
    assert seeded.draws_random_numbers is False
    assert all(type(i) is int for i in ResumableSampler(seeded, num_replicas=1, rank=0))


# ---- the nvJPEG fallback of --decode gpu and the loader bench (reached on CPU: either library's CPU decode_jpeg
# rejects the same non-JPEG files nvJPEG does, a PNG named .JPEG among them) ----------------------------------


def _image_files(tmp_path):
    from PIL import Image

    Image.new("RGB", (12, 10), (200, 30, 30)).save(tmp_path / "real.JPEG", format="JPEG")
    Image.new("RGB", (12, 10), (30, 200, 30)).save(tmp_path / "png_in_disguise.JPEG", format="PNG")
    Image.new("CMYK", (12, 10), (0, 200, 200, 0)).save(tmp_path / "cmyk.JPEG", format="JPEG")
    return [torch.frombuffer(bytearray((tmp_path / name).read_bytes()), dtype=torch.uint8)
            for name in ("real.JPEG", "png_in_disguise.JPEG", "cmyk.JPEG")]


def test_a_png_named_jpeg_falls_back_to_the_cpu_decoder(tmp_path, image_library):
    from ddp_recipes.data.decoders import image_decoders
    from ddp_recipes.data.device_decode import decode_one

    decode_jpeg = image_decoders().decode_jpeg

    jpeg, png, _ = _image_files(tmp_path)
    image, fell_back = decode_one(jpeg, "cpu", decode_jpeg)
    assert not fell_back and image.shape == (3, 10, 12)
    image, fell_back = decode_one(png, "cpu", decode_jpeg)  # decode_jpeg raises "Not a JPEG file"
    assert fell_back and image.shape == (3, 10, 12) and image[1].float().mean() > 150  # the green PNG


def test_the_batch_decode_keeps_the_batch_when_one_file_is_rejected(tmp_path, image_library):
    from ddp_recipes.data.decoders import image_decoders
    from ddp_recipes.data.device_decode import decode_images

    decode_jpeg = image_decoders().decode_jpeg

    files = _image_files(tmp_path)
    calls: list[int] = []

    def nvjpeg(data, device, mode):  # the real decoder, counting calls; it rejects the PNG
        calls.append(len(data) if isinstance(data, list) else 1)
        return decode_jpeg(data, device=device, mode=mode)

    images, fallbacks = decode_images(files, "cpu", nvjpeg)
    assert [tuple(i.shape) for i in images] == [(3, 10, 12)] * 3 and fallbacks == 1  # CMYK decodes to RGB
    assert calls[0] == 3  # the batched call first, then one file at a time
    assert decode_images(files[:1], "cpu", nvjpeg)[1] == 0 and calls[-1] == 1



def test_step_time_leaves_out_the_interval_across_an_epoch_boundary():
    """Validation, checkpoints and the loaders' restart between two epochs are not a training step's cost: the
    interval that spans them is dropped, the warm-up still is, and the rest is timed as before."""
    from ddp_recipes.bench.harness.measure import StepEnds, step_stats

    ends = [0.0, 1.0, 2.0, 12.0, 13.0, 14.0]  # steps of 1 s, an epoch boundary of 10 s before the 4th end
    assert step_stats(ends, 1, 8)["measured_steps"] == 5 and step_stats(ends, 1, 8)["step_ms_median"] == 1000
    stats = step_stats(ends, 1, 8, across={3})
    assert stats["measured_steps"] == 4 and stats["global_samples_per_s"] == 8.0  # 4 intervals of 1 s
    assert step_stats(ends, 3, 8, across={3})["measured_steps"] == 2  # warm-up steps 1-2 and the boundary out
    timer = StepEnds(torch.device("cpu"), warmup_steps=1, total_steps=6)
    timer.epoch_start()  # the first epoch: nothing to leave out
    timer.step_end(), timer.step_end()
    timer.epoch_start()
    timer.step_end()
    assert timer.across == {2}
