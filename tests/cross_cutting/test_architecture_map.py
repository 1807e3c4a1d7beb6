"""docs/architecture.md's folder map names every module of the package and of the clone's ``benchmarks/``: a
newcomer finds each file there, and a file added without its line fails here (read as text: nothing is imported)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOP_FOLDERS = ("recipes", "benchmarks")  # mapped at the map's left edge, beside ddp_recipes/


def _folder_map() -> list[str]:
    """The lines of the fenced block under ``## Folder map``."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text.split("## Folder map", 1)[1].split("```", 2)[1]
    return block.splitlines()


def _section(lines: list[str], folder: str) -> str:
    """The map's lines from the one that opens ``folder/`` (a top-level folder of the package, or one of
    :data:`TOP_FOLDERS`) to the next line opening a name at the same depth."""
    indent = 0 if folder in TOP_FOLDERS else 2
    opener = re.compile(rf"^ {{{indent}}}{re.escape(folder)}/")
    start = next((i for i, line in enumerate(lines) if opener.match(line)), None)
    if start is None:
        return ""
    end = next((i for i in range(start + 1, len(lines))
                if len(lines[i]) - len(lines[i].lstrip()) <= indent and lines[i].strip()), len(lines))
    return "\n".join(lines[start:end])


def _named(text: str, name: str) -> bool:
    return re.search(rf"(?<![\w.]){re.escape(name)}(?![\w])", text) is not None


def unmapped() -> list[str]:
    """Package and benchmark files the folder map does not name (an ``__init__.py`` is named by its folder)."""
    lines = _folder_map()
    whole = "\n".join(lines)
    missing = []
    for path in sorted(p for top in ("ddp_recipes", *TOP_FOLDERS) for p in (ROOT / top).rglob("*.py")):
        parts = path.relative_to(ROOT).parts
        inner = parts[1:-1] if parts[0] == "ddp_recipes" else parts[:-1]
        if not inner:  # a file of ddp_recipes/ itself
            text = whole
        else:
            text = _section(lines, inner[0])
            if not text or not all(_named(text, f"{sub}/") for sub in inner[1:]):
                missing.append("/".join(parts))
                continue
        if path.name != "__init__.py" and not _named(text, path.name):
            missing.append("/".join(parts))
    return missing


def test_the_folder_map_names_every_package_file():
    missing = unmapped()
    assert not missing, ("docs/architecture.md's folder map lacks a line for: " + ", ".join(missing)
                         + " (one line each: what the file holds)")
