"""The converted streams the stream tests read (session-scoped: converted once, only read)."""

from __future__ import annotations

from pathlib import Path

import pytest

# 48 training images in 4 KB chunks: about a dozen chunks, so a rank's shard spans many of them.
CONVERT = ["--chunk-bytes", "4KB", "--workers", "1"]


@pytest.fixture(scope="session")
def local_stream(images, tmp_path_factory) -> Path:
    from ddp_recipes.data.convert import main as convert

    dest = tmp_path_factory.mktemp("stream") / "dest"
    assert convert([str(images), str(dest), *CONVERT]) == 0
    return dest


@pytest.fixture(scope="session")
def s3_stream(images, s3, tmp_path_factory) -> str:
    from ddp_recipes.data.convert import main as convert

    url = f"{s3.bucket('streams')}/tiny"
    assert convert([str(images), url, *CONVERT, "--staging", str(tmp_path_factory.mktemp("staging"))]) == 0
    return url
