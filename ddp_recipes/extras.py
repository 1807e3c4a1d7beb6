"""How to install an optional integration: the one place that words it.

No package index serves ``ddp-recipes`` by name, so installing the pack's extra by name fails on a user's machine;
what always works is installing the extra's own packages into the environment the pack runs in, however the pack
got there (an editable checkout, a wheel, a source tree on ``PYTHONPATH``). The requirements are read from the
installed distribution's metadata, so ``pyproject.toml`` stays the one place that lists them; a source tree
without metadata (the lent GPU machine) gets the package names the caller imports.
"""

from __future__ import annotations

from functools import cache

DIST = "ddp-recipes"


@cache
def extra_requirements(extra: str) -> tuple[str, ...]:
    """The requirements ``pyproject.toml`` lists for ``extra`` (an extra of extras expanded), as pip specs,
    e.g. ``("s3fs>=2026.9",)``; empty when the pack is not installed as a distribution."""
    from importlib import metadata

    from packaging.requirements import Requirement

    try:
        listed = metadata.requires(DIST) or []
    except metadata.PackageNotFoundError:
        return ()
    specs: list[str] = []
    for line in listed:
        req = Requirement(line)
        # An extra's own line holds only with the extra named: a runtime one with a marker of its own (numpy's
        # per-Python floor) holds without it too.
        if req.marker is None or not req.marker.evaluate({"extra": extra}) or req.marker.evaluate({"extra": ""}):
            continue
        if req.name.replace("_", "-") == DIST:  # e.g. tracking = ddp-recipes[tensorboard,mlflow,wandb]
            specs += [s for inner in sorted(req.extras) for s in extra_requirements(inner) if s not in specs]
        else:
            specs.append(f"{req.name}{req.specifier}")
    return tuple(specs)


def install_hint(extra: str, *packages: str) -> str:
    """``pip install '<spec>' ...`` for the pack's ``extra`` (``packages``: what to name without metadata)."""
    specs = extra_requirements(extra) or packages or (extra,)
    return "pip install " + " ".join(f"'{s}'" if any(c in s for c in "<>=!~[") else s for s in specs) + \
        f" (the pack's {extra} extra)"
