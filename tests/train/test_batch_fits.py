"""A per-device batch larger than a rank's share of the training data is refused, naming the flag the user set
and the data's size per rank: before any rank starts in the recipes, at the first step through build_trainer
(issue #40.1). It used to train one short batch per epoch with the LR scaled for the planned one."""

from __future__ import annotations

import pytest

from ddp_recipes.config.plan import BatchPlan
from ddp_recipes.errors import ConfigError
from tests.helpers import SHARED_DATA
from tests.marks import needs_mnist

RESNET = ["--accelerator", "cpu", "--data", "synthetic", "--image-size", "16", "--synthetic-samples", "64",
          "--max-steps", "1"]


@needs_mnist
def test_mnist_refuses_a_batch_larger_than_a_ranks_data_before_any_rank_starts(tmp_path, capsys):
    from recipes import mnist

    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exc:
        mnist.main(["--devices", "2", "--accelerator", "cpu", "--data-dir", str(SHARED_DATA), "--no-download",
                    "--val-size", "1000", "--batch-size", "100000", "--max-steps", "3", "--output-dir", str(out)])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert exc.value.code == 2 and not out.exists()
    assert ("--batch-size 100000 per device is larger than the 3500 training samples each of the 2 rank(s) gets "
            "(7000 in all)") in err and err.endswith("pass --batch-size 3500 or less")


@pytest.mark.parametrize(("flags", "said"), [
    ([], "--batch-size 128 per device is larger than the 64 training samples each of the 1 rank(s)"),
    (["--global-batch-size", "256", "--devices", "2"],
     "--global-batch-size 256 (128 per device) is larger than the 32 training samples each of the 2 rank(s)"),
])
def test_resnet_names_the_flag_the_user_set(tmp_path, capsys, flags, said):
    from recipes import resnet

    with pytest.raises(SystemExit) as exc:
        resnet.main([*RESNET, *flags, "--output-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert exc.value.code == 2 and said in err, err
    assert not (tmp_path / "out").exists()


def test_a_batch_that_fits_passes():
    BatchPlan(32, 1, 64).check_fits(64, 2)  # exactly a rank's share
    BatchPlan(32, 1, 64).check_fits(63, 2)  # the padded share is 32
    with pytest.raises(ConfigError, match="pass global_batch_size 128 or less"):
        BatchPlan(33, 2, 132).check_fits(64, 2, "{global_batch_size}")


def test_build_trainer_refuses_it_at_the_first_step(tmp_path):
    from ddp_recipes import build_trainer
    from tests.tiny_modules import tiny_module_and_data

    trainer = build_trainer(accelerator="cpu", max_steps=2, default_root_dir=str(tmp_path), logger=False,
                            enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ConfigError, match=r"the training DataLoader's batch_size 64 per device is larger than the 40 "
                                          r"training samples"):
        trainer.fit(*tiny_module_and_data(samples=40, batch_size=64))
    assert trainer.global_step == 0


def test_a_train_size_that_fails_is_not_known():
    from ddp_recipes.data.base import known_train_size

    class SizedAfterSetup:
        train_set = None

        @property
        def train_size(self):
            return len(self.train_set)  # TypeError before setup

    assert known_train_size(SizedAfterSetup()) is None

