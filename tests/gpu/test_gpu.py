"""The GPU tier (``make test-gpu``): the CUDA paths a CPU run never reaches, each test asserting what it names.

One GPU: the CUDA recipe; GradScaler scaling under 16-mixed (scale != 1, an inf step skipped); fp16/bf16
activations seen by a forward hook; channels-last strides reaching every convolution; TF32; compile; grad
checkpointing equal to none; torch's SyncBatchNorm conversion; the bench raw path; the doctor; SIGKILL +
``--resume auto`` bit-identical. Two or more GPUs (NCCL): training equal to one process at twice the batch,
SyncBatchNorm converted and equivalent, each comm hook registered (DDP's logging data) and changing what is
sent, PowerSGD state restored across a kill, DDP + compile, the bench dp path. Without CUDA every test
skips and the tier exits 0.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.helpers import write_synthetic_mnist
from tests.launch import run, start

pytestmark = pytest.mark.gpu
CUDA = torch.cuda.is_available()
one_gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
two_gpus = pytest.mark.skipif(not CUDA or torch.cuda.device_count() < 2, reason="needs 2+ CUDA GPUs")
ampere = pytest.mark.skipif(not CUDA or torch.cuda.get_device_capability()[0] < 8, reason="needs an Ampere+ GPU")
TINY_RESNET = ["--accelerator", "gpu", "--devices", "1", "--data", "synthetic", "--image-size", "32",
               "--synthetic-samples", "512", "--synthetic-val-samples", "128", "--batch-size", "64"]
SCENARIOS = Path(__file__).resolve().parents[1] / "scenarios" / "gpu_scenarios.py"
INF_STEP = 10  # _fit_tiny's step whose loss is made inf (16-mixed: the GradScaler must skip it)


class _Conv(nn.Module):
    """A small conv net; a forward hook on its convolution records the dtype it produced."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.head = nn.Sequential(nn.BatchNorm2d(16), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                  nn.Linear(16, 10))
        self.seen: set[torch.dtype] = set()
        self.conv.register_forward_hook(lambda mod, inputs, out: self.seen.add(out.dtype))

    def forward(self, x):
        return self.head(self.conv(x))


def _fit_tiny(precision: str, tmp_path, inf_step: int | None = None):
    import lightning as L
    from lightning.pytorch.callbacks import Callback
    from torch.utils.data import DataLoader, TensorDataset

    from ddp_recipes.train.trainer import build_trainer

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net, self.losses = _Conv(), []

        def training_step(self, batch, batch_idx):
            loss = nn.functional.cross_entropy(self.net(batch[0]), batch[1])
            if self.global_step == inf_step:
                loss = loss * float("inf")  # inf/nan gradients: a scaler must skip this optimizer step
            self.losses.append(float(loss))
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    class Steps(Callback):
        """Per step: did the weights change, and the scale before and after."""

        def __init__(self) -> None:
            self.changed: list[bool] = []
            self.scales: list[tuple[float, float]] = []

        def _scale(self, trainer) -> float:
            scaler = getattr(trainer.precision_plugin, "scaler", None)
            return scaler.get_scale() if scaler is not None else 1.0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self.before = pl_module.net.conv.weight.detach().clone()
            self.scale_before = self._scale(trainer)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.changed.append(not torch.equal(self.before, pl_module.net.conv.weight))
            self.scales.append((self.scale_before, self._scale(trainer)))

    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 3, 16, 16, generator=g)
    y = (x[:, 0].mean((1, 2)) > 0).long()  # learnable: the sign of the first channel's mean
    steps = Steps()
    trainer = build_trainer(accelerator="gpu", devices=1, precision=precision, max_steps=40, seed=0, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, default_root_dir=tmp_path,
                            callbacks=[steps])
    module = Module()
    trainer.fit(module, DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True))
    return trainer, module, steps


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
def test_16_mixed_grad_scaler_scales_and_skips_an_inf_step(tmp_path):
    trainer, module, steps = _fit_tiny("16-mixed", tmp_path, inf_step=INF_STEP)
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    assert isinstance(scaler, torch.amp.GradScaler) and scaler.is_enabled()
    assert module.net.seen == {torch.float16}
    assert scaler.get_scale() != 1.0  # the loss is really scaled (init 65536, halved per overflow)
    before, after = steps.scales[INF_STEP]
    assert not steps.changed[INF_STEP] and after == before * scaler.get_backoff_factor()  # skipped, backed off
    finite = [i for i in range(len(steps.changed)) if i != INF_STEP and steps.scales[i][1] == steps.scales[i][0]]
    assert finite and all(steps.changed[i] for i in finite)  # every step the scaler kept moved the weights
    assert sum(module.losses[-5:]) < sum(module.losses[:5])


@one_gpu
def test_bf16_mixed_activations_are_bfloat16(tmp_path):
    if not torch.cuda.is_bf16_supported(including_emulation=False):
        pytest.skip("this GPU has no native bf16")
    trainer, module, steps = _fit_tiny("bf16-mixed", tmp_path)
    assert module.net.seen == {torch.bfloat16}
    assert getattr(trainer.precision_plugin, "scaler", None) is None  # bf16 needs no loss scaling
    assert sum(module.losses[-5:]) < sum(module.losses[:5])


@one_gpu
@pytest.mark.parametrize("channels_last", [True, False])
def test_channels_last_strides_reach_every_convolution(channels_last):
    """A forward hook on every Conv2d sees NHWC inputs and weights with --channels-last, NCHW without (so
    the check can tell the two apart), in a training-mode bf16 forward and backward on CUDA."""
    from ddp_recipes.modules.resnet import ResNetClassifier

    module = ResNetClassifier(cifar_stem=True, channels_last=channels_last).cuda().train()
    seen: list[tuple[bool, bool]] = []

    def hook(conv, inputs, out):
        seen.append((inputs[0].is_contiguous(memory_format=torch.channels_last),
                     conv.weight.is_contiguous(memory_format=torch.channels_last)))

    convs = [m for m in module.modules() if isinstance(m, nn.Conv2d)]
    for conv in convs:
        conv.register_forward_hook(hook)
    x = torch.randn(8, 3, 32, 32, device="cuda")  # the loader's NCHW batch
    with torch.autocast("cuda", dtype=torch.bfloat16):
        module(x).float().sum().backward()
    assert len(seen) == len(convs) > 10
    stem_input = seen[0][0]
    assert stem_input is channels_last  # 3 channels, 32x32: NCHW and NHWC strides differ here
    if channels_last:
        assert all(inp and weight for inp, weight in seen)


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
@pytest.mark.compiles
def test_compile_on_cuda_trains_like_eager(tmp_path):
    from recipes import mnist

    data = write_synthetic_mnist(tmp_path / "data", n_train=2048, n_test=256)  # ../shared does not travel here
    common = ["--accelerator", "gpu", "--data-dir", str(data), "--no-download", "--max-steps", "20",
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


@one_gpu
def test_grad_checkpointing_on_cuda_equals_no_checkpointing(restore_tf32):
    from ddp_recipes.modules.resnet import ResNetClassifier

    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    plain = ResNetClassifier(cifar_stem=True).cuda().train()
    ckpt = ResNetClassifier(cifar_stem=True, grad_checkpointing=True).cuda().train()
    ckpt.load_state_dict(plain.state_dict())
    x, y = torch.randn(16, 3, 32, 32, device="cuda"), torch.randint(0, 10, (16,), device="cuda")
    losses = []
    for module in (plain, ckpt):
        loss = nn.functional.cross_entropy(module(x), y)
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    grads = dict(plain.named_parameters())
    for name, p in ckpt.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


BENCH_TINY = {"recipe": "resnet", "arch": "resnet18", "image_size": 32, "batch_size": 32, "steps": 5,
              "warmup_steps": 2, "precision": "bf16-mixed", "accelerator": "cuda", "threads": 0, "seed": 0,
              "data_dir": "", "channels_last": 1}


@one_gpu
def test_bench_raw_path_on_one_gpu(tmp_path):
    from ddp_recipes.bench.speedup.run import run_worker

    raw = run_worker("raw", 1, BENCH_TINY, tmp_path)
    assert raw["impl"] == "raw" and raw["devices"] == 1 and raw["measured_steps"] == 5
    assert raw["global_samples_per_s"] > 0 and raw["peak_mem_mb_per_rank"][0] > 0  # it ran on the GPU


@one_gpu
def test_synthetic_bench_data_fetches_without_a_host_sync():
    """The bench's per-step fetch on CUDA: the indices go over pinned and non-blocking, so sync-debug's
    "error" mode (any synchronizing call raises) lets a whole batch through."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from ddp_recipes.bench.harness.synthetic import RankShard

    class CopySources(TorchDispatchMode):
        """Whether each host tensor copied to the device was pinned: a pageable non-blocking copy blocks
        the host just the same, and sync-debug does not see it."""

        def __init__(self) -> None:
            super().__init__()
            self.pinned: list[bool] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._to_copy.default and args[0].device.type == "cpu":
                self.pinned.append(args[0].is_pinned())
            return func(*args, **(kwargs or {}))

    data = RankShard(64, (3, 8, 8), seed=0, device="cuda")
    data.materialize()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        x, y = data.__getitems__(list(range(0, 64, 8)))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert x.is_cuda and x.shape == (8, 3, 8, 8) and y.shape == (8,)
    with CopySources() as seen:
        data.__getitems__([0, 8])
    assert seen.pinned == [True]


@one_gpu
def test_doctor_on_one_gpu_passes_over_nccl(tmp_path):
    report = tmp_path / "doctor.json"
    run(["-m", "ddp_recipes.doctor", "--devices", "1", "--accelerator", "cuda", "--max-bytes", "1M",
         "--json", report], port=False, check=True)
    found = json.loads(report.read_text())
    assert found["result"] == "PASS" and found["config"]["backend"] == "nccl" and found["world_size"] == 1


# ---- SIGKILL + --resume auto on CUDA, through the recipe's main([...]) --------------------------------

def _kill_resume_matches_straight(tmp_path, argv: list[str], steps: int, kill_from: int) -> Path:
    from tests.helpers import assert_same_weights
    from tests.launch import saved_step
    from tests.resume_scenario import CAPTURED_STEP_LIMIT_S

    recipe = [SCENARIOS, "recipe", *argv]  # the recipe's main([...]) under gpu_scenarios.py's spies
    run([*recipe, "--output-dir", tmp_path / "straight"], timeout=600, check=True)
    last = tmp_path / "split" / "checkpoints" / "last.ckpt"
    split = [*recipe, "--output-dir", tmp_path / "split", "--checkpoint-every-n-steps", "1"]
    # The kill step is drawn (the moment varies run to run), printed and replayable: GPU_KILL_STEP=N.
    seed = int(os.environ.get("GPU_KILL_SEED", os.getpid()))
    target = int(os.environ.get("GPU_KILL_STEP") or random.Random(seed).randint(kill_from, steps - 2))
    moment = f"kill at the first checkpoint of step >= {target} (GPU_KILL_SEED={seed}; replay: GPU_KILL_STEP={target})"
    print(moment, flush=True)
    proc = start(split)
    seen = proc.wait_for_step(last, target, timeout=CAPTURED_STEP_LIMIT_S)
    proc.kill()  # no grace: the ranks and the loader workers
    assert seen < steps, f"the run finished before it could be killed; {moment}"
    run([*split, "--resume", "auto"], timeout=600, check=True)
    assert saved_step(last) == steps, moment
    try:
        assert_same_weights(tmp_path / "straight" / "checkpoints" / "last.ckpt", last)
    except AssertionError as err:
        raise AssertionError(f"{err}; killed after step {seen}: {moment}") from None
    return last


CUDA_RESUME = ["--accelerator", "cuda", "--data", "synthetic", "--image-size", "32", "--synthetic-samples", "256",
               "--synthetic-val-samples", "64", "--batch-size", "32", "--dropout", "0.3", "--lr", "0.05",
               "--warmup-epochs", "0.5", "--max-epochs", "2"]  # 8 steps per epoch on one GPU


@one_gpu
def test_cuda_kill_and_resume_auto_is_bit_identical(tmp_path):
    _kill_resume_matches_straight(tmp_path, [*CUDA_RESUME, "--devices", "1"], steps=16, kill_from=2)


# ---- two or more GPUs: NCCL --------------------------------------------------------------------------

def _scenario(tmp_path, *args: str) -> dict[int, dict]:
    """tests/scenarios/ddp_scenarios.py on GPUs (NCCL), through gpu_scenarios.py's all-reduce spy."""
    out = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
    script = SCENARIOS
    run([script, args[0], out, *args[1:], "--accelerator", "gpu", "--no-tf32"], check=True)
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
def test_nccl_sync_batchnorm_converted_under_ddp_and_matches_one_process(tmp_path):
    synced = _scenario(tmp_path, "train", "--devices", "2", "--batch", "8", "--batchnorm", "--sync-batchnorm")
    single = _scenario(tmp_path, "train", "--devices", "1", "--batch", "16", "--batchnorm")
    assert [synced[r]["record"]["norms"] for r in (0, 1)] == [["SyncBatchNorm"]] * 2  # converted before the wrap
    assert single[0]["record"]["norms"] == ["BatchNorm1d"]
    assert _max_rel_diff(synced[0]["state"], single[0]["state"]) <= 1e-5


@two_gpus
@pytest.mark.parametrize("hook", ["fp16", "bf16", "powersgd"])
def test_comm_hook_is_registered_and_changes_what_is_sent(tmp_path, hook):
    """DDP's logging data names the hook; the spy on torch.distributed.all_reduce sees what it sends. The
    scenario's net fits one gradient bucket, so each step is one bucket all-reduce."""
    steps = 6
    ranks = _scenario(tmp_path, "train", "--devices", "2", "--batch", "8", "--steps", str(steps), "--comm-hook", hook)
    assert _max_rel_diff(ranks[0]["state"], ranks[1]["state"]) == 0
    record = ranks[0]["record"]
    name = {"fp16": "fp16_compress_hook", "bf16": "bf16_compress_hook", "powersgd": "powerSGD_hook"}[hook]
    assert record["comm_hook"] == name
    full = record["grad_numel"] * 4  # the fp32 bucket plain DDP would send
    sent = record["sent"]
    if hook in ("fp16", "bf16"):
        dtype = {"fp16": "float16", "bf16": "bfloat16"}[hook]
        assert [b for d, b in sent if d == dtype] == [full // 2] * steps  # half the bytes, every step
        assert not [b for d, b in sent if b == full]
    else:  # uncompressed for the first powersgd_start_iter (2) steps, then low-rank P and Q only
        assert [b for d, b in sent if b == full] == [full] * 2
        assert sum(1 for d, b in sent if d == "float32" and b < full) >= 2 * (steps - 2)


@two_gpus
def test_nccl_powersgd_state_restored_after_a_kill(tmp_path):
    last = _kill_resume_matches_straight(
        tmp_path, [*CUDA_RESUME, "--devices", "2", "--comm-hook", "powersgd", "--synthetic-samples", "512"],
        steps=16, kill_from=11)  # 8 steps per epoch at 2 ranks; PowerSGD compresses from iteration 10
    states = torch.load(last, map_location="cpu", weights_only=True)["callbacks"]["ResumeState"]["comm_hook"]
    assert len(states) == 2 and states[0]["iter"] >= 10


@two_gpus
@pytest.mark.compiles
def test_ddp_and_compile_on_nccl_train_like_eager(tmp_path):
    common = [*CUDA_RESUME, "--devices", "2", "--no-tf32", "--max-epochs", "1"]
    summaries = []
    for name, extra in (("eager", []), ("compiled", ["--compile"])):
        run([SCENARIOS, "recipe", *common, *extra, "--output-dir", tmp_path / name], timeout=600, check=True)
        summaries.append(json.loads((tmp_path / name / "summary.json").read_text()))
    eager, compiled = summaries
    assert compiled["world_size"] == 2 and compiled["compile_seconds"] > 0
    assert compiled["final_train_loss"] == pytest.approx(eager["final_train_loss"], rel=1e-2)


@two_gpus
def test_bench_dp_path_on_two_gpus(tmp_path):
    from ddp_recipes.bench.speedup.run import run_worker

    dp = run_worker("dp", 2, BENCH_TINY, tmp_path)
    assert dp["impl"] == "dp" and dp["devices"] == 2 and dp["global_samples_per_s"] > 0
    assert len(dp["peak_mem_mb_per_rank"]) == 2 and min(dp["peak_mem_mb_per_rank"]) > 0  # both GPUs worked
    assert dp["autocast_dtype"] == "bfloat16"  # what the replicas' layers were seen computing in


@one_gpu
def test_resume_restores_the_own_cuda_generator(tmp_path):
    """The rank's device generator alone goes through a weights_only checkpoint round trip; draws repeat."""
    import lightning as L

    from ddp_recipes.checkpointing.exact_continuation import rng_state, set_rng_state
    from ddp_recipes.data.images import SyntheticImageDataModule

    device = torch.device("cuda", torch.cuda.current_device())
    torch.save(rng_state(device), tmp_path / "rng.pt")
    first = torch.rand(8, device=device)
    saved = torch.load(tmp_path / "rng.pt", weights_only=True)
    assert isinstance(saved["cuda"], torch.Tensor)
    set_rng_state(saved, device)
    assert torch.equal(torch.rand(8, device=device), first)
    dm = SyntheticImageDataModule(num_samples=8, image_size=8)
    dm.trainer = L.Trainer(accelerator="gpu", devices=1, logger=False, enable_checkpointing=False)
    assert dm.pin_memory is True
    from ddp_recipes.data.mnist import MNISTDataModule

    mnist_dm = MNISTDataModule(tmp_path)
    mnist_dm.trainer = dm.trainer
    assert mnist_dm.pin_memory is True  # the MNIST DataModule pins on CUDA too
