"""What one measured run trains, the same for every implementation (:mod:`ddp_recipes.bench.harness.worker`,
:mod:`ddp_recipes.bench.harness.baselines`): the workload, its LightningModule, its data and its optimizer."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import TensorDataset

from ddp_recipes.bench.harness.synthetic import RankShard
from ddp_recipes.data.samplers import TensorBatchDataset


@dataclass
class Workload:
    """What one measured run trains: the same for pack, raw and dp."""

    recipe: str = "resnet"  # resnet (torchvision ResNet) or mnist (the write-up's MLP/CNN)
    arch: str = "resnet18"  # the network of that recipe
    image_size: int = 32  # resnet: image side in pixels (under 64: the CIFAR stem, as the recipe)
    batch_size: int = 32  # per device, the same at every N (weak scaling)
    steps: int = 20  # timed steps, after the warm-up
    warmup_steps: int = 5  # steps before timing starts
    precision: str = "32-true"  # a run precision, as the recipes' --precision
    accelerator: str = "cpu"  # cpu or cuda
    devices: int = 1  # ranks (dp: GPUs in the one process)
    threads: int = 0  # torch threads per rank on CPU (0: leave torch's default)
    seed: int = 0  # seed of the synthetic data and the model
    allreduce_iters: int = 5  # raw: timed all-reduces of the gradient's size, after the steps
    data_dir: str = ""  # mnist: real MNIST (torchvision layout) instead of synthetic tensors
    val_size: int = 0  # mnist with data_dir: images held out as the recipe's --val-size (trained on by no run)
    without: str = ""  # pack: parts switched off, comma list (benchmarks/account/worker.py)
    compile: int = 0  # torch.compile the model (pack: as --compile does; raw: the DDP-wrapped module)
    channels_last: int = 0  # resnet: NHWC weights and inputs (tensor-core convolutions under AMP)
    count_steps: int = 0  # whole loop iterations counted after the timed steps (benchmarks/account; 0: none)

    @property
    def total_steps(self) -> int:
        """The warm-up and timed steps."""
        return self.warmup_steps + self.steps

    @property
    def run_steps(self) -> int:
        """Every step a run makes: after the timed ones, the counted iterations and the step whose start closes
        the last of them (counting sends every op through Python: never inside the timed steps)."""
        return self.total_steps + (self.count_steps + 1 if self.count_steps else 0)


def build_module(w: Workload):
    """The recipe's LightningModule for this workload (its ``.model`` is the plain network)."""
    if w.recipe == "mnist":
        from ddp_recipes.modules.mnist import MNISTClassifier

        return MNISTClassifier(arch=w.arch)
    from ddp_recipes.modules.resnet import ResNetClassifier

    return ResNetClassifier(arch=w.arch, num_classes=10, cifar_stem=w.image_size < 64, lr=0.1,  # as the recipe
                            channels_last=bool(w.channels_last))


def build_dataset(w: Workload) -> TensorDataset | RankShard:
    """Fixed-seed synthetic samples, enough for every rank to run all steps inside one epoch, of which each
    rank holds only its own share, on its device (:class:`~ddp_recipes.bench.harness.synthetic.RankShard`); with
    ``data_dir`` (mnist) the real images, normalised in memory exactly as the recipe's DataModule does."""
    if w.recipe == "mnist" and w.data_dir:
        return _mnist_split(w, validation=False)
    shape = (1, 28, 28) if w.recipe == "mnist" else (3, w.image_size, w.image_size)
    return RankShard((w.run_steps + 1) * w.batch_size * w.devices, shape, w.seed, device=w.accelerator)


def build_val_dataset(w: Workload) -> TensorBatchDataset | None:
    """The images ``val_size`` holds out (mnist with ``data_dir``), which the pack's DataModule validates on at
    each epoch end: plain Lightning is given them as its validation loader, so both sides pay the same
    validation where an epoch boundary falls inside the timed steps."""
    return _mnist_split(w, validation=True) if w.recipe == "mnist" and w.data_dir and w.val_size else None


def _mnist_split(w: Workload, validation: bool) -> TensorBatchDataset:
    """MNISTDataModule's split of the real training images (same seed, same permutation), normalised in memory
    as it does: the held-out rows, or the rows every run trains on."""
    from ddp_recipes.data.mnist import load_split

    images, labels = load_split(w.data_dir, train=True)
    if w.val_size:
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(w.seed))
        rows = order[: w.val_size] if validation else order[w.val_size:]
        images, labels = images[rows], labels[rows]
    return TensorBatchDataset(images, labels)


def module_optimizer(module: Any) -> torch.optim.Optimizer:
    """The optimizer the pack's ``configure_optimizers`` builds (its parameter groups: weight decay on weights
    only, none on norms and biases; its SGD settings), without the LR schedule: the raw and dp loops then do
    the same arithmetic per step as the pack, so the ratio measures the framework, not the optimizer."""
    return module.build_optimizer(module.param_groups())


def data_facts(data: object) -> dict[str, Any]:
    """What a run's JSON says about its synthetic data: samples and MB on this rank, and where they live."""
    if not isinstance(data, RankShard) or data.tensors is None:
        return {}
    return {"synthetic_samples_global": len(data), "synthetic_samples_per_rank": len(data.tensors[0]),
            "synthetic_mb_per_rank": round(data.nbytes() / 2**20, 1),
            "synthetic_data_on": str(data.tensors[0].device)}


def write_json(path: str, payload: dict) -> None:
    """Rank 0's result file of a run."""
    Path(path).write_text(json.dumps(payload, indent=2) + "\n")
