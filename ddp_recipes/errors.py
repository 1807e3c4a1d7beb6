"""Typed input errors: the library names *parameters*, only the CLI turns them into ``--flags``.

A message is written once with its parameters in braces, ``"{devices} must be >= 1 (got 0)"``. ``str(err)``
reads ``devices must be >= 1 (got 0)`` for a library caller; :meth:`ConfigError.cli` reads
``--devices must be >= 1 (got 0)`` for the command line. Anything that is not one of these errors is a bug
and keeps its traceback: nothing decides "input or bug" by reading the message.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

# A parameter marker: an identifier in single braces. "{train,val}" never matches; a user's value that
# could (a path such as "runs/{date}") goes in through lit(), which doubles its braces.
_PARAM = re.compile(r"\{\{|\}\}|\{([a-z][a-z0-9_]*)\}")


def lit(value: object) -> str:
    """``value`` as literal text inside a message: its braces are never read as parameters."""
    return str(value).replace("{", "{{").replace("}", "}}")


def flag(name: str) -> str:
    """The CLI flag of a parameter: ``max_steps`` -> ``--max-steps``."""
    return "--" + name.replace("_", "-")


class ConfigError(ValueError):
    """Bad input: a value, a combination of values, or the environment they meet. The base of every input
    error of the pack; ``param`` is the parameter it is about (the first one the message names)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.template = message
        found = next((m.group(1) for m in _PARAM.finditer(message) if m.group(1)), None)
        self.param = param if param is not None else found

    def render(self, name: Callable[[str], str]) -> str:
        """The message with each parameter spelled by ``name``."""
        return _PARAM.sub(lambda m: name(m.group(1)) if m.group(1) else m.group(0)[0], self.template)

    def cli(self, aliases: dict[str, str] | None = None) -> str:
        """The one-line message for the command line: parameters as ``--flags`` (``aliases`` maps a
        library keyword to the config field whose flag it is, e.g. ``reference_batch`` -> ``lr_reference_batch``)."""
        aliases = aliases or {}
        return self.render(lambda p: flag(aliases.get(p, p))).strip().splitlines()[0]

    def renamed(self, **names: str) -> ConfigError:
        """The same error with parameters renamed (``decay="model_ema_decay"``): a library function's keyword
        is a differently named field of the config that called it."""
        template = _PARAM.sub(lambda m: "{" + names.get(m.group(1), m.group(1)) + "}" if m.group(1) else m.group(0),
                              self.template)
        return type(self)(template, names.get(self.param, self.param) if self.param else None)

    def __str__(self) -> str:
        return self.render(lambda p: p)

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled across processes (spawned ranks, loader workers) with the parameter kept.
        return (type(self), (self.template, self.param))


class DataError(ConfigError):
    """The data a parameter points at is missing, malformed or does not fit the run (``data_dir``, ...)."""


class CheckpointError(ConfigError):
    """The checkpoint ``resume`` names cannot be used for this run."""


class MissingDataError(DataError, FileNotFoundError):
    """The data a parameter points at is not there; also a ``FileNotFoundError``, which catches it."""
