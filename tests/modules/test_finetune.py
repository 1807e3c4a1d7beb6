"""Fine-tuning from pretrained weights: --weights, a new head, --freeze-backbone, --backbone-lr-mult and
--unfreeze-at-epoch, offline.

The "pretrained" weights are made here: a seeded ResNet-18 whose BatchNorm statistics are calibrated on a
few batches, saved under the exact file name torchvision looks for in torch's hub cache
($TORCH_HOME/hub/checkpoints/resnet18-f37072fd.pth), so ``--weights IMAGENET1K_V1`` loads it through
torchvision's own ``get_state_dict``. The image folder has two colour classes a frozen backbone's features
separate at once.
"""

from __future__ import annotations

import csv
import json
import os
import random
import signal
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from PIL import Image
from torch import nn
from torchvision import models
from torchvision.transforms import InterpolationMode

from ddp_recipes.ddp.syncbn import CPUSyncBatchNorm, SyncBatchNormPlugin
from ddp_recipes.errors import ConfigError
from ddp_recipes.modules.classifier import ImageClassifier
from ddp_recipes.modules.pretrained import load_pretrained, resolve_weights
from ddp_recipes.modules.resnet import ResNetClassifier
from recipes import resnet
from tests.helpers import CodeOnLoad, assert_same_weights, raises_cli
from tests.launch import run, saved_step, start

HUB_FILE = "resnet18-f37072fd.pth"  # the file name of ResNet18_Weights.IMAGENET1K_V1's URL


@pytest.fixture(scope="module")
def hub(tmp_path_factory) -> Path:
    """A TORCH_HOME whose hub cache holds 'ResNet18_Weights.IMAGENET1K_V1' (seeded, BN calibrated)."""
    home = tmp_path_factory.mktemp("torch_home")
    torch.manual_seed(0)
    net = models.resnet18(num_classes=1000)
    for m in net.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.momentum = None  # a cumulative average over the calibration batches
    with torch.no_grad():
        for _ in range(3):
            net(torch.randn(16, 3, 32, 32))
    (home / "hub" / "checkpoints").mkdir(parents=True)
    torch.save(net.state_dict(), home / "hub" / "checkpoints" / HUB_FILE)
    return home


def pretrained(hub: Path) -> dict[str, torch.Tensor]:
    return torch.load(hub / "hub" / "checkpoints" / HUB_FILE, map_location="cpu", weights_only=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """2 classes (red / blue noise) x 8 train, 4 val images of 36 px (random crops to 32)."""
    root = tmp_path_factory.mktemp("colours")
    rng = np.random.default_rng(0)
    for split, n in (("train", 8), ("val", 4)):
        for channel, name in ((0, "red"), (2, "blue")):
            (root / split / name).mkdir(parents=True)
            for i in range(n):
                pixels = rng.integers(0, 120, (36, 36, 3), dtype=np.uint8)
                pixels[..., channel] += 120
                Image.fromarray(pixels).save(root / split / name / f"{i}.png")
    return root


def args(folder: Path, *extra: str) -> list[str]:
    return ["--accelerator", "cpu", "--data", "imagefolder", "--data-dir", str(folder), "--image-size", "32",
            "--batch-size", "4", "--num-workers", "0", "--weights", "IMAGENET1K_V1", "--lr-scaling", "none",
            "--lr", "0.05", "--no-cosine", *extra]


def backbone_items(state: dict[str, torch.Tensor], prefix: str = "") -> dict[str, torch.Tensor]:
    return {k[len(prefix):]: v for k, v in state.items()
            if k.startswith(prefix) and not k[len(prefix):].startswith("fc.")}


def assert_backbone_is(ckpt: Path, hub: Path) -> None:
    """Every backbone tensor of the checkpoint (BatchNorm statistics included) is the pretrained one, bit for bit."""
    saved = backbone_items(torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"], "model.")
    original = backbone_items(pretrained(hub))
    assert saved.keys() == original.keys()
    changed = [k for k in original if not torch.equal(saved[k], original[k])]
    assert not changed, f"{len(changed)} frozen tensors changed, e.g. {changed[:3]}"


# ---- fast: names, keys, transforms, the freeze hook --------------------------------------------------------


def test_weights_names_resolve_and_others_are_refused(tmp_path):
    assert resolve_weights("resnet50", "IMAGENET1K_V2").name == "ResNet50_Weights.IMAGENET1K_V2"
    assert resolve_weights("resnet50", "ResNet50_Weights.IMAGENET1K_V2").enum is models.ResNet50_Weights.IMAGENET1K_V2
    assert resolve_weights("resnet50", "DEFAULT").enum is models.ResNet50_Weights.IMAGENET1K_V2
    with raises_cli(ConfigError, r"^--weights ResNet50_Weights.IMAGENET1K_V2 are not weights of --arch resnet18 .*"
                                 r"IMAGENET1K_V1, DEFAULT"):
        resolve_weights("resnet18", "ResNet50_Weights.IMAGENET1K_V2")
    with raises_cli(ConfigError, r"^--weights IMAGENET1K_V9: --arch resnet18 has the weights IMAGENET1K_V1, DEFAULT"):
        resolve_weights("resnet18", "IMAGENET1K_V9")
    with raises_cli(ConfigError, r"^--weights .*missing.pth is not a file"):
        resolve_weights("resnet18", str(tmp_path / "missing.pth"))


def test_local_files_in_the_common_layouts(tmp_path):
    """A plain state dict, torchvision's reference checkpoint ({"model": ...}) with DDP's module. prefixes, and
    a Lightning checkpoint of this pack (state_dict under model.) all give the network's own keys."""
    from ddp_recipes.modules.pretrained import read_weights

    state = models.resnet18(num_classes=3).state_dict()
    layouts = {"plain.pth": state, "reference.pth": {"model": {f"module.{k}": v for k, v in state.items()}, "epoch": 3},
               "pack.ckpt": {"state_dict": {f"model.{k}": v for k, v in state.items()}, "epoch": 1}}
    for name, content in layouts.items():
        torch.save(content, tmp_path / name)
        loaded = read_weights(resolve_weights("resnet18", str(tmp_path / name)))
        assert loaded.keys() == state.keys() and torch.equal(loaded["fc.weight"], state["fc.weight"]), name
    torch.save({"epoch": 3}, tmp_path / "nothing.pth")
    with raises_cli(ConfigError, r"^--weights .*nothing.pth is not a state dict \(a dict of tensors\)"):
        read_weights(resolve_weights("resnet18", str(tmp_path / "nothing.pth")))


def test_loading_replaces_only_the_head_and_names_every_bad_key():
    torch.manual_seed(0)
    source = models.resnet18(num_classes=1000).state_dict()
    model = ResNetClassifier(num_classes=7)
    net = model.model
    head = {"fc.weight", "fc.bias"}
    fresh_fc = net.fc.weight.detach().clone()
    report = load_pretrained(net, source, head, "w")
    assert report.replaced == {"fc": "1000 -> 7 outputs, freshly initialised"} and report.loaded == len(source) - 2
    assert torch.equal(net.layer4[1].conv2.weight, source["layer4.1.conv2.weight"])
    assert torch.equal(net.fc.weight, fresh_fc)  # the new layer keeps its (seeded) initialisation

    broken = dict(source)
    del broken["layer1.0.bn1.running_var"]
    broken["extra.weight"] = torch.zeros(1)
    broken["conv1.weight"] = torch.zeros(64, 3, 3, 3)
    before = net.layer2[0].conv1.weight.detach().clone()
    with raises_cli(ConfigError, r"^--weights w do not fit this model: 1 missing \(layer1.0.bn1.running_var\); 1 "
                                 r"unexpected \(extra.weight\); 1 of another shape \(conv1.weight \[64, 3, 3, 3\] vs "
                                 r"\[64, 3, 7, 7\]\) of its 122 tensors \(file vs model\); pass the --arch "):
        load_pretrained(net, broken, head, "w")
    assert torch.equal(net.layer2[0].conv1.weight, before), "nothing is loaded from weights that do not fit"
    # A mismatch outside the head is never taken for a new head.
    with raises_cli(ConfigError, r"of another shape \(fc.weight"):
        load_pretrained(net, source, set(), "w")


def test_weights_of_a_model_with_auxiliary_heads(tmp_path, capsys):
    """GoogLeNet's weights hold aux1/aux2, which the network built without them drops, as torchvision's builder
    does; built for weights, it converts ImageNet-normalised inputs as it was trained (transform_input)."""
    torch.manual_seed(0)
    torch.save(models.googlenet(aux_logits=True, init_weights=True).state_dict(), tmp_path / "googlenet.pth")
    model = ResNetClassifier(arch="googlenet", num_classes=5, weights=str(tmp_path / "googlenet.pth"))
    assert model.model.transform_input and model.model.aux1 is None
    model.load_weights()
    assert "new head fc (1000 -> 5 outputs, freshly initialised)" in capsys.readouterr().out


def test_weights_eval_transforms_become_the_defaults(folder):
    from ddp_recipes.config.cli import parse_config

    def eval_steps(*extra: str, arch: str = "resnet50", weights: str = "IMAGENET1K_V2") -> tuple[int, dict]:
        cfg = parse_config(resnet.ResNetConfig, ["--data", "imagefolder", "--data-dir", str(folder), "--arch",
                                                 arch, "--weights", weights, *extra])
        dm = resnet.build_datamodule(cfg)
        steps = {type(t).__name__: t for t in dm.val_transform().transforms}
        steps["train"] = {type(t).__name__: t for t in dm.train_transform().transforms}
        return cfg.image_size, steps

    size, steps = eval_steps()  # the weights' own: resize 232, crop 224, ImageNet statistics
    assert size == 224 and steps["Resize"].size == [232] and steps["CenterCrop"].size == (224, 224)
    assert steps["Normalize"].mean == list(models.ResNet50_Weights.IMAGENET1K_V2.transforms().mean)
    assert steps["train"]["Normalize"].std == steps["Normalize"].std  # training normalises the same way
    # EfficientNet-B0's weights were evaluated with bicubic resizing at 256 -> 224: evaluation follows them,
    # training keeps --interpolation's default.
    _, steps = eval_steps(arch="efficientnet_b0", weights="IMAGENET1K_V1")
    assert steps["Resize"].size == [256] and steps["Resize"].interpolation is InterpolationMode.BICUBIC
    assert steps["train"]["RandomResizedCrop"].interpolation is InterpolationMode.BILINEAR
    _, steps = eval_steps("--interpolation", "nearest", arch="efficientnet_b0", weights="IMAGENET1K_V1")
    assert steps["Resize"].interpolation is InterpolationMode.NEAREST  # given: wins
    size, steps = eval_steps("--val-resize-size", "256", "--image-size", "160")  # flags given still win
    assert size == 160 and steps["Resize"].size == [256] and steps["CenterCrop"].size == (160, 160)
    size, steps = eval_steps("--image-size", "160")  # another crop keeps the weights' resize ratio
    assert size == 160 and steps["Resize"].size == [round(160 * 232 / 224)]
    assert eval_steps("--image-size", "32")[0] == 32  # given, even at the size used without --weights


class _Hooks(L.LightningModule):
    """A user's mixin after the pack's class in the MRO: the fine-tuning part passes every hook it implements on."""

    def setup(self, stage):
        self.calls = [*getattr(self, "calls", []), "setup"]

    def on_train_epoch_start(self):
        self.calls.append("on_train_epoch_start")

    def on_train_batch_start(self, batch, batch_idx):
        self.calls.append("on_train_batch_start")

    def on_save_checkpoint(self, checkpoint):
        checkpoint["user"] = 1

    def on_load_checkpoint(self, checkpoint):
        self.calls.append(f"on_load_checkpoint {checkpoint['user']}")


class WithUserHooks(ImageClassifier, _Hooks):
    def __init__(self) -> None:
        super().__init__()
        self.save_hyperparameters({"num_classes": 2, "lr": 0.1, "freeze_backbone": True})
        self.model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
        self.init_metrics()


def test_a_users_mixin_after_the_pack_class_gets_every_hook_and_the_backbone_still_freezes():
    model = WithUserHooks()
    model.setup("fit")
    model.on_train_epoch_start()
    checkpoint: dict = {}
    model.on_save_checkpoint(checkpoint)
    model.on_load_checkpoint(checkpoint)
    model.backbone_frozen = False  # (frozen, the batch hook would look for the unfreeze epoch on a trainer)
    model.on_train_batch_start(None, 0)
    assert model.calls == ["setup", "on_train_epoch_start", "on_load_checkpoint 1", "on_train_batch_start"]
    assert checkpoint == {"user": 1, "backbone_frozen": True}
    assert not any(p.requires_grad for m in model.backbone_modules() for p in m.parameters())


class ShallowFreeze(ResNetClassifier):
    """A user's model deciding its own backbone: only the stem and layer1 are frozen."""

    def backbone_modules(self) -> list[nn.Module]:
        m = self.model
        return [m.conv1, m.bn1, m.layer1]


def test_freeze_hook_param_groups_and_syncbn():
    model = ResNetClassifier(num_classes=2, freeze_backbone=True, unfreeze_at_epoch=1, backbone_lr_mult=0.1, lr=0.2)
    model.set_backbone_frozen(True)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {"model.fc.weight", "model.fc.bias"}
    model.train()
    assert not model.model.layer3[0].bn1.training and model.model.fc.training  # Lightning's train() keeps BN frozen
    groups = model.optimizer_groups()
    assert [(g["name"], g.get("lr"), g["weight_decay"]) for g in groups] == [
        ("backbone", pytest.approx(0.02), 5e-4), ("backbone", pytest.approx(0.02), 0.0),  # --backbone-lr-mult 0.1
        ("head", None, 5e-4), ("head", None, 0.0)]  # at the optimizer's LR, hparams.lr
    # The frozen backbone is in the optimizer from the start (unfrozen later), yet untouched while frozen.
    in_groups = {id(p) for g in groups for p in g["params"]}
    assert all(id(p) in in_groups for p in model.parameters())
    assert all(not p.requires_grad for p in model.model.layer1.parameters())  # the groups left it frozen
    assert not any(isinstance(m, CPUSyncBatchNorm) for m in SyncBatchNormPlugin().apply(model).modules())
    model.set_backbone_frozen(False)
    assert sum(isinstance(m, CPUSyncBatchNorm) for m in SyncBatchNormPlugin().apply(model).modules()) == 20

    shallow = ShallowFreeze(num_classes=2, freeze_backbone=True)
    shallow.set_backbone_frozen(True)
    assert not shallow.model.layer1[0].conv1.weight.requires_grad and shallow.model.layer2[0].conv1.weight.requires_grad
    assert {g["name"] for g in shallow.optimizer_groups()} == {"head"}  # frozen for good: not in the optimizer


def test_frozen_backbone_is_outside_ddp_buckets_until_the_rewrap():
    """A real TunedDDPStrategy on a one-rank gloo group: DDP buckets the head only while the backbone is frozen;
    after unfreezing, rewrap_ddp buckets all of it (once: the old DDP's hooks are gone) and converts the
    unfrozen BatchNorm layers for SyncBN."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from ddp_recipes.ddp.rewrap import rewrap_ddp
    from ddp_recipes.ddp.strategy import TunedDDPStrategy

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = ResNetClassifier(num_classes=2, freeze_backbone=True, unfreeze_at_epoch=1)
        model.set_backbone_frozen(True)
        strategy = TunedDDPStrategy(parallel_devices=[torch.device("cpu")])
        strategy._layer_sync = SyncBatchNormPlugin()
        strategy.model = strategy._setup_model(strategy._layer_sync.apply(model))
        first = strategy.model
        assert first._get_ddp_logging_data()["num_parameter_tensors"] == 2  # fc.weight, fc.bias
        assert not any(isinstance(m, CPUSyncBatchNorm) for m in model.modules())
        model.set_backbone_frozen(False)
        assert rewrap_ddp(strategy) and isinstance(strategy.model, DistributedDataParallel)
        assert strategy.model is not first and strategy.model.module is model
        assert strategy.model._get_ddp_logging_data()["num_parameter_tensors"] == len(list(model.parameters()))
        assert sum(isinstance(m, CPUSyncBatchNorm) for m in model.modules()) == 20
        strategy.model(torch.randn(2, 3, 32, 32)).sum().backward()
        assert all(p.grad is not None for p in model.parameters())
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(("extra", "message"), [
    (["--unfreeze-at-epoch", "1"], "--unfreeze-at-epoch unfreezes a frozen backbone; add --freeze-backbone"),
    (["--freeze-backbone", "--backbone-lr-mult", "0.1"], "--backbone-lr-mult has no effect on a backbone frozen for "
                                                          "the whole run; add --unfreeze-at-epoch"),
    (["--backbone-lr-mult", "0"], "--backbone-lr-mult must be > 0 (got 0.0); to train no backbone parameter, pass "
                                  "--freeze-backbone"),
    (["--freeze-backbone", "--unfreeze-at-epoch", "5", "--max-epochs", "5"], "--unfreeze-at-epoch 5 is never reached"),
    (["--freeze-backbone", "--unfreeze-at-epoch", "1", "--comm-hook", "powersgd"], "--unfreeze-at-epoch rebuilds"),
    (["--weights", "IMAGENET1K_V1", "--cifar-stem"], "--cifar-stem replaces the stem the --weights were trained with"),
])
def test_bad_fine_tuning_flags(extra, message):
    with raises_cli(ConfigError, "^" + message.replace("(", r"\(").replace(")", r"\)")):
        resnet.ResNetConfig(**_fields(extra))


def _fields(argv: list[str]) -> dict:
    """Flags -> ResNetConfig keywords, for the few used above (no parser: the config's own validation)."""
    out: dict = {}
    i = 0
    while i < len(argv):
        name = argv[i][2:].replace("-", "_")
        if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            value = argv[i + 1]
            out[name] = float(value) if name == "backbone_lr_mult" else int(value) if value.isdigit() else value
            i += 2
        else:
            out[name] = True
            i += 1
    return out


def test_one_device_fine_tune_through_the_hub_cache(hub, folder, tmp_path, monkeypatch, capsys):
    """torchvision's path to the cached file, the new head named, frozen tensors untouched, groups reported."""
    monkeypatch.setenv("TORCH_HOME", str(hub))
    summary = resnet.main([*args(folder, "--freeze-backbone", "--max-steps", "2"), "--output-dir", str(tmp_path)])
    out = capsys.readouterr().out
    cached = hub / "hub" / "checkpoints" / HUB_FILE
    assert (f"weights          ResNet18_Weights.IMAGENET1K_V1 ({cached}): 120 tensors loaded; new head fc (1000 -> 2 "
            "outputs, freshly initialised)") in out
    assert_backbone_is(tmp_path / "checkpoints" / "last.ckpt", hub)
    tuning = json.loads((tmp_path / "summary.json").read_text())["fine_tuning"]
    assert tuning == summary["fine_tuning"] and tuning["new_head"] == {"fc": "1000 -> 2 outputs, freshly initialised"}
    assert [g["name"] for g in tuning["param_groups"]] == ["head", "head"]  # frozen for good: only the head
    assert tuning["weights"] == "ResNet18_Weights.IMAGENET1K_V1" and tuning["backbone_frozen_at_end"] is True


def test_offline_with_an_empty_cache_names_the_file_to_place(folder, tmp_path):
    home = tmp_path / "empty_home"
    # A proxy on a closed port: the download fails at once, with or without a network.
    offline = {"TORCH_HOME": str(home), "https_proxy": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9"}
    done = run(["-m", "recipes.resnet", *args(folder, "--max-steps", "1"), "--output-dir", str(tmp_path / "out")],
               env=offline, timeout=300)
    line = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2, done.stderr[-2000:]
    assert line.startswith("python -m recipes.resnet: error: --weights ResNet18_Weights.IMAGENET1K_V1 needs "
                           f"{HUB_FILE} in torch's hub cache {home / 'hub' / 'checkpoints'} (downloading "), line
    assert "place that file there (from https://download.pytorch.org/models/resnet18-f37072fd.pth)" in line
    assert not (tmp_path / "out" / "checkpoints").exists()


def test_a_weights_file_that_would_run_code_is_refused(folder, tmp_path, capsys):
    marker, evil = tmp_path / "pwned", tmp_path / "evil.pth"
    torch.save({"conv1.weight": torch.zeros(1), "x": CodeOnLoad(str(marker))}, evil)
    with pytest.raises(SystemExit) as exc:
        resnet.main([*args(folder, "--max-steps", "1"), "--weights", str(evil), "--output-dir", str(tmp_path / "o")])
    assert exc.value.code == 2 and not marker.exists()
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--weights" in line and "would run code" in line and "torch.save(model.state_dict(), path)" in line


def test_a_weights_file_of_another_arch_fails_before_any_process_starts(folder, tmp_path, capsys):
    r34 = models.resnet34().state_dict()
    torch.save(r34, tmp_path / "r34.pth")
    with pytest.raises(SystemExit) as exc:
        resnet.main([*args(folder, "--max-steps", "1"), "--weights", str(tmp_path / "r34.pth"),
                     "--output-dir", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    extra = sorted(set(r34) - set(models.resnet18().state_dict()))
    assert exc.value.code == 2 and len(err) == 1
    assert f"do not fit this model: {len(extra)} unexpected (layer" in err[0]
    assert f"and {len(extra) - 3} more)" in err[0]
    assert len(err[0]) < 400, "a wrong file is named in one short line, not every key it holds"
    assert not (tmp_path / "o").exists()


# ---- slow: 2 ranks, the two-phase schedule, kill and resume across the switch ---------------------------------

TWO_PHASE = ["--devices", "2", "--max-epochs", "3", "--freeze-backbone", "--unfreeze-at-epoch", "2",
             "--backbone-lr-mult", "0.1", "--sync-batchnorm", "--checkpoint-every-n-steps", "1"]


class _SigtermBeforeStep(Callback):
    """SIGTERM to this process as the batch of optimizer step ``step`` starts: on one device the preemption
    handler acts at that step's end (a 2-rank vote lands a step later), so the checkpoint is at ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step - 1:
            os.kill(os.getpid(), signal.SIGTERM)


def test_preempted_at_the_last_batch_before_the_switch_resumes_into_the_unfreeze(hub, folder, tmp_path,
                                                                                 monkeypatch):
    """Preempted at the last batch of epoch 1 (saved on that batch's end, the backbone still frozen), the run
    resumed with --resume auto starts epoch 2 as a Lightning restart, without on_train_epoch_start: the
    backbone stayed frozen for the rest of the run. It unfreezes at the switch and ends as the run never
    stopped (1 device, 4 steps per epoch)."""
    monkeypatch.setenv("TORCH_HOME", str(hub))
    argv = args(folder, "--devices", "1", "--max-epochs", "3", "--freeze-backbone", "--unfreeze-at-epoch", "2",
                "--checkpoint-every-n-steps", "1", "--num-workers", "1")
    straight = resnet.main([*argv, "--output-dir", str(tmp_path / "straight")])
    assert straight["fine_tuning"]["backbone_frozen_at_end"] is False
    out = tmp_path / "preempted"
    with pytest.raises(SystemExit) as exc:
        resnet.main([*argv, "--output-dir", str(out)], callbacks=[_SigtermBeforeStep(8)])
    assert exc.value.code == 128 + signal.SIGTERM
    saved = torch.load(out / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert (saved["global_step"], saved["epoch"], saved["backbone_frozen"]) == (8, 1, True)
    resumed = resnet.main([*argv, "--output-dir", str(out), "--resume", "auto"])
    assert resumed["fine_tuning"]["backbone_frozen_at_end"] is False
    assert_same_weights(tmp_path / "straight" / "checkpoints" / "last.ckpt", out / "checkpoints" / "last.ckpt")


def val_acc_by_epoch(out: Path) -> dict[int, float]:
    rows = csv.DictReader((next((out / "logs").glob("version_*")) / "metrics.csv").open())
    return {int(r["epoch"]): float(r["val_acc"]) for r in rows if r.get("val_acc")}


@pytest.fixture(scope="module")
def two_phase_straight(hub, folder, tmp_path_factory) -> tuple[Path, str]:
    """The two-phase run never stopped (2 gloo ranks, 2 steps per epoch, the switch before step 5)."""
    out = tmp_path_factory.mktemp("straight")
    done = run(["-m", "recipes.resnet", *args(folder, *TWO_PHASE), "--output-dir", str(out)],
               env={"TORCH_HOME": str(hub)}, timeout=600, check=True)
    return out, done.stdout + done.stderr


@pytest.mark.slow
def test_two_ranks_frozen_phase_learns_then_the_backbone_trains(hub, two_phase_straight):
    """Epochs 0-1 train the head on the frozen backbone, epoch 2 everything (DDP wrapped again, SyncBN for the
    unfrozen layers); the ranks never drift apart (the pack's param-drift check compares them every epoch)."""
    out, log = two_phase_straight
    assert "epoch 2: backbone unfrozen" in log and "param-drift" not in log
    assert val_acc_by_epoch(out)[1] >= 0.75, "the head did not learn on the frozen backbone"
    tuning = json.loads((out / "summary.json").read_text())["fine_tuning"]
    assert [g["name"] for g in tuning["param_groups"]] == ["backbone", "backbone", "head", "head"]
    assert tuning["param_groups"][0]["lr"] == pytest.approx(0.1 * tuning["param_groups"][2]["lr"])
    assert tuning["param_groups"][0]["frozen_tensors"] == tuning["param_groups"][0]["tensors"]
    assert tuning["backbone_frozen_at_end"] is False
    final = torch.load(out / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]
    assert not torch.equal(final["model.layer1.0.conv1.weight"], pretrained(hub)["layer1.0.conv1.weight"])


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["frozen", "trainable"])
def test_two_ranks_kill_and_resume_across_the_unfreeze_point_is_exact(phase, hub, folder, two_phase_straight, tmp_path):
    """SIGKILL in the frozen phase (the checkpoint's backbone is the file's, bit for bit, after steps on 2
    ranks; the resumed run crosses the switch) or after the switch (the resumed run wraps DDP once, everything
    trainable): either way --resume auto ends bit for bit with the run never stopped."""
    env = {"TORCH_HOME": str(hub)}
    last = tmp_path / "checkpoints" / "last.ckpt"
    argv = ["-m", "recipes.resnet", *args(folder, *TWO_PHASE), "--output-dir", str(tmp_path)]
    proc = start(argv, env=env)
    kill_at = random.Random(os.getpid()).randint(1, 3) if phase == "frozen" else 5
    proc.wait_for_step(last, kill_at, timeout=300)
    proc.signal(signal.SIGKILL, group=True)
    proc.finish(timeout=60)
    step = saved_step(last)
    assert (step < 4) if phase == "frozen" else (4 < step < 6), f"killed at step {step}"
    if phase == "frozen":
        assert_backbone_is(last, hub)
    run([*argv, "--resume", "auto"], env=env, timeout=600, check=True)
    assert_same_weights(two_phase_straight[0] / "checkpoints" / "last.ckpt", last)


def test_fine_tuning_refuses_what_the_run_around_it_cannot_combine_with():
    from ddp_recipes.config.finetune import FineTuning

    assert not FineTuning().fine_tunes and FineTuning(backbone_lr_mult=0.5).fine_tunes
    FineTuning(freeze_backbone=True, unfreeze_at_epoch=2, max_epochs=3)
    for kwargs, message in [(dict(unfreeze_at_epoch=2), "unfreeze_at_epoch unfreezes a frozen backbone"),
                            (dict(weights="DEFAULT", cifar_stem=True), "cifar_stem replaces the stem"),
                            (dict(freeze_backbone=True, unfreeze_at_epoch=2, comm_hook="powersgd"),
                             "PowerSGD's error feedback"),
                            (dict(freeze_backbone=True, unfreeze_at_epoch=3, max_epochs=3), "is never reached")]:
        with pytest.raises(ConfigError, match=message):
            FineTuning(**kwargs)
