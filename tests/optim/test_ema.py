"""ModelEMA: the average follows the reference's formula (every k optimizer steps, accumulation, warm-up
copies), stays out of the DDP-wrapped module, agrees across 2 gloo ranks, resumes exactly, and
ImageClassifier evaluates it (``val_acc_ema``...)."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.optim.swa_utils import AveragedModel

from ddp_recipes.errors import ConfigError
from ddp_recipes.optim.ema import ModelEMA, adjusted_decay, ema_state_dict
from tests.launch import run
from tests.tiny_modules import CLASSES, FEATURES, TinyClassifier, TinyNet, classifier_data, classifier_loader

SCRIPT = Path(__file__).resolve().parents[1] / "scenarios" / "ema_scenarios.py"


def trainer(callbacks: list[Callback], **kwargs) -> L.Trainer:
    kwargs = {"max_steps": -1, "num_sanity_val_steps": 0, "enable_checkpointing": False, **kwargs}
    return L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, callbacks=callbacks, **kwargs)


def module(seed: int = 0) -> TinyClassifier:
    torch.manual_seed(seed)
    return TinyClassifier()


def snapshot(net: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


class Recorder(Callback):
    """After every optimizer step: the network's weights and (when given) the EMA callback's average."""

    def __init__(self, ema: ModelEMA | None = None) -> None:
        self.ema, self.weights, self.averages, self.n_averaged = ema, {}, {}, {}

    def on_train_start(self, trainer, pl_module) -> None:
        self.last = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step == self.last:
            return  # an accumulation batch
        self.last = step
        self.weights[step] = snapshot(pl_module.model)
        if self.ema is not None and self.ema.network is not None:
            self.averages[step], self.n_averaged[step] = snapshot(self.ema.network), self.ema.n_averaged


def ema_step(average: dict, weights: dict, decay: float) -> dict:
    """One EMA update by hand, integer buffers as torch's average casts them back (truncated)."""
    return {k: (decay * a + (1 - decay) * weights[k]) if a.is_floating_point()
            else (a * decay + weights[k] * (1 - decay)).to(a.dtype) for k, a in average.items()}


def assert_state_close(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for k, v in expected.items():
        if v.is_floating_point():
            torch.testing.assert_close(actual[k], v, rtol=1e-6, atol=1e-7, msg=k)
        else:
            assert torch.equal(actual[k], v), k


def assert_state_equal(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for k, v in expected.items():
        assert torch.equal(actual[k], v), f"{k} differs"


# ---- the average --------------------------------------------------------------------------------------

def test_updates_every_k_optimizer_steps_with_accumulation():
    decay, every = 0.8, 2
    ema = ModelEMA(decay=decay, update_every=every)
    record = Recorder()
    # 64 samples / batch 4 = 16 batches, accumulated in pairs: 6 optimizer steps in one epoch.
    trainer([record, ema], max_steps=6, accumulate_grad_batches=2).fit(module(), classifier_loader(64, 4))
    assert sorted(record.weights) == [1, 2, 3, 4, 5, 6]  # one record per optimizer step, not per batch
    expected = record.weights[2]  # the first update copies
    for step in (4, 6):
        expected = ema_step(expected, record.weights[step], decay)
    assert_state_close(snapshot(ema.network), expected)
    assert ema.n_averaged == 3
    # Buffers are averaged too: the running statistics differ from the network's last ones.
    assert not torch.allclose(ema.network[1].running_mean, record.weights[6]["1.running_mean"])


def test_warmup_copies_then_averages():
    decay = 0.5
    ema = ModelEMA(decay=decay, update_every=1, warmup_epochs=1.0)
    record = Recorder(ema)
    # 16 samples / batch 4: 4 optimizer steps per epoch, so the warm-up is steps 1..4.
    trainer([ema, record], max_steps=7).fit(module(), classifier_loader(16, 4))
    for step in range(1, 6):  # the warm-up's updates and the first one after it copy
        assert_state_equal(record.averages[step], record.weights[step])
    assert [record.n_averaged[s] for s in range(1, 8)] == [0, 0, 0, 0, 1, 2, 3]
    expected = ema_step(record.weights[5], record.weights[6], decay)
    assert_state_close(record.averages[6], expected)
    assert_state_close(record.averages[7], ema_step(expected, record.weights[7], decay))


def test_average_lives_outside_the_module_without_grads():
    lit = module()
    keys = sorted(lit.state_dict())
    ema = ModelEMA(decay=0.9, update_every=1)
    trainer([ema], max_steps=2).fit(lit, classifier_loader(16, 4))
    assert sorted(lit.state_dict()) == keys  # nothing DDP would broadcast or checkpoint as the module's
    assert not any(isinstance(m, AveragedModel) for m in lit.modules())
    assert not any(p.requires_grad for p in ema.network.parameters())
    for a, b in zip(ema.network.state_dict().values(), lit.model.state_dict().values(), strict=True):
        assert (a.device, a.dtype, a.shape) == (b.device, b.dtype, b.shape)


def test_needs_a_model_attribute():
    no_model = TinyNet(FEATURES, CLASSES)  # a user's module: its network is .body, not .model
    assert not hasattr(no_model, "model")
    with pytest.raises(ConfigError, match="model") as err:
        trainer([ModelEMA()], max_steps=1).fit(no_model, classifier_loader(8, 4))
    assert err.value.cli().startswith("--model-ema averages")


@pytest.mark.parametrize(("kwargs", "param"), [({"decay": 1.5}, "decay"), ({"update_every": 0}, "update_every"),
                                               ({"update_every": 2.0}, "update_every"),
                                               ({"warmup_epochs": -1}, "warmup_epochs")])
def test_bad_settings_name_the_parameter(kwargs, param):
    with pytest.raises(ConfigError) as err:
        ModelEMA(**kwargs)
    assert err.value.param == param


def test_adjusted_decay_numbers():
    # torchvision's ResNet-50 recipe: 8 GPUs x 128 images, EMA every 32 steps, 600 epochs, decay 0.99998.
    adjust = 8 * 128 * 32 / 600  # 54.6133...
    assert adjusted_decay(0.99998, 8, 128, 32, 600) == pytest.approx(1 - 2e-5 * adjust, rel=1e-15)
    assert adjusted_decay(0.99998, 8, 128, 32, 600) == pytest.approx(0.998907733, abs=1e-9)
    # Fewer devices, same per-device batch: more updates per epoch, so a slower-forgetting average.
    assert adjusted_decay(0.99998, 1, 128, 32, 600) == pytest.approx(1 - 2e-5 * 128 * 32 / 600)
    assert adjusted_decay(0.9, 8, 128, 32, 10) == 0.0  # alpha clamps at 1: the average is the weights
    with pytest.raises(ConfigError) as err:
        adjusted_decay(0.99998, 8, 128, 32, 0)
    assert err.value.param == "epochs"


# ---- checkpoints ----------------------------------------------------------------------------------------

def test_resume_continues_the_average_exactly(tmp_path):
    def run(ckpt_dir: Path | None, ckpt_path: Path | None = None):
        ema = ModelEMA(decay=0.7, update_every=3, warmup_epochs=0.5)
        callbacks: list[Callback] = [ema]
        if ckpt_dir is not None:
            callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, filename="{epoch}", save_top_k=-1, every_n_epochs=1,
                                             save_on_train_epoch_end=True))
        lit = module()
        # 4 steps per epoch, a 2-step warm-up, updates at 3 (the first: a copy), 6, 9, 12: the epoch-0
        # checkpoint (step 4) falls between two updates, with n_averaged 1 to carry over.
        t = trainer(callbacks, max_epochs=3, enable_checkpointing=ckpt_dir is not None)
        t.fit(lit, classifier_loader(16, 4), ckpt_path=ckpt_path)
        return ema, lit, t

    full, full_module, _ = run(tmp_path)
    checkpoint = torch.load(tmp_path / "epoch=0.ckpt", weights_only=True)
    saved = ema_state_dict(checkpoint)
    assert saved is not None and saved.keys() == full.network.state_dict().keys()
    assert checkpoint["callbacks"]["ModelEMA"]["n_averaged"] == 1  # step 3's copy
    assert not any("ema" in k for k in checkpoint["state_dict"])  # the module's own state has no EMA twin

    resumed, resumed_module, t = run(None, tmp_path / "epoch=0.ckpt")
    assert t.global_step == 12
    assert_state_equal(snapshot(resumed_module.model), snapshot(full_module.model))
    assert_state_equal(snapshot(resumed.network), snapshot(full.network))
    assert resumed.n_averaged == full.n_averaged == 4


def test_ema_state_dict_absent():
    assert ema_state_dict({"callbacks": {"ModelCheckpoint{...}": {}}}) is None
    assert ema_state_dict({}) is None


# ---- evaluation with the average ------------------------------------------------------------------------

def evaluate(net: nn.Module, n: int = 32, seed: int = 1) -> tuple[float, float]:
    x, y = classifier_data(n, seed).tensors
    with torch.no_grad():
        logits = net.eval()(x)
    return (logits.argmax(1) == y).float().mean().item(), F.cross_entropy(logits, y).item()


def test_validation_and_test_log_ema_metrics(tmp_path):
    without = module()
    plain = trainer([]).validate(without, classifier_loader(32, 8, seed=1), verbose=False)[0]
    assert "val_acc_ema" not in plain and not hasattr(without, "val_metrics_ema")

    lit = module()
    ema = ModelEMA(decay=0.5, update_every=1)
    t = trainer([ema], max_steps=4)
    t.fit(lit, classifier_loader(32, 8), val_dataloaders=classifier_loader(32, 8, seed=1))
    metrics = {k: float(v) for k, v in t.callback_metrics.items()}
    acc, loss = evaluate(ema.network)
    assert metrics["val_acc_ema"] == pytest.approx(acc, abs=1e-7)
    assert metrics["val_loss_ema"] == pytest.approx(loss, rel=1e-5)
    assert metrics["val_acc"] == pytest.approx(evaluate(lit.model)[0], abs=1e-7)
    assert abs(metrics["val_loss_ema"] - metrics["val_loss"]) > 1e-6  # really another network

    tested = t.test(lit, classifier_loader(32, 8, seed=1), verbose=False)[0]
    assert tested["test_acc_ema"] == pytest.approx(acc, abs=1e-7)
    assert tested["test_loss_ema"] == pytest.approx(loss, rel=1e-5)

    # The EMA metrics never enter a checkpoint: strict loading works both ways.
    path = tmp_path / "ema.ckpt"
    t.save_checkpoint(path)
    assert not any("_ema" in k for k in torch.load(path, weights_only=True)["state_dict"])
    TinyClassifier.load_from_checkpoint(path, weights_only=True)
    module().load_state_dict(lit.state_dict(), strict=True)


def test_old_checkpoint_without_ema_then_validated_with_ema(tmp_path):
    t = trainer([], max_steps=2)
    t.fit(module(), classifier_loader(16, 4))
    path = tmp_path / "plain.ckpt"
    t.save_checkpoint(path)
    lit = TinyClassifier.load_from_checkpoint(path, weights_only=True)  # strict
    out = trainer([ModelEMA()]).validate(lit, classifier_loader(32, 8, seed=1), verbose=False)[0]
    # A fresh average is a copy of the weights: its metrics are the network's.
    assert out["val_acc_ema"] == out["val_acc"] and out["val_loss_ema"] == pytest.approx(out["val_loss"], rel=1e-6)


# ---- 2 ranks (gloo) ------------------------------------------------------------------------------------

@pytest.mark.slow  # a long multi-process run: make test-slow (keeps make test near 10 min)
def test_two_ranks_agree_and_log_exact_ema_metrics(tmp_path):
    out = tmp_path / "run"
    run([SCRIPT, out], timeout=240, drop=["MASTER_ADDR"], check=True)
    ranks = {int(p.stem[4:]): torch.load(p, weights_only=False) for p in sorted(out.glob("rank*.pt"))}
    assert set(ranks) == {0, 1}
    r0, r1 = ranks[0], ranks[1]
    assert r0["global_step"] == 8 and r0["n_averaged"] == 3  # updates at 2 (warm-up copy), 4 (copy), 6, 8
    assert not r0["ema_requires_grad"]
    assert not any("ema" in k for k in r0["module_keys"])
    assert_state_equal(r1["ema"], r0["ema"])  # running statistics included: rank 0's on every rank
    assert_state_equal(r1["model"], r0["model"])
    # The last validation ran on the final average: its metrics over both shards are the whole set's.
    net = TinyClassifier().model
    net.load_state_dict(r0["ema"])
    acc, loss = evaluate(net)
    for r in (r0, r1):
        assert r["metrics"]["val_acc_ema"] == pytest.approx(acc, abs=1e-7)
        assert r["metrics"]["val_loss_ema"] == pytest.approx(loss, rel=1e-5)
        assert "val_acc" in r["metrics"]


def test_an_update_touches_only_the_networks_device():
    """torch's AveragedModel keeps its step counter in a CPU tensor and copies it to the network's device at every
    update: a blocking host-to-device copy per update on CUDA. Stand-in: the network on the meta device, where
    any tensor on another device in an update's ops is such a copy (or a host read)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Devices(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: set[tuple[str, str]] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            leaves = [*torch.utils._pytree.tree_leaves(args), *torch.utils._pytree.tree_leaves(kwargs or {})]
            self.seen |= {(func._schema.name, str(t.device)) for t in leaves if isinstance(t, torch.Tensor)}
            return func(*args, **(kwargs or {}))

    lit = module()
    lit.model.to("meta")
    ema = ModelEMA(decay=0.9, update_every=1)
    with Devices() as mode:
        for copy in (False, False, True, False):
            ema.update(lit, copy=copy)
    assert {device for _, device in mode.seen} == {"meta"}, sorted(mode.seen)
    assert ema.n_averaged == 1 and {p.device.type for p in ema.network.parameters()} == {"meta"}


def test_an_update_from_a_network_on_another_device_is_averaged_on_the_copys_device():
    """As AveragedModel does (the network's tensors moved to the copy's device): after a fit Lightning's teardown
    moves the module to the CPU while the copy stays on the GPU. Stand-in: the copy on meta, the network on CPU."""
    lit = module()
    lit.model.to("meta")
    ema = ModelEMA(decay=0.9, update_every=1)
    ema.update(lit)
    lit.model.to_empty(device="cpu")  # the same network object, now on another device than the copy
    ema.update(lit)
    ema.update(lit)
    assert ema.n_averaged == 3 and {p.device.type for p in ema.network.parameters()} == {"meta"}
