"""Lightning's loggers, continued: a resumed run keeps what its tracker run already holds (the CSV rows up to
the checkpoint's step, MLflow's write-once params) instead of replacing or refusing it."""

from __future__ import annotations

import csv
import io
import os
from typing import Any

from lightning.pytorch.core.saving import save_hparams_to_yaml
from lightning.pytorch.loggers import CSVLogger, MLFlowLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment
from lightning.pytorch.utilities.rank_zero import rank_zero_only, rank_zero_warn
from typing_extensions import override

from ddp_recipes.lightning_seam.reach import flat_params
from ddp_recipes.storage.store import attempt, put_bytes


class ContinuedCSVLogger(CSVLogger):
    """Lightning's CSVLogger, except that a resumed run keeps its version's ``metrics.csv`` (Lightning deletes
    a version's file when it opens that version again): the rows up to ``resume_step`` stay, later ones (a
    run killed after its last checkpoint logged them) are dropped, and the new rows are appended."""

    def __init__(self, *args: Any, resume_step: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.resume_step = resume_step

    @property
    @override
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _ContinuedWriter(self.log_dir, self.resume_step)
        return super().experiment


class _ContinuedWriter(ExperimentWriter):
    """Lightning's writer, continuing a version's ``metrics.csv`` from ``resume_step`` (None: a fresh one).

    Each flush writes the whole file through the run's storage, whole or not at all (on a bucket one upload
    under the pack's retries: an append retried after a 503 could repeat rows). Not fsynced: it is flushed at
    every log step, and a log must be whole, not power-cut durable (plain Lightning appends without a sync):
    after a power cut it may lack its last rows, while the checkpoint a run resumes from is durable."""

    def __init__(self, log_dir: str, resume_step: int | None) -> None:
        self.resume_step = resume_step
        self._rows: list[dict[str, Any]] = []  # every row the file holds
        # The file's text under the header ``_text_keys``: a flush formats only its new rows (formatting every
        # row at every log step would cost a long run more per step the longer it runs).
        self._text, self._text_keys = "", []
        super().__init__(log_dir)

    @override
    def _check_log_dir_exists(self) -> None:
        if self.resume_step is None:
            super()._check_log_dir_exists()  # a fresh version: Lightning's rule (an old file is replaced)
            return
        if not self._fs.isfile(self.metrics_file_path):
            return
        with self._fs.open(self.metrics_file_path, "r", newline="") as file:
            reader = csv.DictReader(file)
            keys = list(reader.fieldnames or [])
            rows = [row for row in reader if _row_step(row) <= self.resume_step]
        self.metrics_keys = keys
        self._write(rows, [])

    @override
    def save(self) -> None:
        if not self.metrics:
            return
        self._record_new_keys()
        self._write(self._rows, self.metrics)
        self.metrics = []

    @override
    def log_hparams(self, params: dict[str, Any]) -> None:
        self.hparams.update(params)
        where = os.path.join(self.log_dir, self.NAME_HPARAMS_FILE)
        attempt(where, f"upload of {where}", lambda: save_hparams_to_yaml(where, self.hparams))  # a whole file

    def _write(self, rows: list[dict[str, Any]], new: list[dict[str, Any]]) -> None:
        """The file as ``rows`` then ``new`` (kept as the file's rows once written)."""
        if self._text_keys == self.metrics_keys and rows is self._rows:
            text = self._text + _csv(self.metrics_keys, new, header=False)
        else:  # a new column (or the rows a resumed run keeps): every row under the new header
            text = _csv(self.metrics_keys, [*rows, *new], header=True)
        put_bytes(self.metrics_file_path, text.encode(), durable=False)
        self._rows, self._text, self._text_keys = [*rows, *new], text, list(self.metrics_keys)


def _csv(keys: list[str], rows: list[dict[str, Any]], header: bool) -> str:
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=keys)
    if header:
        writer.writeheader()
    writer.writerows(rows)
    return text.getvalue()


def _row_step(row: dict[str, str]) -> float:
    try:
        return float(row.get("step") or -1)
    except ValueError:
        return -1


class ContinuedMLFlowLogger(MLFlowLogger):
    """Lightning's MLFlowLogger, except on a continued run (``run_id`` given): MLflow params are write-once, so
    params the run holds with another value (a resumed run that changed ``--max-epochs``) keep the first
    value and are named in one warning, instead of failing the run."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.continued = self._run_id is not None  # before a new run's id is set

    @override
    @rank_zero_only
    def log_hyperparams(self, params: Any) -> None:
        flat = flat_params(params)
        if self.continued:
            held = self.experiment.get_run(self.run_id).data.params
            changed = sorted(k for k, v in flat.items() if k in held and held[k] != str(v)[:250])
            if changed:
                rank_zero_warn(f"MLflow params are write-once: the continued run {self.run_id} keeps its first "
                               f"values of {', '.join(changed[:8])}{' ...' if len(changed) > 8 else ''}")
            flat = {k: v for k, v in flat.items() if k not in changed}
        if flat:
            super().log_hyperparams(flat)
