"""``--decode gpu`` on the CPU device: the same code as on CUDA, with the CPU ``decode_jpeg`` of each decoder library
(TorchCodec's and torchvision.io's: the ``image_library`` fixture; ddp_recipes.data.decoders).

Proves: the device pipeline equals the CPU tensor pipeline bit for bit for the same draws (crops, flips, the
policies, erasing) and the recipe's PIL pipeline within interpolation tolerance for the same seed (so the
draws are the CPU pipeline's); the fallback decodes a CMYK JPEG and a PNG named .JPEG and counts them; the
draws continue bit for bit after a loader restart at 2 ranks with workers, and after a SIGTERM and
``--resume auto`` of the recipe at 2 ranks; the refusals are one line naming the flag. The host-read count of
the step is in tests/cross_cutting/test_host_sync.py, the CUDA twins in tests/gpu/test_gpu_decode.py.
"""

from __future__ import annotations

import signal
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from PIL import Image

from ddp_recipes.data.decoders import image_decoders
from ddp_recipes.data.device_decode import DeviceDecoder
from ddp_recipes.data.encoded import EncodedBatch, EncodedImageFolder, EvalPipeline, TrainPipeline
from ddp_recipes.data.images import ImageFolderDataModule
from ddp_recipes.data.resumable import ResumableDataLoader, resumable_loader
from ddp_recipes.data.seeding import sample_seed, seed_all
from ddp_recipes.modules.resnet import ResNetClassifier
from tests.helpers import (
    decode_pipelines,
    decoded_batch,
    decoders_agree,
    raises_cli,
    write_jpeg_tree,
    write_odd_images,
)
from tests.launch import run, saved_step, start

# One uint8 level after normalizing by the smallest ImageNet std. PIL's antialiased resize and torch's differ by
# a level on a few pixels, two at most on these images; a different crop or flip differs by tens of levels.
LEVEL = 1 / 255 / min(0.229, 0.224, 0.225)
TOLERANCE = 2.01 * LEVEL


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    return write_jpeg_tree(tmp_path_factory.mktemp("jpegs"), per_class=12, val_per_class=5, side=40)


def _files(root: Path) -> list[str]:
    return sorted(str(p) for p in (root / "train").rglob("*.jpg"))


def _epoch(dm: ImageFolderDataModule, loader) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every batch of one pass, decoded by the DataModule's own hook when it is an EncodedBatch."""
    return [dm.on_after_batch_transfer(batch.to("cpu") if isinstance(batch, EncodedBatch) else batch, 0)
            for batch in loader]


@pytest.mark.parametrize(("auto_augment", "random_erase"), [(None, 0.0), ("ta_wide", 0.5), ("ra", 0.0),
                                                            ("imagenet", 1.0)])
def test_the_device_pipeline_is_the_cpu_tensor_pipeline_bit_for_bit(tree, auto_augment, random_erase, image_library):
    """Same per-sample seed: the worker's draws, applied on the device, give exactly the CPU pipeline's output on
    the decoded tensor (its crop, flip, policy operations and erased box)."""
    pipeline = TrainPipeline(32, min_crop_scale=0.2, auto_augment=auto_augment, random_erase=random_erase)
    files = _files(tree)
    dataset = EncodedImageFolder([(f, 0) for f in files], pipeline)
    compose = pipeline.build()
    samples, expected = [], []
    for i, path in enumerate(files):
        seed_all(sample_seed(7, 1, i))
        samples.append(dataset[i])
        seed_all(sample_seed(7, 1, i))
        expected.append(compose(image_decoders().decode_image(path, mode="RGB")))
    x, y = DeviceDecoder()(dataset.collate(samples).to("cpu"))
    assert torch.equal(x, torch.stack(expected))
    assert y.tolist() == [0] * len(files) and x.dtype == torch.float32
    draws = [s[2] for s in samples]
    assert len({d.crop for d in draws}) == len(files)  # per-sample crops, not one per batch
    if auto_augment:
        assert any(d.ops for d in draws)
    if random_erase:
        assert any(d.erase for d in draws)


def test_decode_gpu_gives_the_pil_pipelines_batches_for_the_same_seed(tree, image_library):
    """The recipe's two modes on the same folder and seed, through the resumable loader with a worker: the same
    samples, crops and flips; pixels within two levels (PIL's resize vs torch's; a tenth of a level on
    average), evaluation too."""
    common = dict(batch_size=8, image_size=32, num_workers=1, min_crop_scale=0.2, seed=3)
    cpu, gpu = ImageFolderDataModule(tree, **common), ImageFolderDataModule(tree, decode="gpu", **common)
    for dm in (cpu, gpu):
        dm.setup("fit")
    for stage in ("train_dataloader", "val_dataloader"):
        got = _epoch(gpu, getattr(gpu, stage)())
        want = _epoch(cpu, getattr(cpu, stage)())
        assert len(got) == len(want) > 1
        for (x, y), (x_cpu, y_cpu) in zip(got, want, strict=True):
            assert torch.equal(y, y_cpu) and x.shape == x_cpu.shape
            diff = (x - x_cpu).abs()
            assert diff.max() <= TOLERANCE and diff.mean() < 0.1 * LEVEL, (stage, diff.max(), diff.mean())
    assert gpu.decode_record == {"device": "cpu", "images": 24 + 10, "cpu_fallbacks": 0, "decoder": image_library}


def test_the_fallback_decodes_a_cmyk_jpeg_and_a_png_named_jpeg(tree, tmp_path, image_library):
    """nvJPEG refuses both (CUDA twin: tests/gpu/test_gpu_decode.py); on the CPU device libjpeg decodes the CMYK one
    and refuses the PNG. Either way the batch keeps every image, equal to the PIL pipeline's within a level, and
    each file decoded on the CPU instead is counted."""
    root = write_jpeg_tree(tmp_path / "odd", per_class=5, val_per_class=2, side=40)
    write_odd_images(root / "train" / "c0")
    write_odd_images(root / "val" / "c1")
    common = dict(batch_size=16, image_size=32, num_workers=0, seed=1)
    cpu, gpu = ImageFolderDataModule(root, **common), ImageFolderDataModule(root, decode="gpu", **common)
    for dm in (cpu, gpu):
        dm.setup("fit")
    assert gpu.train_set.not_jpeg() == 0  # named .JPEG: only decoding finds out
    for stage in ("train_dataloader", "val_dataloader"):
        for (x, _), (x_cpu, _) in zip(_epoch(gpu, getattr(gpu, stage)()), _epoch(cpu, getattr(cpu, stage)()),
                                      strict=True):
            assert (x - x_cpu).abs().max() <= TOLERANCE
    assert gpu.decoder.fallbacks == 2 and gpu.decode_record["cpu_fallbacks"] == 2  # the PNG, once per split


# torchvision's batched nvJPEG decode re-raises torch's OutOfMemoryError (not a plain std::runtime_error) as a
# RuntimeError with its text, and nvJPEG's own allocation failure is its status 5 in torchvision's check.
OUT_OF_MEMORY = {
    "torch": torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    "torchvision-batched": RuntimeError("Error while decoding JPEG images: CUDA out of memory. Tried to allocate "
                                        "2.00 GiB"),
    "nvjpeg-allocator": RuntimeError("Error while decoding JPEG images: Failed to decode batch: 5"),
}


@pytest.mark.parametrize("raised", OUT_OF_MEMORY.values(), ids=list(OUT_OF_MEMORY))
def test_out_of_memory_in_the_batched_decode_is_named_an_out_of_memory(tree, raised):
    """A decoder that runs out of device memory (stand-ins raising what torch, torchvision and nvJPEG raise) is
    neither a file it refuses nor a reason to decode the batch on the CPU: the error says out of memory, how many
    files were decoded at once, and the fix."""
    calls: list[int] = []

    def out_of_memory(data, device, mode):
        calls.append(len(data) if isinstance(data, list) else 1)
        raise raised

    files = _files(tree)[:6]
    decoder = DeviceDecoder(jpeg_decoder=out_of_memory)
    with pytest.raises(torch.OutOfMemoryError) as err:
        decoder.decode([torch.from_numpy(np.fromfile(f, dtype=np.uint8)) for f in files], torch.device("cpu"))
    assert calls == [6] and decoder.fallbacks == 0  # one batched call, no file-by-file retry, no CPU fallback
    text = str(err.value)
    assert text.startswith("out of memory on cpu decoding 6 JPEG(s) at once") and "lower --batch-size" in text
    assert text.endswith(str(raised).splitlines()[0])


def test_a_file_no_decoder_reads_is_one_line_naming_it(tmp_path, capsys, image_library):
    from recipes import resnet

    root = write_jpeg_tree(tmp_path / "bad", per_class=4, val_per_class=2, side=40)
    good = (root / "train" / "c0" / "0.jpg").read_bytes()
    (root / "train" / "c1" / "truncated.jpg").write_bytes(good[:len(good) // 2])  # header intact, data cut
    with pytest.raises(SystemExit) as stopped:
        resnet.main(["--accelerator", "cpu", "--data", "imagefolder", "--data-dir", str(root), "--image-size", "32",
                     "--batch-size", "9", "--num-workers", "0", "--max-steps", "1", "--decode", "gpu",
                     "--output-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert stopped.value.code == 2 and err.startswith(f"python -m recipes.resnet: error: --data-dir {root} holds an "
                                                      "image that cannot be decoded: train/c1/truncated.jpg (")


def test_files_not_named_jpeg_are_announced(tmp_path):
    root = write_jpeg_tree(tmp_path / "mixed", per_class=3, val_per_class=1, side=40)
    Image.new("RGB", (40, 40), (10, 200, 10)).save(root / "train" / "c0" / "a.png")
    dm = ImageFolderDataModule(root, batch_size=2, image_size=32, decode="gpu")
    with pytest.warns(UserWarning, match="1 of 9 files .* not named .jpg/.jpeg"):
        dm.setup("fit")


@pytest.mark.parametrize(("kwargs", "needle"), [
    (dict(decode="tpu"), "decode must be one of cpu, gpu"),
    (dict(auto_augment="augmix"), "--auto-augment augmix is not applied with --decode gpu"),
    (dict(auto_augment="ra", interpolation="bicubic"), "--interpolation bicubic does not work with --auto-augment"),
])
def test_what_the_device_cannot_apply_is_refused(tree, kwargs, needle):
    with raises_cli(ValueError, match=needle):
        ImageFolderDataModule(tree, image_size=32, **{"decode": "gpu", **kwargs})
    if kwargs.get("decode") != "tpu":
        ImageFolderDataModule(tree, image_size=32, **kwargs)  # the CPU pipeline takes them


@pytest.mark.parametrize(("argv", "needle"), [
    (["--data", "synthetic"], "--decode has no effect without --data imagefolder"),
    (["--data", "cifar10"], "--decode has no effect without --data imagefolder"),
    (["--data", "imagefolder", "--auto-augment", "augmix"], "--auto-augment augmix is not applied with --decode gpu"),
    (["--data", "imagefolder", "--datamodule-class", "ddp_recipes.data.images:CIFAR10DataModule"],
     "--decode has no effect: --datamodule-class ddp_recipes.data.images:CIFAR10DataModule does not take decode"),
])
def test_the_recipe_refuses_decode_gpu_where_it_cannot_run(tree, tmp_path, capsys, argv, needle):
    from recipes import resnet

    with pytest.raises(SystemExit) as stopped:
        resnet.main(["--accelerator", "cpu", "--data-dir", str(tree), "--decode", "gpu", "--max-steps", "1",
                     "--output-dir", str(tmp_path), *argv])
    err = capsys.readouterr().err.strip()
    assert stopped.value.code == 2 and needle in err and err.count("\n") == 0, err


def test_an_undecoded_batch_says_why(tree):
    dataset = EncodedImageFolder([(f, 0) for f in _files(tree)[:2]], EvalPipeline(32))
    batch = dataset.collate([dataset[0], dataset[1]])
    with pytest.raises(TypeError, match="reached the step undecoded.*must call super"):
        x, y = batch
    assert [len(d) for d in batch.data] == batch.lengths and batch.size == 2
    assert all(d.dtype == torch.uint8 and d.dim() == 1 for d in batch.data)


class _Recording(ResNetClassifier):
    """Records what its own ``on_after_batch_transfer`` receives (after the DataModule's decode)."""

    seen: list[tuple[str, torch.dtype, bool, bool]] = []

    def on_after_batch_transfer(self, batch, dataloader_idx):
        x, _ = batch
        stage = "train" if self.trainer.training else "eval"
        type(self).seen.append((stage, x.dtype, x.is_contiguous(memory_format=torch.channels_last),
                                torch.is_autocast_enabled("cpu")))
        return batch


def test_decoded_batches_reach_the_model_in_float32_channels_last_outside_autocast(tree, tmp_path):
    """bf16-mixed, --channels-last: the decode runs outside autocast and hands float32 NHWC images on; a
    model's own on_after_batch_transfer still runs, after the decode; mixing and validation take the batch."""
    _Recording.seen = []
    dm = ImageFolderDataModule(tree, batch_size=4, image_size=16, num_workers=0, decode="gpu", channels_last=True)
    model = _Recording(num_classes=2, cifar_stem=True, channels_last=True, mixup_alpha=0.2)
    trainer = L.Trainer(accelerator="cpu", devices=1, precision="bf16-mixed", max_steps=2, limit_val_batches=1,
                        val_check_interval=2, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(model, datamodule=dm)
    assert [s[0] for s in _Recording.seen] == ["train", "train", "eval"]
    assert all(dtype == torch.float32 and nhwc and not autocast for _, dtype, nhwc, autocast in _Recording.seen)


# ---- exact continuation --------------------------------------------------------------------------------


def _draws(loader: ResumableDataLoader, batches: int | None = None) -> list[tuple]:
    out = []
    for batch in loader:
        out.append((tuple(batch.names), tuple(batch.draws)))
        if len(out) == batches:
            break
    return out


@pytest.mark.parametrize("rank", [0, 1])
def test_the_draws_continue_bit_for_bit_after_a_loader_restart(tree, rank):
    """Rank ``rank`` of 2, two workers: stopped after 2 batches of epoch 1, a new loader restored from the state
    yields exactly the draws (and files) the uninterrupted loader went on with."""
    dataset = EncodedImageFolder([(f, i % 2) for i, f in enumerate(_files(tree))], TrainPipeline(32, random_erase=0.5))

    def loader() -> ResumableDataLoader:
        return resumable_loader(dataset, batch_size=3, seed=11, num_replicas=2, rank=rank, num_workers=2,
                                collate_fn=dataset.collate)

    straight = loader()
    straight.sampler.set_epoch(1)
    whole = _draws(straight)
    stopped = loader()
    stopped.sampler.set_epoch(1)
    head = _draws(stopped, batches=2)
    state = stopped.state_dict()
    resumed = loader()
    resumed.load_state_dict(state)
    resumed.sampler.set_epoch(1)
    assert head + _draws(resumed) == whole and len(whole) == 4


def _resume_args(root: Path, *extra: str) -> list[str]:
    # 24 images / (2 per device x 2 ranks) = 6 steps per epoch.
    return ["-m", "recipes.resnet", "--accelerator", "cpu", "--data", "imagefolder", "--data-dir", str(root),
            "--image-size", "16", "--min-crop-scale", "0.3", "--batch-size", "2", "--num-workers", "1",
            "--dropout", "0.3", "--lr", "0.05", "--devices", "2", "--decode", "gpu", "--random-erase", "0.3",
            "--max-epochs", "2", *extra]


@pytest.mark.slow  # three 2-rank runs: over 30 s
def test_sigterm_mid_epoch_then_resume_auto_at_two_ranks_is_exact(tmp_path, image_library):
    from tests.helpers import assert_same_weights

    root = write_jpeg_tree(tmp_path / "jpegs", per_class=12, val_per_class=3, side=20)
    run([*_resume_args(root), "--output-dir", str(tmp_path / "straight")], timeout=600, check=True)
    last = tmp_path / "split" / "checkpoints" / "last.ckpt"
    argv = [*_resume_args(root, "--checkpoint-every-n-steps", "1"), "--output-dir", str(tmp_path / "split")]
    proc = start(argv)
    seen = proc.wait_for_step(last, 2, timeout=240)
    proc.signal(signal.SIGTERM)  # the launcher, mid-epoch (epoch 0 has 6 steps)
    done = proc.finish(timeout=120)
    assert done.returncode == 128 + signal.SIGTERM, done.stderr[-3000:]
    assert seen <= saved_step(last) < 6  # saved within two steps of the signal, before the epoch's end
    run([*argv, "--resume", "auto"], timeout=600, check=True)
    assert saved_step(last) == 12
    assert_same_weights(tmp_path / "straight" / "checkpoints" / "last.ckpt", last)


def _decoder(noise_levels: int = 0, shift: int = 0, seed: int = 0):
    """The pack's CPU decoder (libjpeg-turbo), then every pixel moved by a random ``+-noise_levels`` (a decoder
    that rounds its IDCT and chroma upsampling otherwise, as nvJPEG does by a level or two) and by ``shift`` (a
    wrong decoder)."""
    decode_jpeg = image_decoders().decode_jpeg
    g = torch.Generator().manual_seed(seed)

    def moved(image: torch.Tensor) -> torch.Tensor:
        noise = torch.randint(-noise_levels, noise_levels + 1, image.shape, generator=g)
        return (image.to(torch.int16) + noise + shift).clamp(0, 255).to(torch.uint8)

    def decode(data, device, mode):
        images = decode_jpeg(data, device="cpu", mode=mode)
        return [moved(i) for i in images] if isinstance(images, list) else moved(images)

    return decode


@pytest.mark.parametrize("name", sorted(decode_pipelines()))
def test_a_correct_decoder_passes_the_gpu_checks_decode_comparison(tree, name):
    """The CPU twin of tests/gpu/test_gpu_decode.py's comparison: a decoder that differs by +-1 level everywhere
    (20 draws) agrees with libjpeg-turbo through the compared pipelines, and one that shifts every pixel by 30
    levels does not. (Through TrivialAugmentWide, whose Solarize and Posterize are thresholds, +-1 level broke
    the bound in every draw: why the comparison leaves the policy out.)"""
    pipeline = decode_pipelines()[name]
    files = sorted(str(p) for p in (tree / "train").rglob("*.jpg"))[:16]
    reference, _, _ = decoded_batch(files, pipeline, "cpu")
    for seed in range(20):
        x, _, _ = decoded_batch(files, pipeline, "cpu", jpeg_decoder=_decoder(noise_levels=1, seed=seed))
        agree, mean, worst = decoders_agree(x, reference)
        assert agree, (seed, mean, worst)
    wrong, _, _ = decoded_batch(files, pipeline, "cpu", jpeg_decoder=_decoder(shift=30))
    assert not decoders_agree(wrong, reference)[0]
