"""The ResNet recipe with torchvision's classification-reference flags: augmentation, MixUp/CutMix, EMA,
optimizers, schedules, gradient clipping, YAML configs and --test-only."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image
from torchvision.transforms import v2

from ddp_recipes.config.cli import parse_config
from ddp_recipes.modules.resnet import ResNetClassifier
from ddp_recipes.optim.ema import ModelEMA, adjusted_decay
from ddp_recipes.train import run as runner
from recipes import mnist, resnet
from recipes.config import ResNetConfig
from recipes.resnet import build_datamodule, ema_callback
from tests.helpers import SHARED_DATA
from tests.launch import run
from tests.marks import needs_mnist

TINY = ["--accelerator", "cpu", "--data", "synthetic", "--image-size", "16", "--synthetic-samples", "64",
        "--synthetic-val-samples", "40", "--batch-size", "16", "--num-classes", "10"]


def steps_of(transform: v2.Transform) -> list[v2.Transform]:
    return list(transform.transforms) if isinstance(transform, v2.Compose) else [transform]


def image_tree(root, classes=("a", "b"), per_class=3, size=(20, 18)):
    for split in ("train", "val"):
        for index, name in enumerate(classes):
            folder = root / split / name
            folder.mkdir(parents=True)
            for i in range(per_class):
                Image.new("RGB", size, (40 * i, 90 * index, 30)).save(folder / f"{i}.png")
    return root


def test_augmentation_flags_reach_the_built_pipelines(tmp_path):
    tree = image_tree(tmp_path / "imgs")
    cfg = parse_config(ResNetConfig, ["--data", "imagefolder", "--data-dir", str(tree), "--image-size", "28",
                                      "--auto-augment", "ra", "--ra-magnitude", "5", "--random-erase", "0.25",
                                      "--train-crop-size", "24", "--val-resize-size", "36", "--val-crop-size", "28",
                                      "--interpolation", "bicubic"])
    dm = build_datamodule(cfg)
    train, val = steps_of(dm.train_transform()), steps_of(dm.val_transform())
    kinds = [type(t) for t in train]
    crop = next(t for t in train if isinstance(t, v2.RandomResizedCrop))
    policy = next(t for t in train if isinstance(t, v2.RandAugment))
    assert crop.size == (24, 24) and policy.magnitude == 5
    assert str(policy.interpolation).lower().endswith("bicubic")
    erase = train[-1]
    assert isinstance(erase, v2.RandomErasing) and erase.p == 0.25
    assert kinds.index(v2.Normalize) < kinds.index(v2.RandomErasing)  # erasing acts on normalized pixels
    resize = next(t for t in val if isinstance(t, v2.Resize))
    center = next(t for t in val if isinstance(t, v2.CenterCrop))
    assert resize.size == [36] and center.size == (28, 28)
    dm.setup("fit")
    image, _ = dm.train_set[0]
    assert image.shape == (3, 24, 24) and image.dtype == torch.float32
    for policy_name, kind in (("ta_wide", v2.TrivialAugmentWide), ("augmix", v2.AugMix),
                              ("imagenet", v2.AutoAugment)):
        other = build_datamodule(parse_config(ResNetConfig, ["--data", "cifar10", "--data-dir", str(tmp_path),
                                                             "--auto-augment", policy_name]))
        assert any(isinstance(t, kind) for t in steps_of(other.train_transform())), policy_name


def test_mixup_and_cutmix_make_soft_targets_and_keep_hard_accuracy():
    torch.manual_seed(0)
    model = ResNetClassifier(arch="resnet18", num_classes=10, cifar_stem=True, mixup_alpha=0.4, cutmix_alpha=1.0)
    x, y = torch.randn(8, 3, 16, 16), torch.arange(8)
    mixed_x, soft = model.mix_batch(x, y)
    assert soft.shape == (8, 10) and torch.allclose(soft.sum(1), torch.ones(8))
    assert not torch.equal(soft, torch.nn.functional.one_hot(y, 10).float()) and not torch.equal(mixed_x, x)
    loss = model.training_step((x, y), 0)
    assert loss.ndim == 0 and torch.isfinite(loss)
    plain = ResNetClassifier(arch="resnet18", num_classes=10, cifar_stem=True)
    assert plain.mix_batch(x, y)[1] is y  # off by default: integer labels, untouched
    # Evaluation compares hard labels: the metrics take the integer targets.
    model._evaluate((x, y), "val")
    assert 0 <= float(model.val_metrics["acc"].compute()) <= 1


@pytest.mark.parametrize("argv, flag", [
    (["--lr-gamma", "0.5"], "--lr-gamma has no effect without --lr-scheduler"),
    (["--model-ema-steps", "8"], "--model-ema-steps has no effect without --model-ema"),
    (["--ra-magnitude", "3"], "--ra-magnitude has no effect without --auto-augment ra"),
    (["--lr-scheduler", "steplr", "--cosine"], "--cosine and --lr-scheduler are two schedules"),
    (["--opt", "adamw", "--nesterov"], "--nesterov is SGD's"),
    (["--clip-grad-norm", "0"], "--clip-grad-norm must be > 0"),
    (["--model-ema", "--model-ema-decay", "1.5"], "--model-ema-decay"),
    (["--lr-scheduler", "steplr", "--lr-gamma", "2"], "--lr-gamma must be in \\(0, 1\\]"),
    (["--data", "cifar10", "--val-crop-size", "28"], "--val-crop-size has no effect without --data imagefolder"),
    (["--auto-augment", "ra"], "--auto-augment has no effect without image data"),
    (["--min-crop-scale", "0.5"], "--min-crop-scale has no effect without --data imagefolder"),
    (["--data", "cifar10", "--min-crop-scale", "0.5"], "--min-crop-scale has no effect without --data imagefolder"),
    (["--mixup-alpha", "-1"], "--mixup-alpha"),
])
def test_flags_without_effect_or_bad_values_fail_in_one_line(argv, flag, tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        resnet.main([*TINY, "--output-dir", str(tmp_path), *argv])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and __import__("re").search(flag, err), err
    assert not (tmp_path / "summary.json").exists()


def test_reference_spellings_are_aliases():
    cfg = parse_config(ResNetConfig, ["--opt", "rmsprop", "--lr-warmup-epochs", "2", "--lr-scheduler", "steplr"])
    assert (cfg.optimizer, cfg.warmup_epochs, cfg.cosine) == ("rmsprop", 2.0, False)
    assert parse_config(ResNetConfig, ["--warmup-epochs", "1"]).cosine is True  # the recipe's default schedule


def test_ema_decay_is_adjusted_like_the_reference():
    cfg = parse_config(ResNetConfig, ["--devices", "1", "--batch-size", "32", "--accumulate-grad-batches", "2",
                                      "--max-epochs", "10", "--model-ema", "--model-ema-steps", "4",
                                      "--model-ema-decay", "0.999"])
    callback = ema_callback(cfg)
    assert isinstance(callback, ModelEMA) and callback.update_every == 4
    # samples between updates: 1 x 32 x 2 (accumulation) x 4 steps, over 10 epochs
    assert callback.decay == pytest.approx(adjusted_decay(0.999, 1, 64, 4, 10)) == pytest.approx(1 - 0.001 * 25.6)
    steps_only = ema_callback(parse_config(ResNetConfig, ["--max-steps", "50", "--model-ema"]))
    assert steps_only.decay == 0.99998


def test_clip_grad_norm_reaches_the_trainer(tmp_path, monkeypatch):
    seen = {}
    real = runner.make_trainer

    def spy(cfg, callbacks=None, **kwargs):
        trainer = real(cfg, callbacks=callbacks, **kwargs)
        seen.update(val=trainer.gradient_clip_val, algorithm=trainer.gradient_clip_algorithm,
                    ema=[c for c in trainer.callbacks if isinstance(c, ModelEMA)])
        return trainer

    monkeypatch.setattr(runner, "make_trainer", spy)
    resnet.main([*TINY, "--max-steps", "1", "--clip-grad-norm", "0.5", "--model-ema", "--output-dir", str(tmp_path)])
    assert seen["val"] == 0.5 and str(seen["algorithm"]).lower().endswith("norm") and len(seen["ema"]) == 1


@pytest.mark.parametrize("recipe, config_cls, argv", [
    (resnet, ResNetConfig, ["--devices", "2", "--global-batch-size", "64", "--opt", "adamw", "--lr", "1e-3",
                            "--lr-scheduler", "cosineannealinglr", "--lr-min", "1e-5", "--model-ema",
                            "--mixup-alpha", "0.2", "--data", "cifar10", "--auto-augment", "ta_wide"]),
    (mnist, mnist.MNISTConfig, ["--arch", "cnn", "--val-size", "100", "--lr-warmup-epochs", "0.5"]),
])
def test_print_config_round_trips(recipe, config_cls, argv, tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        recipe.main([*argv, "--print-config"])
    assert info.value.code == 0
    printed = capsys.readouterr().out
    path = tmp_path / "run.yaml"
    path.write_text(printed)
    original = parse_config(config_cls, argv)
    again = parse_config(config_cls, ["--config", str(path)])
    assert again.to_dict() == original.to_dict()
    with pytest.raises(SystemExit):
        recipe.main(["--config", str(path), "--print-config"])
    assert capsys.readouterr().out == printed  # printing the read-back config gives the same file
    # A flag on the command line wins over the file.
    assert parse_config(config_cls, ["--config", str(path), "--seed", "7"]).seed == 7


@pytest.mark.parametrize("text, message", [
    ("sead: 3\n", "--config {p}: unknown key 'sead'; did you mean seed?"),
    ("learning_rate: 0.1\n", "--config {p}: unknown key 'learning_rate'; did you mean lr?"),  # another trainer's name
    ("epochs: 3\n", "--config {p}: unknown key 'epochs'; did you mean max"),
    ("seed: three\n", "--config {p}: seed must be an integer (got 'three')"),
    ("- 1\n- 2\n", "--config {p} must hold a mapping of flag names to values (got a list)"),
    ("seed: [\n", "--config {p} is not valid YAML"),
    ("precision: fp8\n", "--precision must be one of 32-true, 16-mixed, bf16-mixed, bf16-true, 16-true, 64-true, "
     "32, 16, bf16, 64 (got 'fp8')"),
    # YAML's traps
    ("seed: 1\nseed: 2\n", "is not valid YAML (line 1: key 'seed' given twice)"),
    ("comm_hook: off\n", "comm_hook must be a string (got False: quote it"),
    ("max_steps: null\n", "max_steps cannot be null"),
])
def test_bad_config_files_fail_in_one_line(text, message, tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(SystemExit) as info:
        resnet.main(["--config", str(path), "--output-dir", str(tmp_path / "out")])
    assert info.value.code == 2
    assert message.format(p=path) in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_an_unknown_flag_names_the_one_it_most_likely_means(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        resnet.main(["--learning-rate", "0.1", "--output-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2 and err.splitlines() == [  # one line, as every bad input (no usage block)
        "python -m recipes.resnet: error: unrecognized arguments: --learning-rate 0.1 (--learning-rate: did you mean "
        "--lr?)"]


def test_yaml_numbers_and_kebab_keys_are_read(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("lr: 1e-3\nlr-warmup-epochs: 2\nopt: adamw\nmax_steps: 5\n")
    cfg = parse_config(ResNetConfig, ["--config", str(path)])
    assert (cfg.lr, cfg.warmup_epochs, cfg.optimizer, cfg.max_steps) == (0.001, 2.0, "adamw", 5)


@pytest.mark.slow  # a long multi-process run: make test-slow (keeps make test near 10 min)
def test_test_only_reproduces_the_runs_own_test_on_any_world_size(tmp_path):
    """Train (EMA, MixUp, AdamW, a step schedule), then evaluate last.ckpt with --test-only on 1 and on 2
    ranks: the metrics are the run's own test metrics, EMA included (exact sharding, no padding)."""
    out = str(tmp_path / "run")
    flags = [*TINY, "--output-dir", out]
    summary = resnet.main([*flags, "--max-steps", "6", "--model-ema", "--model-ema-steps", "2", "--mixup-alpha",
                           "0.3", "--opt", "adamw", "--lr", "1e-3", "--lr-scheduler", "steplr", "--lr-step-size", "1",
                           "--lr-gamma", "0.5"])
    assert summary["config"]["optimizer"] == "adamw" and summary["config"]["mixup_alpha"] == 0.3
    keys = ("test_acc", "test_acc5", "test_loss", "test_acc_ema", "test_loss_ema")
    alone = resnet.main([*flags, "--test-only", "--resume", "auto"])
    assert alone["ema"] is True and alone["checkpoint"].endswith("last.ckpt")
    for key in keys:
        assert alone[key] == pytest.approx(summary[key], abs=1e-6), key
    # 40 test images over 2 ranks at batch 16: shards of 20, last batches of 4 on each rank.
    run(["-m", "recipes.resnet", *flags, "--devices", "2", "--test-only", "--resume", "auto"], check=True)
    two = json.loads((tmp_path / "run" / "test.json").read_text())
    assert two["world_size"] == 2
    for key in keys:
        assert two[key] == pytest.approx(summary[key], abs=1e-5), key


@needs_mnist
def test_mnist_reads_a_config_file(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text(f"data_dir: {SHARED_DATA}\nmax_steps: 2\nbatch_size: 32\nno_such: 1\n")
    with pytest.raises(SystemExit):
        mnist.main(["--config", str(path)])
    path.write_text(f"data_dir: {SHARED_DATA}\nmax_steps: 2\nbatch_size: 32\ndownload: false\n")
    summary = mnist.main(["--config", str(path), "--output-dir", str(tmp_path / "out"), "--accelerator", "cpu"])
    assert summary["steps"] == 2 and summary["config"]["batch_size"] == 32


def test_printed_config_keeps_what_was_asked_so_flags_still_move_it(tmp_path, capsys):
    with pytest.raises(SystemExit):
        resnet.main(["--data", "cifar10", "--print-config"])
    printed = capsys.readouterr().out
    assert "cifar_stem: null" in printed and "cosine: null" in printed
    assert "# resolved by the recipe: image_size=32, cifar_stem=True, cosine=True" in printed
    path = tmp_path / "c.yaml"
    path.write_text(printed)
    # The file leaves the schedule and the stem to the recipe, so a flag on top still decides them.
    moved = parse_config(ResNetConfig, ["--config", str(path), "--lr-scheduler", "steplr", "--data", "synthetic",
                                        "--image-size", "224"])
    assert (moved.cosine, moved.cifar_stem) == (False, False)


def test_a_config_given_twice_or_not_text_is_named(tmp_path, capsys):
    path = tmp_path / "t.yaml"
    path.write_text("seed: 1\n")
    with pytest.raises(SystemExit):
        parse_config(ResNetConfig, ["--config", str(path), "--config", str(path)], prog="p")
    assert "--config was given more than once" in capsys.readouterr().err
    binary = tmp_path / "b.yaml"
    binary.write_bytes(b"\x80\x81\xff")
    with pytest.raises(SystemExit):
        parse_config(ResNetConfig, ["--config", str(binary)], prog="p")
    assert "is not a text file" in capsys.readouterr().err


class HardLabelLoss(ResNetClassifier):
    """A user's loss written for class indices."""

    def loss(self, logits, target, stage):
        return torch.nn.functional.nll_loss(logits.log_softmax(1), target)


def test_mixing_needs_a_loss_that_takes_soft_targets(tmp_path, capsys):
    with pytest.raises(SystemExit):
        resnet.main([*TINY, "--output-dir", str(tmp_path), "--mixup-alpha", "0.2"], model_cls=HardLabelLoss)
    err = capsys.readouterr().err
    assert "--mixup-alpha gives loss() class-probability targets" in err and "soft_targets = True" in err
    from examples.my_resnet import AdamWResNet  # the example's focal loss takes both kinds

    assert AdamWResNet.takes_soft_targets() and ResNetClassifier.takes_soft_targets()
    model = AdamWResNet(arch="resnet18", num_classes=10, cifar_stem=True, mixup_alpha=0.2, lr=1e-3)
    loss = model.training_step((torch.randn(4, 3, 16, 16), torch.arange(4)), 0)
    assert torch.isfinite(loss)


def test_resume_refuses_another_optimizer_in_one_line(tmp_path, capsys):
    flags = [*TINY, "--synthetic-val-samples", "0", "--output-dir", str(tmp_path)]
    resnet.main([*flags, "--max-steps", "1"])
    for extra, line in ((["--opt", "adamw"], "was trained with --optimizer sgd but this run has --optimizer adamw"),
                        (["--norm-weight-decay", "0.01"], "was trained with --norm-weight-decay 0.0 but this run")):
        with pytest.raises(SystemExit):
            resnet.main([*flags, "--max-steps", "2", "--resume", "auto", *extra])
        assert line in capsys.readouterr().err
    with pytest.raises(SystemExit):  # --test-only --model-ema needs EMA weights in the checkpoint
        resnet.main([*TINY, "--output-dir", str(tmp_path), "--test-only", "--resume", "auto", "--model-ema"])
    assert "holds no EMA weights" in capsys.readouterr().err
    summary = resnet.main([*flags, "--max-steps", "2", "--resume", "auto", "--nesterov"])  # same SGD state
    assert summary["steps"] == 2


def test_braces_in_a_path_are_not_parameters(tmp_path, capsys):
    odd = tmp_path / "{run}" / "last.ckpt"
    with pytest.raises(SystemExit):
        resnet.main([*TINY, "--resume", str(odd)])
    assert f"--resume {odd}: no such checkpoint file" in capsys.readouterr().err


@pytest.mark.parametrize("argv, line", [
    (["--lr-scheduler", "cosineannealinglr", "--lr-step-size", "5"], "--lr-step-size has no effect without --lr-sch"),
    (["--lr-scheduler", "steplr", "--lr-min", "0.001"], "--lr-min has no effect without --lr-scheduler cosine"),
    (["--opt", "adamw", "--momentum", "0.5"], "--momentum has no effect without --optimizer sgd"),
    (["--weight-decay", "nan"], "--weight-decay must be >= 0 (got nan)"),
    (["--timeout-s", "inf"], "--timeout-s must be > 0 seconds and finite"),
])
def test_more_flags_without_effect(argv, line, capsys):
    with pytest.raises(SystemExit):
        parse_config(ResNetConfig, argv, prog="p")
    assert line in capsys.readouterr().err
