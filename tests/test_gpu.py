"""The GPU tier (``make test-gpu``): the CUDA paths a CPU run never reaches.

One GPU: the CUDA single-device recipe, 16-mixed with its GradScaler, bf16-mixed, channels-last,
``--compile``, TF32 in force, torch's SyncBatchNorm conversion and revert. Two or more GPUs: NCCL training
equal to one process at twice the batch, SyncBatchNorm equivalence, comm hooks on NCCL. Without CUDA every
test skips and the tier exits 0.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.helpers import SHARED_DATA

pytestmark = pytest.mark.gpu
CUDA = torch.cuda.is_available()
one_gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
two_gpus = pytest.mark.skipif(not CUDA or torch.cuda.device_count() < 2, reason="needs 2+ CUDA GPUs")
ampere = pytest.mark.skipif(not CUDA or torch.cuda.get_device_capability()[0] < 8, reason="needs an Ampere+ GPU")
TINY_RESNET = ["--accelerator", "gpu", "--devices", "1", "--data", "synthetic", "--image-size", "32",
               "--synthetic-samples", "512", "--synthetic-val-samples", "128", "--batch-size", "64"]


class _Conv(nn.Module):
    """A small conv net that records the dtype its first convolution produced."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.head = nn.Sequential(nn.BatchNorm2d(16), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                  nn.Linear(16, 10))
        self.seen: torch.dtype | None = None

    def forward(self, x):
        h = self.conv(x)
        self.seen = h.dtype
        return self.head(h)


def _fit_tiny(precision: str, tmp_path):
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from ddp_recipes.train.trainer import build_trainer

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net, self.losses = _Conv(), []

        def training_step(self, batch, batch_idx):
            loss = nn.functional.cross_entropy(self.net(batch[0]), batch[1])
            self.losses.append(float(loss))
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 3, 16, 16, generator=g)
    y = (x[:, 0].mean((1, 2)) > 0).long()  # learnable: the sign of the first channel's mean
    trainer = build_trainer(accelerator="gpu", devices=1, precision=precision, max_steps=40, seed=0, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, default_root_dir=tmp_path)
    module = Module()
    trainer.fit(module, DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True))
    return trainer, module


# ---- one GPU -------------------------------------------------------------------------------------------

@one_gpu
def test_cuda_single_device_recipe(tmp_path):
    from recipes import resnet

    summary = resnet.main([*TINY_RESNET, "--max-steps", "8", "--output-dir", str(tmp_path)])
    assert summary["world_size"] == 1 and summary["steps"] == 8 and 0 <= summary["test_acc"] <= 1
    assert summary["flops_per_sample"] > 0 and summary["achieved_flops_per_sec"] > 0
    from ddp_recipes.train.perf import peak_flops

    if peak_flops(torch.device("cuda", 0), "32-true") is not None:  # a GPU in Lightning's table
        assert 0 < summary["mfu"] < 1


@one_gpu
def test_16_mixed_trains_with_a_grad_scaler(tmp_path):
    trainer, module = _fit_tiny("16-mixed", tmp_path)
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    assert isinstance(scaler, torch.amp.GradScaler) and scaler.get_scale() > 0
    assert module.net.seen == torch.float16
    assert sum(module.losses[-5:]) < sum(module.losses[:5])


@one_gpu
def test_bf16_mixed_trains_in_bfloat16(tmp_path):
    if not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16")
    trainer, module = _fit_tiny("bf16-mixed", tmp_path)
    assert module.net.seen == torch.bfloat16
    assert sum(module.losses[-5:]) < sum(module.losses[:5])


@one_gpu
def test_channels_last_forward_matches_on_cuda(restore_tf32):
    from ddp_recipes.modules.resnet import ResNetClassifier

    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False  # exact comparison: full FP32
    torch.manual_seed(0)
    plain = ResNetClassifier(cifar_stem=True).cuda().eval()
    nhwc = ResNetClassifier(cifar_stem=True, channels_last=True).cuda().eval()
    nhwc.load_state_dict(plain.state_dict())
    assert nhwc.model.conv1.weight.is_contiguous(memory_format=torch.channels_last)
    x = torch.randn(8, 3, 32, 32, device="cuda")
    with torch.no_grad():
        torch.testing.assert_close(nhwc(x), plain(x), rtol=1e-4, atol=1e-4)


@ampere
def test_tf32_in_force_and_off_with_the_flag(restore_tf32):
    from ddp_recipes.train.perf import tf32_state
    from ddp_recipes.train.trainer import build_trainer

    build_trainer(accelerator="gpu", devices=1, logger=False)
    assert torch.get_float32_matmul_precision() == "high" and torch.backends.cudnn.allow_tf32
    assert tf32_state("cuda").startswith("on")
    build_trainer(accelerator="gpu", devices=1, logger=False, tf32=False)
    assert torch.get_float32_matmul_precision() == "highest" and not torch.backends.cudnn.allow_tf32
    assert tf32_state("cuda").startswith("off")


@one_gpu
@pytest.mark.skipif(not (SHARED_DATA / "MNIST").exists(), reason="shared mini-MNIST missing")
def test_compile_on_cuda_trains_like_eager(tmp_path):
    from recipes import mnist

    common = ["--accelerator", "gpu", "--data-dir", str(SHARED_DATA), "--no-download", "--max-steps", "20",
              "--seed", "3", "--no-tf32"]
    eager = mnist.main([*common, "--output-dir", str(tmp_path / "eager")])
    compiled = mnist.main([*common, "--output-dir", str(tmp_path / "compiled"), "--compile"])
    assert compiled["compile_seconds"] > 0
    assert compiled["final_train_loss"] == pytest.approx(eager["final_train_loss"], rel=1e-3)


@one_gpu
def test_torch_sync_batchnorm_conversion_and_revert():
    from ddp_recipes.ddp.syncbn import SyncBatchNormPlugin

    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    model[1].running_mean.fill_(0.5)
    converted = SyncBatchNormPlugin("cuda").apply(model)
    assert isinstance(converted[1], nn.SyncBatchNorm)  # torch's NCCL implementation on CUDA
    reverted = SyncBatchNormPlugin("cuda").revert(converted)
    assert type(reverted[1]) is nn.BatchNorm2d
    assert torch.all(reverted[1].running_mean == 0.5)


# ---- two or more GPUs: NCCL --------------------------------------------------------------------------

def _scenario(tmp_path, *args: str) -> dict[int, dict]:
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tests.helpers import free_port

    out = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
    script = Path(__file__).with_name("ddp_scenarios.py")
    env = {**os.environ, "MASTER_PORT": str(free_port()), "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, str(script), args[0], str(out), *args[1:], "--accelerator", "gpu",
                           "--no-tf32"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {int(p.stem.removeprefix("rank")): torch.load(p, weights_only=False) for p in out.glob("rank*.pt")}


def _max_rel_diff(a: dict, b: dict) -> float:
    return max(((a[k].float() - b[k].float()).abs().max() / (b[k].float().abs().max() + 1e-12)).item()
               for k in a if a[k].is_floating_point())


@two_gpus
def test_nccl_two_ranks_at_b_equal_one_process_at_2b(tmp_path):
    two = _scenario(tmp_path, "train", "--devices", "2", "--batch", "8", "--steps", "6")
    one = _scenario(tmp_path, "train", "--devices", "1", "--batch", "16", "--steps", "6")
    assert _max_rel_diff(two[0]["state"], two[1]["state"]) == 0
    assert _max_rel_diff(two[0]["state"], one[0]["state"]) <= 1e-5


@two_gpus
def test_nccl_sync_batchnorm_matches_one_process(tmp_path):
    synced = _scenario(tmp_path, "train", "--devices", "2", "--batch", "8", "--batchnorm", "--sync-batchnorm")
    single = _scenario(tmp_path, "train", "--devices", "1", "--batch", "16", "--batchnorm")
    assert _max_rel_diff(synced[0]["state"], single[0]["state"]) <= 1e-5


@two_gpus
@pytest.mark.parametrize("hook", ["fp16", "bf16", "powersgd"])
def test_comm_hooks_on_nccl_keep_ranks_identical(tmp_path, hook):
    ranks = _scenario(tmp_path, "train", "--devices", "2", "--batch", "8", "--steps", "6", "--comm-hook", hook)
    assert _max_rel_diff(ranks[0]["state"], ranks[1]["state"]) == 0
    assert ranks[0]["record"]["global_step"] == 6
