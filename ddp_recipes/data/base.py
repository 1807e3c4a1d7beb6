"""The loaders every recipe DataModule shares: resumable training order, exact evaluation."""

from __future__ import annotations

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from ddp_recipes.data.samplers import _world, exact_eval_loader, resumable_train_loader
from ddp_recipes.errors import DataError


class SplitDataModule(L.LightningDataModule):
    """A DataModule whose ``setup`` fills ``train_set`` / ``val_set`` / ``test_set``.

    Subclasses provide ``batch_size`` (per device), ``seed`` (of the training order) and ``num_workers``
    (attributes or properties), and may set ``pin_memory`` (True/False; None, the default: it follows the
    trainer's device). An empty validation or test set disables that stage.
    """

    train_set: Dataset | None = None
    val_set: Dataset | None = None
    test_set: Dataset | None = None
    _pin_memory: bool | None = None

    @property
    def pin_memory(self) -> bool:
        """The given ``pin_memory``, or True exactly when the trainer trains on CUDA (pinning only helps
        host-to-device copies). Read when the loaders are built, from the trainer's device: asking
        ``torch.cuda.is_available()`` would initialise CUDA in every rank of a CPU run on a GPU host."""
        if self._pin_memory is not None:
            return self._pin_memory
        device = getattr(getattr(self.trainer, "strategy", None), "root_device", None)
        return isinstance(device, torch.device) and device.type == "cuda"

    @pin_memory.setter
    def pin_memory(self, value: bool | None) -> None:
        self._pin_memory = value

    @override
    def train_dataloader(self) -> DataLoader:
        return resumable_train_loader(self._require(self.train_set, "fit"), self.batch_size, self.seed,
                                      num_workers=self.num_workers, pin_memory=self.pin_memory)

    @override
    def val_dataloader(self) -> DataLoader | list:
        return self._eval_loader(self._require(self.val_set, "validate"), "validation")

    @override
    def test_dataloader(self) -> DataLoader | list:
        return self._eval_loader(self._require(self.test_set, "test"), "test")

    def eval_sizes(self) -> dict[str, int]:
        """The samples of the validation and test sets (``{"validation": n, "test": m}``) where they are known
        before ``setup`` without loading the data; none by default (checked when the loaders are made)."""
        return {}

    def more_eval_samples(self, what: str, need: int) -> str:
        """How to give the ``what`` set ("validation" or "test") ``need`` samples, in the words of this
        DataModule's parameters: the fix of a set too small for the ranks."""
        return f"give the {what} set at least {need} samples"

    def check_eval_sizes(self, world: int) -> None:
        """Refuse, before any process starts, an evaluation set (:meth:`eval_sizes`) with fewer samples than
        ``world`` ranks, which exact sharding cannot split."""
        for what, size in self.eval_sizes().items():
            self._check_eval_size(what, size, world)

    def _check_eval_size(self, what: str, size: int, world: int) -> None:
        if 0 < size < world:
            raise DataError(f"the {what} set has {size} sample(s) for {world} ranks: with exact sharding every "
                            f"rank needs one; {self.more_eval_samples(what, world)}, or use fewer {{devices}}")

    def _eval_loader(self, dataset: Dataset, what: str) -> DataLoader | list:
        if len(dataset) == 0:
            return []  # Lightning skips the stage
        try:
            # Exact (unpadded) sharding would leave a rank without a batch; Lightning then fails on that rank
            # only and the others wait for it. Every rank knows the sizes, so every rank stops here.
            self._check_eval_size(what, len(dataset), _world()[0])
        except DataError as err:
            err.agreed = True  # the same on every rank: rank 0 prints it
            raise
        return exact_eval_loader(dataset, self.batch_size, num_workers=self.num_workers, pin_memory=self.pin_memory)

    @staticmethod
    def _require(dataset: Dataset | None, stage: str) -> Dataset:
        if dataset is None:
            raise RuntimeError(f"call setup({stage!r}) before asking for this dataloader")
        return dataset


def pack_built(datamodule: L.LightningDataModule) -> bool:
    """Whether the pack's own ``setup`` builds the DataModule's sets (one of its DataModules, or a user's subclass
    that keeps that ``setup``): what it tells before ``setup`` (sizes, folders) is then what the ranks load, and
    can be checked before any process starts."""
    setup = getattr(type(datamodule), "setup", None)
    return isinstance(datamodule, SplitDataModule) and getattr(setup, "__module__", "").startswith("ddp_recipes.")


def check_before_launch(datamodule: L.LightningDataModule, world: int) -> None:
    """What a :func:`pack_built` DataModule can tell of its data before any process starts, checked against a
    run of ``world`` ranks: its files (``check_files()``, e.g. an image folder's class folders) and its
    evaluation sets' sizes. Anything else is checked in the ranks."""
    if not pack_built(datamodule):
        return
    check_files = getattr(datamodule, "check_files", None)
    if callable(check_files):
        check_files()
    datamodule.check_eval_sizes(world)


def known_train_size(datamodule: L.LightningDataModule) -> int | None:
    """The training samples one of the pack's DataModules can tell before ``setup`` (its ``train_size``), or
    None: data still to be downloaded, or anything that fails (the ranks check the loader itself)."""
    try:
        size = getattr(datamodule, "train_size", None)
    except Exception:  # files not there yet (a download in prepare_data): checked in the ranks
        return None
    return size if isinstance(size, int) else None

