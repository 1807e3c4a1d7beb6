"""A file of an image dataset that no decoder reads is named, relative to the data folder, wherever it is found.

From a loader worker the error crosses into the training process as text (the worker's traceback), so
:class:`UnreadableImage`'s message starts with the file's name and the recipe's one line names it on every path.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

MARK = "UnreadableImage: "  # how a worker's re-raised traceback ends: "<module>.UnreadableImage: <name> (<why>)"


class UnreadableImage(OSError):
    """``str()`` is ``"<name> (<why>)"``: the file relative to the data folder and the decoder's reason."""


def relative_name(path: str | os.PathLike, root: str | os.PathLike | None) -> str:
    """``path`` relative to ``root`` (the user's ``--data-dir``) where it lies inside, else as given."""
    if root is None:
        return os.fspath(path)
    try:
        return Path(path).relative_to(root).as_posix()
    except ValueError:
        return os.fspath(path)


def unreadable(path: str | os.PathLike, root: str | os.PathLike | None, err: BaseException) -> UnreadableImage:
    """The error naming ``path`` for the decoder's ``err``."""
    lines = str(err).strip().splitlines()
    reason = lines[-1] if lines else type(err).__name__
    if ".cpp:" in reason:  # torchvision's C++ errors lead with their source location: the user needs the end
        reason = re.sub(r"^.*\.cpp:\d+\W*", "", reason) or "the decoder refused it"
    if reason.startswith("cannot identify image file"):  # PIL names its buffer or the path, not the problem
        reason = "not an image: no decoder recognises its contents"
    return UnreadableImage(f"{relative_name(path, root)} ({reason})")


def describe(err: BaseException) -> str | None:
    """``"<name> (<why>)"`` for an :class:`UnreadableImage`, raised here or re-raised from a loader worker (whose
    message is the worker's whole traceback); None for any other error."""
    if not isinstance(err, UnreadableImage):
        return None
    text = str(err).strip()
    last = text.splitlines()[-1] if text else ""
    return last.split(MARK, 1)[1] if MARK in last else last
