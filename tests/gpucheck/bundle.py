"""What gpu-check leaves in ``--out-dir``: the report and one log bundle, within what a GPU slot brings back.

A slot returns only what its command writes under one folder, at most 8 files, 16 MiB each, 64 MiB in all.
The checks themselves work in a scratch folder (JPEG folders, checkpoints, CSV logs, junit XML), removed at the
end; ``--out-dir`` gets exactly :data:`FILES`: ``gpu-report.json``, ``gpu-report.md`` and ``gpu-check-logs.txt``
(each check's ``output.log``, head and tail kept when it is long). No images, no checkpoints.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

REPORT_JSON, REPORT_MD, LOGS = "gpu-report.json", "gpu-report.md", "gpu-check-logs.txt"
FILES = (REPORT_JSON, REPORT_MD, LOGS)
MAX_FILES, MAX_FILE_BYTES, MAX_TOTAL_BYTES = 8, 16 * 2**20, 64 * 2**20  # what a slot brings back
LOGS_BYTES = 12 * 2**20  # the log bundle's own ceiling, under MAX_FILE_BYTES with room to spare
HEAD_BYTES = 64 * 2**10  # of a long log, its start (the command, the versions), then as much of its end as fits


def _excerpt(text: bytes, limit: int) -> bytes:
    if len(text) <= limit:
        return text
    head, tail = text[:HEAD_BYTES], text[-(limit - HEAD_BYTES):]
    return head + f"\n[... {len(text) - len(head) - len(tail)} bytes left out ...]\n".encode() + tail


def write_logs(results: list[dict[str, Any]], work_root: Path, out_dir: Path) -> Path:
    """``out_dir/gpu-check-logs.txt``: every check that ran, its verdict line and its output, each log given an
    equal share of :data:`LOGS_BYTES` (a check that ran with nothing to say takes none)."""
    logs = {r["name"]: work_root / "gpu-check" / r["name"] / "output.log" for r in results}  # runner.run_one's
    ran = [r for r in results if logs[r["name"]].exists()]
    share = LOGS_BYTES // max(len(ran), 1) - 1024
    parts = []
    for r in ran:
        log = logs[r["name"]].read_bytes()
        head = f"===== {r['name']}: {r['verdict']} ({r['seconds']} s): {r['reason']}"[:1000]
        parts.append(head.encode() + b"\n" + _excerpt(log, share) + b"\n")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / LOGS
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(b"".join(parts) or b"(no check ran)\n")
    tmp.replace(path)
    return path


def bundle_problems(out_dir: Path) -> list[str]:
    """Why ``out_dir`` would not come back whole from a slot (empty: it would)."""
    files = [p for p in out_dir.rglob("*") if p.is_file()]
    problems = [f"{len(files)} files (at most {MAX_FILES})"] if len(files) > MAX_FILES else []
    problems += [f"{p.name}: {p.stat().st_size} bytes (at most {MAX_FILE_BYTES})" for p in files
                 if p.stat().st_size > MAX_FILE_BYTES]
    total = sum(p.stat().st_size for p in files)
    problems += [f"{total} bytes in all (at most {MAX_TOTAL_BYTES})"] if total > MAX_TOTAL_BYTES else []
    return problems
