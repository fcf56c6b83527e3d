"""The dry run's class coverage (``python -m mabn segment --data DIR --dry-run``, ``mabn.data.masks.ClassPixels``):
the share of each class in the training pixels, counted in the pass that checks the mask values; a warning line
for a class of no pixel, and one for ignored pixels of more than half with the fix in ``classes.yaml``'s terms
(binary masks of 0/255 read with the default ``ignore_index: 255``); the counts those of the masks, and the same
from the mask check's cache, which a second check reads without decoding a mask."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from helpers.commands import run_mabn
from mabn.data import check, folder, masks

BATCH = ["--data.init_args.global_batch_size", "2"]  # the sets below have 3 training images
SIZE = (33, 45)  # an odd number of pixels: the count's pairs of pixels leave one over


@pytest.fixture
def root(tmp_path, monkeypatch) -> Path:
    """The dataset's folder, the working folder beside it, the mask check's cache in a folder of its own, no scan
    in memory."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(masks.CACHE_DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(masks.MaskCache, "_memory", {})  # each check reads what the disk holds, as a new process
    monkeypatch.setattr(masks, "RECENT_NS", 0)  # masks written just before a scan are cached all the same
    return tmp_path / "d"


def _write(root: Path, classes: str, masks: dict[str, list[np.ndarray]]) -> Path:
    """A dataset at ``root``: ``classes`` as its classes.yaml, and per split its ``masks``, each with an image."""
    rng = np.random.default_rng(0)
    for split, arrays in masks.items():
        for folder_name in ("images", "masks"):
            (root / folder_name / split).mkdir(parents=True)
        for index, mask in enumerate(arrays):
            image = rng.integers(0, 256, (*mask.shape[:2], 3), dtype=np.uint8)
            Image.fromarray(image).save(root / "images" / split / f"{index}.png")
            Image.fromarray(mask).save(root / "masks" / split / f"{index}.png")
    (root / "classes.yaml").write_text(classes)
    return root


def _binary(foreground_columns: int) -> np.ndarray:
    """A mask of 0 (background) and, in its first ``foreground_columns`` columns, 255 (foreground)."""
    mask = np.zeros(SIZE, dtype=np.uint8)
    mask[:, :foreground_columns] = 255
    return mask


def _dry_run(root: Path, capsys) -> tuple[int, list[str]]:
    """Exit code and lines (stdout and stderr) of the dry run on ``root``."""
    argv = ["segment", "--data", str(root), "--backbone", "none", "--dry-run", "--", *BATCH]
    code, out, err = run_mabn(argv, capsys)
    return code, (out + err).splitlines()


def _warnings(lines: list[str]) -> list[str]:
    return [line for line in lines if line.startswith("warning: ")]


def test_binary_masks_of_0_255_are_warned_of_with_the_fix_that_clears_the_warnings(root, capsys):
    # 28 of the 45 columns foreground: 62% of the pixels hold 255, the default ignore_index.
    d = _write(root, "classes: [background, foreground]\n", {"train": [_binary(28)] * 3, "val": [_binary(28)] * 2})
    code, lines = _dry_run(d, capsys)
    assert code == 0, lines
    assert "training pixels per class (3 masks): background 38%, foreground 0%, ignored 62%" in lines
    assert _warnings(lines) == [
        f"warning: class 'foreground' (mask value 1) has no pixel in the 3 training masks: the run never learns it; "
        f"add training images that show it, or correct its values in {d}/classes.yaml",
        f"warning: 255 is ignore_index and covers 62% of the training pixels: masks of 0/255? map 255 to "
        f"'foreground' in {d}/classes.yaml: mask_values: {{0: background, 255: foreground}} and ignore_index: null",
    ]

    # The classes.yaml the warning spells out: foreground is 255, nothing is ignored.
    (d / "classes.yaml").write_text(
        "classes: [background, foreground]\nmask_values: {0: background, 255: foreground}\nignore_index: null\n"
    )
    code, lines = _dry_run(d, capsys)
    assert code == 0, lines
    assert "training pixels per class (3 masks): background 38%, foreground 62%, ignored 0%" in lines
    assert _warnings(lines) == []


def test_a_class_never_present_in_the_training_masks_is_a_line_of_its_own(root, capsys):
    mask = np.zeros(SIZE, dtype=np.uint8)
    mask[:, 10:30] = 1
    mask[:3] = 255  # a few unlabelled rows: a tenth of the pixels, no cause for a warning
    car = mask.copy()
    car[20:, 30:] = 3  # the car is in a validation mask only
    classes = "classes: [sky, tree, car]\nmask_values: {0: sky, 1: tree, 2: car, 3: car}\n"
    d = _write(root, classes, {"train": [mask] * 3, "val": [mask, car]})
    code, lines = _dry_run(d, capsys)
    assert code == 0, lines
    assert "training pixels per class (3 masks): sky 51%, tree 40%, car 0%, ignored 9%" in lines
    assert _warnings(lines) == [
        f"warning: class 'car' (mask values 2, 3) has no pixel in the 3 training masks: the run never learns it; "
        f"add training images that show it, or correct its values in {d}/classes.yaml"
    ]


def _fit_scan(root: Path) -> None:
    """What a fit checks of the data before its first step (``FolderDataModule.setup``), in a fresh process: it
    records the masks found clean, with their pixels, in the cache file."""
    masks.MaskCache._memory.clear()
    module = folder.FolderDataModule(str(root), crop_size=32, num_workers=0)
    for split, train in (("train", True), ("val", False)):
        module.make_dataset(split, train)


def test_the_counts_are_the_masks_and_a_check_served_from_the_cache_gives_the_same(root, decoded, capsys):
    rng = np.random.default_rng(1)
    values = np.array([0, 1, 2, 255], dtype=np.uint8)
    maps = {split: [values[rng.integers(0, 4, SIZE)] for _ in range(n)] for split, n in (("train", 3), ("val", 2))}
    d = _write(root, "classes: [a, b, c]\n", maps)
    found, counts = np.unique(np.stack(maps["train"]), return_counts=True)
    expected = dict(zip(found.tolist(), counts.tolist()))
    args = {"data_dir": str(d), "global_batch_size": 2}

    pixels = check.check_dataset(args).pixels
    assert (pixels.pixels, pixels.ignored, pixels.masks) == ((expected[0], expected[1], expected[2]), expected[255], 3)
    assert pixels.total == 3 * SIZE[0] * SIZE[1]
    assert len(decoded) == 5  # every mask of both splits, once

    _fit_scan(d)  # the fit's scan writes the cache: a later process decodes none of these masks
    decoded.clear()
    masks.MaskCache._memory.clear()
    assert check.check_dataset(args).pixels == pixels
    masks.MaskCache._memory.clear()
    code, lines = _dry_run(d, capsys)
    assert code == 0 and pixels.lines()[0] in lines, lines
    assert decoded == []


def test_a_cache_entry_without_pixel_counts_is_ignored_with_one_line(root, decoded, capsys):
    """An entry of the file's stamp alone vouches for the values but says nothing of the classes' pixels: the
    cache is not read, and every mask is decoded."""
    d = _write(root, "classes: [a, b]\nignore_index: 7\n", {"train": [_binary(0)] * 3, "val": [_binary(0)] * 2})
    cache = masks.MaskCache(d, folder.ClassTable.read(d / "classes.yaml"))
    stamps = {}
    for mask in sorted((d / "masks").rglob("*.png")):
        stat = mask.stat()
        stamps[mask.relative_to(d).as_posix()] = [stat.st_size, stat.st_mtime_ns, stat.st_ino, stat.st_ctime_ns]
    cache.path.parent.mkdir(parents=True)
    cache.path.write_text(json.dumps({"root": cache.resolved, "classes": cache.table, "clean": stamps}))
    masks.MaskCache._memory.clear()
    capsys.readouterr()
    pixels = check.check_dataset({"data_dir": str(d), "global_batch_size": 2}).pixels
    assert _warnings(capsys.readouterr().err.splitlines()) == [
        f"warning: ignoring {cache.path}: not the mask check's cache of {d}; decoding every mask"
    ]
    assert len(decoded) == 5 and pixels.pixels == (3 * SIZE[0] * SIZE[1], 0)


def _table(text: str) -> folder.ClassTable:
    return folder.ClassTable.parse(yaml.safe_load(text))


def test_the_lines_of_colour_masks_many_values_and_small_shares():
    colour = _table("classes: [a, b]\ncolors: [[1, 2, 3], [4, 5, 6]]\nmask_format: color\nignore_color: [0, 0, 0]\n")
    assert masks.ClassPixels(colour, (0, 30), 70, 2).lines() == [
        "training pixels per class (2 masks): a 0%, b 30%, ignored 70%",
        "warning: class 'a' (colour [1, 2, 3]) has no pixel in the 2 training masks: the run never learns it; add "
        "training images that show it, or correct its colours in classes.yaml",
        "warning: ignore_color [0, 0, 0] covers 70% of the training pixels: is [0, 0, 0] the colour of a class? "
        "give it to 'a' in classes.yaml's colors, and set ignore_color to another colour (or null)",
    ]

    # Classes of more values than binary masks hold: the question is not "masks of 0/255?".
    five = _table("classes: [a, b, c, d, e]\n")
    lines = masks.ClassPixels(five, (10, 10, 10, 10, 0), 60, 4).lines()
    assert lines[2] == (
        "warning: 255 is ignore_index and covers 60% of the training pixels: is 255 the value of 'e'? map 255 to "
        "'e' in classes.yaml's mask_values and set ignore_index: null (or another value)"
    )
    assert len(lines) == 3 and lines[1].startswith("warning: class 'e' (mask value 4) has no pixel")

    # Every class present and most pixels ignored: sparse labels, or a class's value taken for the ignored one.
    lines = masks.ClassPixels(five, (1, 1, 1, 1, 1), 995, 1).lines()
    assert lines == [
        "training pixels per class (1 mask): a <1%, b <1%, c <1%, d <1%, e <1%, ignored >99%",
        "warning: 255 is ignore_index and covers >99% of the training pixels: does 255 mark a class? map 255 to "
        "its class in classes.yaml's mask_values and set ignore_index: null (or another value)",
    ]

    # Six classes of no pixel: the first five named, and how many in all.
    eight = _table("classes: [a, b, c, d, e, f, g, h]\n")
    (_, absent) = masks.ClassPixels(eight, (5, 5, 0, 0, 0, 0, 0, 0), 0, 1).lines()
    assert absent.startswith("warning: 6 classes 'c' (mask value 2), 'd' (mask value 3), 'e' (mask value 4), ")
    assert "'g' (mask value 6), ... have no pixel in the 1 training mask: the run never learns them;" in absent
