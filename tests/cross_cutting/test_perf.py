"""TF32 switches, FLOPs and MFU, and the input-pipeline wait: measured the way summary.json reports them."""

from __future__ import annotations

import time
import types

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from ddp_recipes.modules.mnist import MNISTClassifier
from ddp_recipes.modules.resnet import ResNetClassifier
from ddp_recipes.train import diagnostics, perf
from ddp_recipes.train.callbacks import ThroughputMeter
from ddp_recipes.train.diagnostics import DDPDiagnostics
from ddp_recipes.train.trainer import build_trainer
from tests.helpers import weights
from tests.tiny_modules import TinyNet


def test_tf32_switches_and_what_the_setup_print_says(monkeypatch, restore_tf32):
    monkeypatch.setattr(perf, "tf32_capable", lambda: True)  # an Ampere GPU, as far as the rule can tell
    perf.configure_tf32(True, "cuda")
    assert torch.get_float32_matmul_precision() == "high" and torch.backends.cudnn.allow_tf32
    assert perf.tf32_state("cuda").startswith("on")
    perf.configure_tf32(False, "cuda")
    assert torch.get_float32_matmul_precision() == "highest" and not torch.backends.cudnn.allow_tf32
    assert perf.tf32_state("cuda").startswith("off")
    torch.backends.cudnn.allow_tf32 = True
    assert perf.tf32_state("cuda").startswith("partly")
    monkeypatch.setattr(perf, "tf32_capable", lambda: False)
    assert "before Ampere" in perf.tf32_state("cuda")
    # CPU: nothing is touched, and the print says so.
    torch.set_float32_matmul_precision("highest")
    perf.configure_tf32(True, "cpu")
    assert torch.get_float32_matmul_precision() == "highest" and perf.tf32_state("cpu") == "n/a (CPU)"


def test_flops_per_sample_counts_forward_and_backward():
    example = torch.empty(32, 1, 28, 28)
    flops = perf.training_flops_per_sample(lambda: MNISTClassifier(arch="mlp"), example)
    forward = 2 * (784 * 128 + 128 * 10)
    # Backward: weight gradients of both layers, the input gradient of the second only (the input needs none).
    backward = 2 * (784 * 128 + 128 * 10) + 2 * 128 * 10
    assert flops == forward + backward


def test_grad_checkpointing_does_not_change_the_model_flops():
    example = torch.empty(4, 3, 32, 32)
    plain = perf.training_flops_per_sample(lambda: ResNetClassifier(cifar_stem=True), example)
    ckpt = perf.training_flops_per_sample(lambda: ResNetClassifier(cifar_stem=True, grad_checkpointing=True), example)
    assert plain == ckpt and 3e9 < plain < 4e9  # ResNet-18 at 32 px: ~1.1 GFLOPs forward, ~3x with backward


def test_unbuildable_model_has_no_flop_count():
    def build():
        raise OSError("weights file missing")

    assert perf.training_flops_per_sample(build, torch.empty(2, 3)) is None


def test_flops_summary_mfu_only_with_a_known_peak():
    known = perf.flops_summary(1_000, 500.0, world_size=2, peak_per_device=1_000_000)
    assert known["achieved_flops_per_sec"] == 500_000 and known["achieved_flops_per_sec_per_device"] == 250_000
    assert known["mfu"] == 0.25
    unknown = perf.flops_summary(1_000, 500.0, world_size=2, peak_per_device=None)
    assert unknown["mfu"] is None and unknown["achieved_flops_per_sec"] == 500_000
    assert perf.peak_flops(torch.device("cpu"), "32-true") is None


class HostClock:
    """The pack's host clock (``time.perf_counter``, as train/perf.py and train/diagnostics.py read it), moved
    only by what a test says costs time: a step's shares are then exact whatever the load on the host, so
    no assertion rests on a timing."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def spend(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch) -> HostClock:
    fake = HostClock()
    stand_in = types.SimpleNamespace(perf_counter=fake.perf_counter)  # anything else the modules read fails loudly
    monkeypatch.setattr(perf, "time", stand_in)
    monkeypatch.setattr(diagnostics, "time", stand_in)
    return fake


class SlowImages(Dataset):
    """A dataset whose every sample costs ``delay`` seconds of 'decoding' in the main process, on ``clock``."""

    def __init__(self, n: int, delay: float = 0.0, clock: HostClock | None = None) -> None:
        self.n, self.delay, self.clock = n, delay, clock

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if self.delay:
            self.clock.spend(self.delay)
        return torch.full((8,), float(i % 7)), i % 2


STEP_S = 0.02  # Busy's step on the test's clock


class Busy(TinyNet):
    """The suite's tiny net whose step costs ``STEP_S`` on the test's clock (the device's share of a step)."""

    def __init__(self, clock: HostClock) -> None:
        super().__init__(features=8)
        self.clock = clock

    def training_step(self, batch, batch_idx):
        self.clock.spend(STEP_S)
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize(("share", "bound"), [(0.8, True), (0.25, True), (0.15, False), (0.0, False)])
def test_input_wait_is_measured_and_an_input_bound_run_is_named(tmp_path, clock, share, bound):
    """The loop's wait for its batch, as a share of the step, is what the loader cost (and only that), and the
    diagnostic names a run above its 20% line, on either side of it."""
    meter, diag = ThroughputMeter(), DDPDiagnostics()
    trainer = build_trainer(accelerator="cpu", devices=1, max_steps=30, callbacks=[meter, diag], logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            default_root_dir=tmp_path)
    assert isinstance(trainer.profiler, perf.InputWaitProfiler)
    delay = STEP_S * share / (1 - share) / 8  # per sample, 8 per batch: the batch's wait is share of the step
    trainer.fit(Busy(clock), DataLoader(SlowImages(400, delay, clock), batch_size=8))
    fraction = meter.input_wait_fraction
    assert fraction == pytest.approx(share, abs=1e-9)
    codes = [code for code, _ in diag.findings]
    assert "input-bound" in diag.checked
    if bound:
        assert "input-bound" in codes and f"{share:.0%} of the step time" in dict(diag.findings)["input-bound"]
        message = dict(diag.findings)["input-bound"]
        assert "--num-workers" in message and "persistent_workers" in message
    else:
        assert "input-bound" not in codes


def test_a_users_profiler_is_kept():
    from lightning.pytorch.profilers import SimpleProfiler

    trainer = build_trainer(accelerator="cpu", devices=1, profiler=SimpleProfiler(), logger=False)
    assert isinstance(trainer.profiler, SimpleProfiler)
    assert perf.input_wait(trainer) is None


# ---- --compile -------------------------------------------------------------------------------------------

def _mnist(out, *extra: str) -> list[str]:
    """The MNIST recipe's flags, on made-up MNIST files beside ``out`` (the suite runs where ../shared is
    absent: the lent GPU machine's stack gets the working tree only)."""
    from tests.helpers import write_synthetic_mnist

    data = out.parent / "synthetic-mnist"
    if not (data / "MNIST").exists():
        write_synthetic_mnist(data, n_train=2048, n_test=256)
    return ["--accelerator", "cpu", "--data-dir", str(data), "--no-download", "--output-dir", str(out),
            "--max-steps", "12", "--seed", "5", *extra]


def test_compile_one_device_reports_compile_time_and_keeps_plain_checkpoint_keys(tmp_path):
    """Plumbing at one device with the aot_eager backend (no code generation, seconds)."""
    from recipes import mnist

    eager = mnist.main(_mnist(tmp_path / "eager"))
    compiled = mnist.main(_mnist(tmp_path / "compiled", "--compile", "--compile-backend", "aot_eager"))
    assert eager["compile_seconds"] is None and compiled["compile_seconds"] > 0
    assert compiled["first_step_seconds"] >= compiled["compile_seconds"]
    a, b = weights(tmp_path / "eager" / "final.ckpt"), weights(tmp_path / "compiled" / "final.ckpt")
    assert a.keys() == b.keys()  # no "_orig_mod." prefix: a compiled run's checkpoint loads into a plain module
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-6)


def test_lightning_compiles_the_step_methods_not_only_forward(tmp_path):
    """What the pack's --compile comments and docs state (train/run.py, bench/harness/worker.py): Lightning unwraps a
    ``torch.compile``d module and compiles its forward *and* its training/validation step methods, so the
    loss and the step's own code are traced too, and the first step's compile time covers them."""
    from torch.utils.data import DataLoader, TensorDataset

    from ddp_recipes.train.trainer import build_trainer

    class Steps(TinyNet):
        """Records whether each method ran under the compiler."""

        def __init__(self) -> None:
            super().__init__()
            self.traced = {}

        def forward(self, x):
            self.traced["forward"] = torch.compiler.is_compiling()
            return super().forward(x)

        def training_step(self, batch, batch_idx):
            self.traced["training_step"] = torch.compiler.is_compiling()
            return super().training_step(batch, batch_idx)

        def validation_step(self, batch, batch_idx):
            self.traced["validation_step"] = torch.compiler.is_compiling()

    module = Steps()
    data = DataLoader(TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,))), batch_size=4)
    trainer = build_trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                            limit_val_batches=1, val_check_interval=1, default_root_dir=tmp_path)
    trainer.fit(torch.compile(module, backend="eager"), data, data)
    assert module.traced == {"forward": True, "training_step": True, "validation_step": True}


def test_bad_compile_backend_is_named(tmp_path, capsys):
    from recipes import mnist

    with pytest.raises(SystemExit):
        mnist.main(_mnist(tmp_path / "run", "--compile", "--compile-backend", "warp-drive"))
    err = capsys.readouterr().err.strip()
    assert "--compile-backend must be one of" in err and "inductor" in err and err.count("\n") == 0


@pytest.mark.slow
@pytest.mark.parametrize(("backend", "tolerance"), [("aot_eager", 1e-5), ("inductor", 1e-4)])
def test_compiled_two_ranks_train_like_one_eager_process_at_twice_the_batch(tmp_path, backend, tolerance):
    """2 ranks x batch 32 compiled (DDPOptimizer inside DDP) == 1 eager process x batch 64, to ``tolerance``
    (inductor fuses and reorders float arithmetic; aot_eager runs the same kernels)."""
    import json

    from recipes import mnist
    from tests.launch import run

    run(["-m", "recipes.mnist", *_mnist(tmp_path / "ddp", "--devices", "2", "--batch-size", "32", "--compile",
                                         "--compile-backend", backend)], timeout=900, check=True)
    mnist.main(_mnist(tmp_path / "one", "--batch-size", "64"))
    a, b = weights(tmp_path / "one" / "final.ckpt"), weights(tmp_path / "ddp" / "final.ckpt")
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=tolerance, atol=tolerance)
    summary = json.loads((tmp_path / "ddp" / "summary.json").read_text())
    assert summary["compile_seconds"] > 0 and summary["world_size"] == 2


def test_input_bound_is_summed_over_short_epochs(tmp_path, clock):
    """7 steps per epoch, 3 epochs: no epoch alone has enough steps; the fit does."""
    diag = DDPDiagnostics()
    trainer = build_trainer(accelerator="cpu", devices=1, max_epochs=3, callbacks=[diag], logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            default_root_dir=tmp_path)
    trainer.fit(Busy(clock), DataLoader(SlowImages(56, 0.01, clock), batch_size=8))  # 7 steps per epoch
    assert "input-bound" in [code for code, _ in diag.findings]


def test_input_bound_names_the_rank_that_waited():
    """Under DDP the fast ranks wait in the all-reduce, not for data: the slow rank's own wait decides."""
    diag = DDPDiagnostics()
    rows = torch.tensor([[0.02, 2.0, 20], [1.6, 2.0, 20]], dtype=torch.float64)  # rank 1 waited 80%
    diag._check_input_wait(None, rows)
    message = dict(diag.findings)["input-bound"]
    assert "80% of the step time on rank 1" in message


def test_a_toy_steps_sub_millisecond_wait_is_not_input_bound():
    """A large share of a tiny step (0.6 ms of 2.7 ms) is below INPUT_MIN_WAIT_S: nothing a user should fix."""
    diag = DDPDiagnostics()
    diag._check_input_wait(None, torch.tensor([[0.012, 0.054, 20]], dtype=torch.float64))  # 22%, 0.6 ms/step
    assert "input-bound" in diag.checked and not diag.findings


class _SlowValidation(TinyNet):
    def __init__(self) -> None:
        super().__init__(features=8)

    def validation_step(self, batch, batch_idx):
        time.sleep(0.01)


def test_validation_inside_an_epoch_is_not_step_time(tmp_path):
    meter = ThroughputMeter()
    trainer = build_trainer(accelerator="cpu", devices=1, max_steps=30, callbacks=[meter], logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            default_root_dir=tmp_path, val_check_interval=5, num_sanity_val_steps=0,
                            limit_val_batches=2)
    data = DataLoader(SlowImages(400), batch_size=8)
    trainer.fit(_SlowValidation(), data, data)
    # 30 steps give 29 intervals; each of the 5 validations inside the epoch (after steps 5..25) drops one.
    assert len(meter.intervals) == 29 - 5
