"""``python -m ddp_recipes.data.convert``: an ImageFolder to a litdata stream, on disk and on a real S3 API (moto's
server through tests/s3server.py; litdata, s3fs and boto3 unmocked), read back with ``litdata.StreamingDataset``.

litdata is the ``stream`` extra: where it is missing (the lent GPU machine) the tests that need it skip, naming it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddp_recipes.data.convert import main
from ddp_recipes.data.litdata_lib import STREAM_EXTRA, import_litdata
from tests.helpers import refusal, write_jpeg_tree
from tests.marks import needs_litdata

ROOT = Path(__file__).resolve().parents[2]
PROG = "python -m ddp_recipes.data.convert: error: "
FAST = ["--chunk-bytes", "8KB", "--workers", "2"]


def image_folder(root: Path, per_class: int = 8, val_per_class: int = 3) -> Path:
    """3 classes of small JPEGs, and a PNG in each train class."""
    from PIL import Image

    write_jpeg_tree(root, per_class, val_per_class, classes=3)
    for c in range(3):
        Image.new("RGB", (20 + c, 18), (40 * c, 90, 200)).save(root / "train" / f"c{c}" / "extra.png")
    return root


def source_files(root: Path, split: str) -> dict[str, tuple[bytes, int]]:
    """{path relative to SRC: (bytes, label)} of a split, labels in ImageFolder order."""
    classes = sorted(p.name for p in (root / "train").iterdir())
    return {p.relative_to(root).as_posix(): (p.read_bytes(), classes.index(p.parent.name))
            for p in sorted((root / split).rglob("*.*"))}


def read_back(url: str, cache: Path) -> dict[str, tuple[bytes, int]]:
    """Every sample of a converted split, through litdata's own reader."""
    litdata = import_litdata()
    dataset = litdata.StreamingDataset(url, cache_dir=str(cache))
    samples = list(dataset)  # iterated: dataset[i] on S3 reads single items, broken for this layout in 0.2.76
    found = {s["path"]: (bytes(s["image"]), int(s["label"])) for s in samples}
    assert len(found) == len(samples), "a sample came back twice"
    return found


def refused(argv: list[str], capsys) -> str:
    return refusal(main, argv, capsys, PROG)


@needs_litdata
def test_a_local_conversion_reads_back_byte_for_byte_and_a_rerun_skips(tmp_path, capsys):
    src, dest = image_folder(tmp_path / "src"), tmp_path / "out"
    assert main([str(src), str(dest), *FAST]) == 0
    out = capsys.readouterr().out
    assert "train: 27 samples, 3 classes, 0 corrupt file(s) left out" in out and "val: 9 samples" in out
    assert sorted(p.name for p in dest.iterdir()) == ["classes.json", "train", "val"]  # no staging left
    record = json.loads((dest / "classes.json").read_text())
    assert record["classes"] == ["c0", "c1", "c2"]
    assert record["splits"]["train"] == {"samples": 27, "files": 27, "corrupt": [], "not_jpeg": 3}  # the PNGs
    assert record["splits"]["val"]["samples"] == 9
    for split in ("train", "val"):
        assert read_back(str(dest / split), tmp_path / f"cache-{split}") == source_files(src, split)
    from ddp_recipes.data.stream import StreamImageDataModule

    with pytest.warns(UserWarning, match=r"3 of 36 files .* not named .jpg/.jpeg"):  # before training, as for a folder
        StreamImageDataModule(dest, batch_size=2, image_size=16, decode="gpu").setup("fit")

    before = {p: p.stat().st_mtime_ns for p in dest.rglob("*")}
    assert main([str(src), str(dest), *FAST]) == 0
    out = capsys.readouterr().out
    assert "train: already converted (27 samples" in out and "val: already converted (9 samples" in out
    assert {p: p.stat().st_mtime_ns for p in dest.rglob("*")} == before


@needs_litdata
def test_a_bucket_conversion_reads_back_and_touches_nothing_beside_its_prefix(s3, tmp_path, capsys):
    src = image_folder(tmp_path / "src")
    bucket = s3.bucket("stream")
    s3.client().put_object(Bucket="stream", Key="ds-other/keep.txt", Body=b"x")  # a sibling prefix
    staging = tmp_path / "staging"
    assert main([str(src), f"{bucket}/ds", *FAST, "--staging", str(staging)]) == 0
    keys = s3.keys("stream")
    assert "ds-other/keep.txt" in keys and "ds/classes.json" in keys
    assert {k.split("/")[1] for k in keys if k.startswith("ds/")} == {"classes.json", "train", "val"}
    assert all(k.endswith((".bin", "index.json")) for k in keys if k.startswith(("ds/train/", "ds/val/")))
    assert not staging.exists()
    record = json.loads(s3.client().get_object(Bucket="stream", Key="ds/classes.json")["Body"].read())
    assert record["classes"] == ["c0", "c1", "c2"] and record["splits"]["train"]["samples"] == 27
    for split in ("train", "val"):
        assert read_back(f"{bucket}/ds/{split}", tmp_path / f"cache-{split}") == source_files(src, split)
    capsys.readouterr()
    assert main([str(src), f"{bucket}/ds", *FAST]) == 0
    assert "train: already converted" in capsys.readouterr().out
    assert s3.keys("stream") == keys


def in_order(url: str, cache: Path) -> list[tuple[str, bytes, int]]:
    """A split's samples in the order the stream holds them."""
    dataset = import_litdata().StreamingDataset(url, cache_dir=str(cache))
    return [(s["path"], bytes(s["image"]), int(s["label"])) for s in dataset]


@needs_litdata
def test_a_killed_conversion_continues_to_the_dataset_of_an_uninterrupted_one(tmp_path, capsys):
    src = write_jpeg_tree(tmp_path / "src", 150, classes=3, side=16)
    args = ["--chunk-bytes", "2KB", "--workers", "1"]
    straight = tmp_path / "straight"
    assert main([str(src), str(straight), *args]) == 0

    dest = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "ddp_recipes.data.convert", str(src), str(dest), *args],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    staged = dest / ".staging" / "train"
    deadline = time.monotonic() + 60
    while not list(staged.glob("chunk-*.bin")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)  # no handler runs, nothing is cleaned up
    proc.wait()
    assert not (staged / "index.json").exists(), "the conversion finished before the kill: nothing was tested"
    assert not (dest / "train").exists() and not (dest / "classes.json").exists()

    capsys.readouterr()
    assert main([str(src), str(dest), *args]) == 0
    assert "continuing a stopped conversion" in capsys.readouterr().out
    # The same samples, each once, in the same order (litdata's resume may cut the chunk it stopped in
    # differently, so chunk files are not compared byte for byte).
    assert in_order(str(dest / "train"), tmp_path / "c1") == in_order(str(straight / "train"), tmp_path / "c2")
    assert json.loads((dest / "classes.json").read_text()) == json.loads((straight / "classes.json").read_text())


@needs_litdata
def test_corrupt_files_are_named_and_nothing_is_published_without_skip_corrupt(tmp_path, capfd):
    # capfd: litdata's worker processes name the files on the stderr file descriptor they inherit
    src, dest = image_folder(tmp_path / "src"), tmp_path / "out"
    (src / "train" / "c1" / "notes.jpg").write_text("not an image")
    whole = (src / "train" / "c0" / "0.jpg").read_bytes()
    (src / "train" / "c2" / "cut.jpg").write_bytes(whole[: len(whole) // 2])

    with pytest.raises(SystemExit) as stopped:
        main([str(src), str(dest), *FAST])
    assert stopped.value.code == 2
    err = capfd.readouterr().err
    named = [line for line in err.splitlines() if "corrupt file: " in line]
    assert sorted(line.split("corrupt file: ")[1].split(" (")[0] for line in named) == \
        ["train/c1/notes.jpg", "train/c2/cut.jpg"]
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"{PROG}SRC {src} holds 2 file(s) no decoder reads: train/c1/notes.jpg (not an image")
    assert "pass --skip-corrupt to leave them out" in last
    assert sorted(p.name for p in dest.iterdir()) == [".staging"]  # converted, not published

    assert main([str(src), str(dest), *FAST, "--skip-corrupt"]) == 0
    out = capfd.readouterr().out
    assert "train: staged already" in out and "2 corrupt file(s) left out" in out  # not decoded a second time
    record = json.loads((dest / "classes.json").read_text())
    assert [c.split(" (")[0] for c in record["splits"]["train"]["corrupt"]] == ["train/c1/notes.jpg",
                                                                                 "train/c2/cut.jpg"]
    assert record["splits"]["train"]["samples"] == 27 and record["splits"]["train"]["files"] == 29
    good = {k: v for k, v in source_files(src, "train").items() if "notes" not in k and "cut" not in k}
    assert read_back(str(dest / "train"), tmp_path / "cache") == good


@needs_litdata
def test_bad_sources_are_one_line_naming_src_and_write_nothing(tmp_path, capsys):
    dest = tmp_path / "out"
    assert refused([str(tmp_path / "nope"), str(dest)], capsys).startswith(f"SRC {tmp_path / 'nope'} does not exist")
    (tmp_path / "flat").mkdir()
    assert "has no train/ folder" in refused([str(tmp_path / "flat"), str(dest)], capsys)
    src = image_folder(tmp_path / "src")
    (src / "val" / "c1").rename(src / "val" / "c9")
    line = refused([str(src), str(dest)], capsys)
    assert line.startswith(f"SRC {src}: val/ has other class folders than train/ (differ: c1, c9)"), line
    assert not dest.exists()


@needs_litdata
def test_a_foreign_or_overlapping_dest_is_refused_untouched(tmp_path, capsys):
    src = image_folder(tmp_path / "src")
    mine = tmp_path / "mine"
    (mine / "train" / "c0").mkdir(parents=True)  # someone's ImageFolder
    (mine / "notes.txt").write_text("keep")
    line = refused([str(src), str(mine)], capsys)
    assert line.startswith(f"DEST {mine} holds files this converter did not write (notes.txt, train/c0)"), line
    assert sorted(p.relative_to(mine).as_posix() for p in mine.rglob("*")) == ["notes.txt", "train", "train/c0"]
    assert "overlaps SRC" in refused([str(src), str(src / "train" / "out")], capsys)
    assert not (src / "train" / "out").exists()


@needs_litdata
def test_a_missing_bucket_is_one_line_naming_dest(s3, tmp_path, capsys):
    src = image_folder(tmp_path / "src", per_class=1, val_per_class=0)
    line = refused([str(src), "s3://no-such-bucket/x", "--staging", str(tmp_path / "stg")], capsys)
    assert line.startswith("DEST s3://no-such-bucket/x: bucket no-such-bucket does not exist; create it"), line
    assert "no-such-bucket" not in s3.buckets() and not (tmp_path / "stg").exists()


def test_a_missing_extra_is_one_line_naming_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "litdata", None)  # `import litdata` raises ImportError
    line = refused([str(tmp_path / "src"), str(tmp_path / "out")], capsys)
    assert line == f"converting to a streamable dataset needs litdata, which is not installed: {STREAM_EXTRA}"
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("flags", "message"), [
    (["--chunk-bytes", "64XB"], "--chunk-bytes must be a size of at least 1KB such as 64MB or 256MiB (got '64XB')"),
    (["--chunk-bytes", "100B"], "--chunk-bytes must be a size of at least 1KB"),
    (["--workers", "0"], "--workers must be >= 1 (got 0)"),
])
def test_bad_flags_are_one_line_naming_them(tmp_path, capsys, flags, message):
    assert refused([str(tmp_path), str(tmp_path / "out"), *flags], capsys).startswith(message)


@needs_litdata
def test_a_litdata_dataset_not_written_by_the_converter_is_refused_untouched(tmp_path, capsys):
    """Chunks and an index that no classes.json of the converter lists (someone's own litdata output) are not
    taken for a stopped conversion of this SRC and overwritten."""
    src, theirs = image_folder(tmp_path / "src"), tmp_path / "theirs"
    (theirs / "train").mkdir(parents=True)
    (theirs / "train" / "index.json").write_text('{"chunks": [{"filename": "chunk-7-7.bin", "chunk_size": 3}]}')
    (theirs / "train" / "chunk-7-7.bin").write_text("precious")
    line = refused([str(src), str(theirs), *FAST], capsys)
    assert line.startswith(f"DEST {theirs} holds files this converter did not write (train/chunk-7-7.bin, "
                           "train/index.json)"), line
    assert (theirs / "train" / "chunk-7-7.bin").read_text() == "precious"
    assert sorted(p.name for p in theirs.rglob("*")) == ["chunk-7-7.bin", "index.json", "train"]


@needs_litdata
def test_a_lost_chunk_is_converted_again_not_taken_as_done(tmp_path, capsys):
    """A chunk gone from DEST (a lifecycle rule, a partial sync): the rerun converts that split again instead of
    saying "already converted" over a dataset a reader would fail on mid-epoch."""
    src, dest = image_folder(tmp_path / "src"), tmp_path / "out"
    assert main([str(src), str(dest), *FAST]) == 0
    lost = sorted((dest / "train").glob("chunk-*.bin"))[1]
    lost.unlink()
    capsys.readouterr()
    assert main([str(src), str(dest), *FAST]) == 0
    out = capsys.readouterr().out
    assert "val: already converted" in out and "train: 27 samples" in out and lost.exists()
    assert read_back(str(dest / "train"), tmp_path / "cache") == source_files(src, "train")


@needs_litdata
def test_staging_inside_dest_is_refused_before_anything_is_written(tmp_path, capsys):
    src, dest = image_folder(tmp_path / "src"), tmp_path / "out"
    line = refused([str(src), str(dest), "--staging", str(dest / "tmp"), *FAST], capsys)
    assert line.startswith(f"--staging {dest / 'tmp'} is inside DEST {dest}; pass a folder outside it"), line
    assert not dest.exists()


def test_files_not_named_jpeg_are_counted_for_decode_gpu_without_the_corrupt_ones_left_out():
    from ddp_recipes.data.convert import not_jpeg
    from ddp_recipes.data.convert_source import Split

    items = [["/s/train/c/a.JPEG", 0, "train/c/a.JPEG"], ["/s/train/c/b.png", 0, "train/c/b.png"],
             ["/s/train/c/c (1).png", 0, "train/c/c (1).png"]]
    assert not_jpeg(Split("train", items, "fp"), []) == 2
    assert not_jpeg(Split("train", items, "fp"), ["train/c/c (1).png (not an image: cannot identify)"]) == 1
