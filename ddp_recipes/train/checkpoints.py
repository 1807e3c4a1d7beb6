"""Which checkpoints a recipe run writes (``last.ckpt``, ``best.ckpt``) and which one ``--resume`` opens."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from typing_extensions import override

from ddp_recipes.checkpointing import ownership
from ddp_recipes.checkpointing.checkpoint import CHECKPOINT_DIR, read_checkpoint
from ddp_recipes.checkpointing.last import LastCheckpoint
from ddp_recipes.checkpointing.ownership import output_survey, resolve_resume
from ddp_recipes.config.run_config import RunConfig
from ddp_recipes.config.world import will_be_global_zero
from ddp_recipes.storage import location


class BestCheckpoint(ModelCheckpoint):
    """The recipe's ``best.ckpt``: a ModelCheckpoint under a state key of its own (led by this class's name), so
    a user's ModelCheckpoint on the same metric (``--callbacks ModelCheckpoint`` with ``monitor: val_acc``)
    runs beside it: Lightning refuses two stateful callbacks with one key. A checkpoint that holds best.ckpt's
    state under ModelCheckpoint's own key restores it too (``_legacy_state_key``)."""

    pack_owned = True  # its name in the recipe's folder is the recipe's (a user's ModelCheckpoint may not take it)

    @property
    def _legacy_state_key(self) -> str:  # type: ignore[override]
        # Lightning looks a callback's state up by state_key, then by this: best.ckpt's state kept under
        # ModelCheckpoint's own key restores too.
        return super().state_key.replace(type(self).__qualname__, ModelCheckpoint.__qualname__, 1)

    @override
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        # The folder is this run's own (a new run into another run's is refused), so Lightning's "Checkpoint
        # directory ... exists and is not empty" would only greet every resumed run.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")
            super().setup(trainer, pl_module, stage)

    @override
    def _save_topk_checkpoint(self, trainer: Any, monitor_candidates: dict[str, Any]) -> None:
        if self.monitor not in monitor_candidates:
            return  # no validation has run yet (a run stopped by --max-steps before it): nothing to rank
        super()._save_topk_checkpoint(trainer, monitor_candidates)


def checkpoint_callbacks(cfg: RunConfig, has_val: bool, model_class: type | None = None) -> list[Callback]:
    """``last.ckpt`` at each epoch end, every ``--checkpoint-every-n-steps`` and on preemption; ``best.ckpt``
    by the model class's ``monitor`` (``val_acc``) when there is validation. Both in
    ``<output-dir>/checkpoints``, through the atomic IO."""
    folder = location(cfg.output_dir) / CHECKPOINT_DIR  # a Path, or a Url on an object store
    callbacks: list[Callback] = [LastCheckpoint(folder, every_n_steps=cfg.checkpoint_every_n_steps)]
    if has_val:
        monitor = getattr(model_class, "monitor", "val_acc")
        callbacks.append(BestCheckpoint(dirpath=str(folder), filename="best", monitor=monitor,
                                         mode="min" if monitor.endswith("loss") else "max",
                                         save_top_k=1, save_last=False, enable_version_counter=False))
    return callbacks



VERSION = "version_"  # the default output dir: <DEFAULT_OUTPUT_ROOT>/version_N, a new N for each run


def open_resume(cfg: RunConfig, training: bool = True) -> tuple[str | None, dict[str, Any] | None]:
    """The checkpoint ``--resume`` names and its contents ((None, None): start fresh), with the run's output
    folder settled first (``cfg.output_dir``, see :func:`settle_output_dir`); ``auto`` takes the newest
    checkpoint of the folder's own run (:mod:`~ddp_recipes.checkpointing.ownership`). ``training`` False
    (``--test-only``) only reads. Every rank reads the file; rank 0's choice is checked on every rank once the
    process group is up (:mod:`~ddp_recipes.checkpointing.connector`)."""
    settle_output_dir(cfg, create=training)
    resume = resolve_resume(cfg.resume, cfg.output_dir, training)
    return resume, read_checkpoint(resume) if resume else None


def refuse_other_runs(cfg: RunConfig, resume: str | None, checkpoint: dict[str, Any] | None) -> None:
    """The output folder belongs to one run: a new run (``--resume none``) into a folder that holds a run, or
    ``--resume PATH`` of another run into it, fails in one line. Checked on the process that will be rank 0,
    after every other check of the run's input and before any other rank starts (rank 0 checks again once
    the process group is up, for every rank)."""
    if not will_be_global_zero():
        return
    found = output_survey(cfg.output_dir)
    if cfg.resume in (None, "none"):
        ownership.refuse_new_run(found)
    elif resume and cfg.resume != "auto":
        given = ownership.Found(resume, int(checkpoint.get("global_step", 0)), int(checkpoint.get("epoch", 0)),
                                ownership.run_of(checkpoint))
        ownership.refuse_foreign_checkpoint(found, given)


# Folders the current run made (settle_output_dir, output_folder), for discard_unused_output_dirs.
_MADE: list[Path] = []


def note_made(folder: Path) -> None:
    """``folder`` was made by this process for its run: :func:`discard_unused_output_dirs` removes it if empty."""
    _MADE.append(folder.absolute())


def discard_unused_output_dirs() -> None:
    """A run refused before it wrote anything (bad input: one line, exit 2) leaves no empty ``version_N``
    behind it: each folder this process made and nothing wrote into is removed again."""
    while _MADE:
        made = _MADE.pop()
        try:
            made.rmdir()  # only an empty folder: anything written there stays
        except OSError:
            pass


def settle_output_dir(cfg: RunConfig, create: bool = True) -> None:
    """``cfg.output_dir`` when ``--output-dir`` was not given: ``<DEFAULT_OUTPUT_ROOT>/version_N`` (Lightning's
    ``lightning_logs/version_N``), so two runs never share a folder. A new run takes the next N, claimed on
    the process that will be rank 0 (an exclusive mkdir: two runs started at once get two N); the other
    ranks take rank 0's folder once the process group is up. ``--resume auto`` continues the newest N that
    holds a run, ``--resume PATH`` the N whose checkpoint PATH is. ``create`` False (a run that only reads,
    ``--test-only``): a new N is named, not made (the run makes it when it writes there)."""
    _MADE.clear()  # this run's folders only (absolute): an earlier run of this process keeps what it made
    if cfg.output_dir is not None:
        return
    root = Path(cfg.DEFAULT_OUTPUT_ROOT)
    numbers = sorted((int(p.name.removeprefix(VERSION)) for p in root.glob(VERSION + "*")
                      if p.is_dir() and p.name.removeprefix(VERSION).isdigit()), reverse=True)
    chosen: Path | None = None
    if cfg.resume == "auto":
        chosen = next((root / f"{VERSION}{n}" for n in numbers if output_survey(root / f"{VERSION}{n}").holds_a_run()),
                      None)
    elif cfg.resume not in (None, "none"):  # a URL is never inside the local root
        holder = Path(cfg.resume).resolve().parent.parent
        if holder.parent == root.resolve() and holder.name.removeprefix(VERSION).isdigit():
            chosen = root / holder.name
    if chosen is None:
        number = (numbers[0] + 1) if numbers else 0
        if create and will_be_global_zero():
            # runs/<recipe> itself too, where this run made it: a refused first run leaves no empty folder at all
            _MADE.extend(reversed([p.absolute() for p in (root, *root.parents) if not p.exists()]))
            root.mkdir(parents=True, exist_ok=True)
            while True:
                try:
                    (root / f"{VERSION}{number}").mkdir()
                    _MADE.append((root / f"{VERSION}{number}").absolute())
                    break
                except FileExistsError:
                    number += 1
                except FileNotFoundError:  # a refused run beside this one removed the empty root it had made
                    root.mkdir(parents=True, exist_ok=True)
        chosen = root / f"{VERSION}{number}"
    elif will_be_global_zero():
        asked = "--resume auto" if cfg.resume == "auto" else "--resume"
        print(f"{asked}: continuing the run in {chosen} (--output-dir picks another)", flush=True)
    cfg.output_dir = str(chosen)
