"""What every recipe's ``main`` opens before it builds anything: the classes it trains (``--model-class``,
``--datamodule-class`` or a script's), the user's Trainer surface, and the checkpoint ``--resume`` names."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import lightning as L

from ddp_recipes.checkpointing import kept
from ddp_recipes.checkpointing.run_folder.output_dir import discard_unused_output_dirs
from ddp_recipes.checkpointing.run_folder.resume import open_resume
from ddp_recipes.config.cli import fail
from ddp_recipes.config.run_config import RunConfig
from ddp_recipes.data.unreadable import describe as describe_unreadable
from ddp_recipes.errors import ConfigError
from ddp_recipes.storage.retry import StorageError
from ddp_recipes.train.console import quiet_recipe_console
from ddp_recipes.train.surface import UserSurface, open_surface
from ddp_recipes.train.userclass import RecipeClasses, follow_checkpoint, resolve_classes


@dataclass(frozen=True)
class RunStart:
    """A recipe run as opened: its classes (those of the checkpoint it resumes), the user's part of the
    Trainer, and the checkpoint to resume (path and header; None: a fresh run)."""

    classes: RecipeClasses
    user: UserSurface
    resume: str | None
    checkpoint: dict[str, Any] | None


def open_run(cfg: RunConfig, base: type[L.LightningModule], model_cls: type | None = None,
             datamodule_cls: type | None = None, callbacks: Any = None, logger: Any = None,
             trainer_kwargs: dict[str, Any] | None = None, *, training: bool = True) -> RunStart:
    """Open a recipe's run before any process starts: the classes (``base`` or the user's subclass), the
    user's callbacks, logger and Trainer settings, and ``--resume``'s checkpoint (its header: tensors unread),
    whose recorded classes the run then follows. ``training`` False (``--test-only``) only reads the output
    folder."""
    quiet_recipe_console()
    classes = resolve_classes(base, model_cls, datamodule_cls, cfg.model_class, cfg.datamodule_class)
    user = open_surface(cfg, callbacks, logger, trainer_kwargs)
    resume, checkpoint = open_resume(cfg, training, debugging=bool(user.trainer_kwargs.get("fast_dev_run")))
    if resume:
        classes = follow_checkpoint(classes, checkpoint, resume)
    return RunStart(classes, user, resume, checkpoint)


def said_by_the_nodes_first() -> bool:
    """Whether a refusal is another process's to print: under torchrun every rank's process runs the recipe's
    checks alike before the process group is up (the same flags, the node's same files), so each would print the
    same line; the node's first process (LOCAL_RANK 0) prints it, the others exit 2 silently. Lightning's own
    launcher checks once, in the process that starts the ranks."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return False  # inside the run: each rank's error is its own (an agreed one is printed by rank 0)
    return "TORCHELASTIC_RUN_ID" in os.environ and os.environ.get("LOCAL_RANK", "0") != "0"


@contextmanager
def refused_in_one_line(prog: str, data_dir: str | None = None) -> Iterator[None]:
    """A recipe's ``main`` after its flags: bad input (a :class:`ConfigError`, naming its flag) is one line and exit
    2, and the run leaves nothing behind (not even the empty ``version_N`` of a default output dir); an image
    file no decoder reads is named relative to ``data_dir``, from any decoder, in a loader worker or not; so is a
    stream whose store stopped delivering mid-run, and a store of ``--output-dir`` that stopped taking the run's
    files: their line says whether a checkpoint is kept, and where (:mod:`~ddp_recipes.checkpointing.kept`).
    Anything else is a bug and keeps its traceback."""
    kept.reset()
    try:
        yield
    except StorageError as err:  # the store of --output-dir (or of --data-dir, read before the launch)
        discard_unused_output_dirs()
        after = kept.current().words("once the store answers")
        fail(f"{err.cli()}; {after}" if after else err, prog)
    except ConfigError as err:
        discard_unused_output_dirs()
        if said_by_the_nodes_first():
            raise SystemExit(2) from None
        fail(err, prog)
    except OSError as err:
        name = describe_unreadable(err)  # "train/c1/x.jpg (why)"
        if name is not None:
            fail(f"--data-dir {data_dir} holds an image that cannot be decoded: {name}; remove or replace it", prog)
        from ddp_recipes.data.stream import StreamCacheError, describe_outage  # here: only --data stream raises it

        outage = describe_outage(err)  # "reading train sample 17 failed (why)"
        if outage is None:
            raise
        if isinstance(err, StreamCacheError):  # the node's disk: the line names the cache and its fix
            fail(outage, prog)
        after = kept.current().words("once the store answers") or "rerun the same command once the store answers"
        fail(f"--data-dir {data_dir}: {outage}; {after}", prog)
