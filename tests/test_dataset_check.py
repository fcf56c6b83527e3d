"""The dry run's check of a dataset of the user's own (``python -m mabn segment --data DIR --dry-run``,
``mabn.data.check.check_dataset``): each broken dataset exits 2 with a line naming the file or value and the fix,
several problems give several lines, and a healthy one exits 0; the fit's scan of the mask values caches the
masks found clean (a dry run writes nothing), so that the next fit or dry run decodes none of them again. The
fit's own checks of broken data run in tests/test_bad_input.py, the cache's own cases in tests/test_mask_cache.py."""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from helpers.commands import run_mabn
from helpers.marks import default_suite_runs
from mabn.data import check, folder, masks
from mabn.data.synthetic import segment as demo_segment

BATCH = ["--data.init_args.global_batch_size", "2"]  # the sets below have 3 training images


@pytest.fixture
def data(tmp_path, monkeypatch) -> Path:
    """A small healthy set (3 train, 2 val images of 64x32), the working folder beside it, the mask check's cache
    in a folder of its own, no scan in memory."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(masks.CACHE_DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(masks.MaskCache, "_memory", {})  # each check reads what the disk holds, as a new process
    # Masks changed within RECENT_NS of a scan are not cached, and a file's change time cannot be set back: the
    # cases that need it say so.
    monkeypatch.setattr(masks, "RECENT_NS", 0)
    return demo_segment.generate(tmp_path / "d", n_train=3, n_val=2, size=(32, 64))


def _saved(data: Path) -> dict[str, list[int]]:
    """The masks the cache file of the set ``data`` holds clean."""
    cache = masks.MaskCache(data, folder.ClassTable.read(data / "classes.yaml"))
    return json.loads(cache.path.read_text())["clean"]


def _check(root: Path, capsys, *extra: str) -> tuple[int, list[str]]:
    """Exit code and ``error:`` lines of the dry run on ``root``."""
    argv = ["segment", "--data", str(root), "--backbone", "none", "--dry-run", "--", *extra]
    code, _, err = run_mabn(argv, capsys)
    return code, [line.removeprefix("error: ") for line in err.splitlines() if line.startswith("error: ")]


def _set_value(path: Path, value: int) -> None:
    mask = np.asarray(Image.open(path)).copy()
    mask[3, 5] = value
    Image.fromarray(mask).save(path)


def _as_jpeg(path: Path) -> None:
    Image.open(path).convert("L").save(path.with_suffix(".jpg"))
    path.unlink()


def _resize(path: Path) -> None:
    Image.open(path).resize((16, 16), Image.Resampling.NEAREST).save(path)


# (id, setup on the set's root d, the line expected, with {d} the root)
BROKEN: list[tuple[str, Callable[[Path], object], str]] = [
    ("value-of-no-class", lambda d: _set_value(d / "masks/train/scene001.png", 99),
     "mask {d}/masks/train/scene001.png holds value 99, neither a class nor ignored by {d}/classes.yaml (class mask "
     "values 7, 8, 11, 17, 21, 23, 24, 26, ignore_index 0); 1 of the 3 masks in {d}/masks/train hold such values: "
     "map them to a class (or ignore them) in {d}/classes.yaml, or correct the masks"),
    ("missing-val-split", lambda d: (shutil.rmtree(d / "images/val"), shutil.rmtree(d / "masks/val")),
     "missing folder {d}/images/val and {d}/masks/val; expected DIR/images/<split>/<name>.<png|jpg|...> with masks "
     "DIR/masks/<split>/<name>.png and DIR/classes.yaml"),
    ("val-mask-of-another-size", lambda d: _resize(d / "masks/val/scene001.png"),
     "size mismatch: image {d}/images/val/scene001.jpg is 64x32 but mask {d}/masks/val/scene001.png is 16x16 (WxH) "
     "(1 of the 2 pairs in {d}/images/val differ): give each mask its image's size"),
    ("jpeg-mask", lambda d: _as_jpeg(d / "masks/train/scene000.png"),
     "{d}/masks/train/scene000.jpg: masks are PNG files (a lossy format such as JPEG changes mask values): save it "
     "as scene000.png (1 mask(s) of another type in {d}/masks/train)"),
    ("image-without-mask", lambda d: (d / "masks/val/scene000.png").unlink(),
     "image {d}/images/val/scene000.jpg has no mask {d}/masks/val/scene000.png (1 image(s) without masks in "
     "{d}/images/val)"),
    ("mask-without-image", lambda d: (d / "images/train/scene002.jpg").unlink(),
     "mask {d}/masks/train/scene002.png has no image {d}/images/train/scene002.<png|jpg|jpeg|bmp|tif|tiff|webp> "
     "(1 mask(s) without images in {d}/masks/train)"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("setup", "expected"),
    default_suite_runs(
        [c[1:] for c in BROKEN],
        keep=[c[1:] for c in BROKEN if c[0] in ("value-of-no-class", "jpeg-mask")],
        ids=[c[0] for c in BROKEN],
    ),  # fmt: skip
)
def test_a_broken_dataset_is_one_line_naming_the_file(data, capsys, setup, expected):
    assert _check(data, capsys, *BATCH) == (0, [])
    setup(data)
    assert _check(data, capsys, *BATCH) == (2, [expected.format(d=data)])


def test_fewer_training_images_than_the_global_batch_says_to_lower_it(data, capsys):
    assert _check(data, capsys) == (
        2,
        ["3 training images, fewer than the global batch 16: lower --data.init_args.global_batch_size (to 3 or "
         "less), or add training images"],
    )  # fmt: skip


def test_every_problem_is_a_line_of_its_own(data, capsys):
    _as_jpeg(data / "masks/train/scene000.png")
    _set_value(data / "masks/train/scene001.png", 99)
    (data / "masks/val/scene000.png").write_bytes(b"not a PNG")
    _resize(data / "masks/val/scene001.png")
    code, lines = _check(data, capsys)
    assert code == 2
    assert [line.split(" ")[0] for line in lines] == [
        f"{data}/masks/train/scene000.jpg:",  # the JPEG mask, its image left unpaired
        "mask",  # the training mask of no class
        "2",  # two training pairs, fewer than the global batch 16
        "cannot",  # the val mask that does not read: named, not decoded
        "size",  # the val mask of another size
    ], lines
    assert f"mask {data}/masks/train/scene001.png holds value 99," in lines[1] and "1 of the 2 masks" in lines[1]
    assert lines[3].startswith(f"cannot read mask file {data}/masks/val/scene000.png: ")
    assert lines[3].endswith(f"(1 unreadable pair(s) in {data}/images/val)")


def _fit_scan(data: Path) -> None:
    """What a fit checks of the data before its first step (``FolderDataModule.setup``), in a fresh process."""
    masks.MaskCache._memory.clear()
    module = folder.FolderDataModule(str(data), crop_size=32, num_workers=0)
    for split, train in (("train", True), ("val", False)):
        module.make_dataset(split, train)


def test_a_dry_run_checks_the_dataset_once(data, capsys, monkeypatch):
    """The plan's count of training images and its line on small images come from one check: it reads every
    image's header, seconds on a large dataset."""
    calls = []

    def counted(args: dict) -> list[tuple[int, int]]:
        calls.append(args["data_dir"])
        return original(args)

    original = check.check_dataset
    monkeypatch.setattr(folder, "check_dataset", counted)
    assert _check(data, capsys, *BATCH) == (0, [])
    assert calls == [str(data)]


def test_a_healthy_dataset_passes_and_its_scan_is_cached(data, decoded, capsys):
    files = sorted((data / "masks").rglob("*.png"))
    assert _check(data, capsys, *BATCH) == (0, [])
    assert sorted(decoded) == files  # each mask decoded once: the dry run checks the dataset once
    assert not (data.parent / "cache").exists()  # a dry run writes nothing
    decoded.clear()
    assert _check(data, capsys, *BATCH) == (0, [])
    assert decoded == []  # the next dry run of this process remembers the first one's verdicts

    masks.MaskCache._memory.clear()
    _fit_scan(data)
    assert sorted(decoded) == files
    assert sorted(_saved(data)) == [p.relative_to(data).as_posix() for p in files]
    decoded.clear()
    _fit_scan(data)
    assert decoded == []  # the next fit reads the cache
    masks.MaskCache._memory.clear()
    assert _check(data, capsys, *BATCH) == (0, [])
    assert decoded == []  # and so does a dry run

    changed = data / "masks/val/scene001.png"
    _set_value(changed, 7)  # a class's value: the file changed, its values still fine
    _fit_scan(data)
    assert decoded == [changed]  # only the changed mask decoded again

    decoded.clear()
    classes = data / "classes.yaml"
    classes.write_text(classes.read_text().replace("ignore_index: 0", "ignore_index: 1"))
    code, lines = _check(data, capsys, *BATCH)
    assert sorted(decoded) == files  # another class table: every mask again (value 0 is no class now)
    assert code == 2 and len(lines) == 2 and all("holds value 0," in line for line in lines), lines


def test_a_mask_changed_within_a_tick_of_its_scan_is_not_recorded_clean(data, monkeypatch):
    monkeypatch.setattr(masks, "RECENT_NS", 2_000_000_000)
    files = sorted((data / "masks/train").glob("*.png"))
    time.sleep(0.05)  # past the coarse clock's tick that file times take: the others changed before this one
    os.utime(files[0], ns=(1, 1))  # its times set far back, its change time now
    classes = folder.ClassTable.read(data / "classes.yaml")
    cache = masks.MaskCache(data, classes)
    pixels = {mask: masks.unknown_in(mask, classes).pixels for mask in files}
    cache.add(pixels, files[0].stat().st_ctime_ns + masks.RECENT_NS, save=False)  # scanned within its tick
    assert [mask for mask in files if cache.pixels(mask) is not None] == files[1:]


def test_many_masks_are_decoded_in_worker_processes_with_progress(data, capsys, monkeypatch):
    monkeypatch.setattr(masks, "SCAN_PARALLEL", 2)
    _set_value(data / "masks/train/scene002.png", 99)
    code, _, err = run_mabn(["segment", "--data", str(data), "--backbone", "none", "--dry-run", "--", *BATCH], capsys)
    assert code == 2 and "checking mask values: 3/3 masks" in err and "checking mask values: 2/2 masks" in err
    assert f"error: mask {data}/masks/train/scene002.png holds value 99," in err
    with pytest.raises(folder.DatasetError, match=f"mask {data}/masks/train/scene002.png holds value 99,"):
        _fit_scan(data)
    # the clean masks, the bad one left out
    assert sorted(_saved(data)) == ["masks/train/scene000.png", "masks/train/scene001.png"]
