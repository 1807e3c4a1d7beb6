"""What the stream tests check a run or a reader by: the bytes read, the chunk GETs the test S3 server saw, the
node's cache folders left behind (shared by tests/data/test_stream.py and test_stream_stops.py)."""

from __future__ import annotations

from pathlib import Path

PROG = "python -m recipes.resnet: error: "


def digest(dm) -> str:
    """Every sample's path and bytes, train then val, in index order."""
    import hashlib

    h = hashlib.sha256()
    for split in (dm.train_set.split, dm.val_set.split):
        for i in range(len(split)):
            sample = split[i]
            h.update(sample["path"].encode() + b"\0" + bytes(sample["image"]))
    return h.hexdigest()


def chunk_counter(s3, url: str):
    """A function returning the chunk GETs under ``url`` since its last call, and the chunks there."""
    bucket, prefix = url.removeprefix("s3://").split("/", 1)
    chunks = sorted(f"/{bucket}/{key}" for key in s3.keys(bucket, prefix) if "/chunk-" in key)
    seen = [len(s3.paths("GET", f"/{bucket}/{prefix}/"))]

    def since() -> tuple[list[str], list[str]]:
        paths = s3.paths("GET", f"/{bucket}/{prefix}/")
        new, seen[0] = paths[seen[0]:], len(paths)
        return [p for p in new if "/chunk-" in p], chunks

    return since


def cache_folders(cache: Path) -> list[str]:
    return sorted(p.name for p in (cache / "stream").iterdir() if p.is_dir())
