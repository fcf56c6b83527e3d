"""A dry run's check of a dataset in the folder layout (``check_dataset``: every problem at once, one line per
kind), and the plan lines it gives: the crop from the data (``data_crop``), the images smaller than it
(``small_images``) and how images of other modes or with an EXIF orientation are read (``reading_lines``)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from .classes import CLASSES_FILE, ClassTable
from .errors import DatasetError, DatasetErrors
from .images import (
    TURNED,
    how_read,
    read_header,
    read_image,
)
from .masks import ClassPixels, unknown_values
from .pairs import IMAGES, index_split, read_sizes

# The crop a dataset of large images keeps: the recipe's (configs/cityscapes.yaml); images whose median is smaller
# get a crop from the data (``data_crop``), in steps of PSPNet's output stride.
RECIPE_CROP = 713
CROP_STEP = 8


class DatasetCheck(NamedTuple):
    """What ``check_dataset`` finds in a dataset that passes: the (width, height) of each training image, and the
    pixels per class of the training masks."""

    sizes: list[tuple[int, int]]
    pixels: ClassPixels


def check_dataset(args: Mapping[str, Any]) -> DatasetCheck:
    """Check the dataset of the data module arguments ``args`` (``data_dir``, the splits, ``global_batch_size``)
    as a dry run does, and return the training images' sizes and the training masks' pixels per class:
    ``classes.yaml``, then for both splits the layout and the pairs (``index_split``), the sizes from the headers
    (``read_sizes``) and every mask's values, counting its pixels per class in the same pass (``unknown_values``: read
    from the cache a fit wrote, not written; the masks whose headers read), and that the training pairs fill one
    global batch. ``DatasetErrors`` with one line per problem found, all of them."""
    root = Path(args["data_dir"])
    classes = ClassTable.read(root / CLASSES_FILE)
    problems: list[str] = []
    train_split = args.get("train_split") or "train"
    train_sizes: list[tuple[int, int]] = []
    for split in dict.fromkeys((train_split, args.get("val_split") or "val")):  # one split may serve both
        samples, found = index_split(root, split)
        sizes, bad_sizes = read_sizes(samples, root / IMAGES / split)
        values, pixels = unknown_values(root, split, list(sizes), classes, save=False)  # a dry run writes nothing
        problems += [*found, *bad_sizes, *([values] if values else [])]
        if split == train_split:
            train_sizes, train_pixels = list(sizes.values()), pixels
            batch = args.get("global_batch_size")
            if samples and batch and len(samples) < batch:
                problems.append(
                    f"{len(samples)} training images, fewer than the global batch {batch}: lower "
                    f"--data.init_args.global_batch_size (to {len(samples)} or less), or add training images"
                )
    if problems:
        raise DatasetErrors(problems)
    return DatasetCheck(train_sizes, train_pixels)


def small_images(sizes: list[tuple[int, int]], crop_size: int) -> tuple[int, str]:
    """(how many of the training images of ``sizes`` (width, height) are narrower or lower than the crop, and so
    padded up to it; the line that says so)."""
    count = sum(1 for width, height in sizes if min(width, height) < crop_size)
    line = f"{count} of the {len(sizes)} training images are smaller than the crop {crop_size}x{crop_size}"
    return count, line + (": padded up to it (images with the mean pixel, masks with ignored pixels)" if count else "")


def data_crop(sizes: list[tuple[int, int]], given: int | None) -> tuple[int, str]:
    """(the training crop of a dataset of training images of ``sizes`` (width, height); the line that says which
    and why): ``given`` (``crop_size``) where set; else the recipe's ``RECIPE_CROP`` where the median image's
    shorter side (the lower median) holds it, and where it does not, the largest multiple of ``CROP_STEP`` within
    that side, so that most images fill the crop and the few smaller ones are padded up to it."""
    if given is not None:
        return given, f"crop: {given}x{given}, crop_size as given"
    side = sorted(min(size) for size in sizes)[(len(sizes) - 1) // 2]
    median = f"the median training image is {side} px on its shorter side"
    if side >= RECIPE_CROP:
        return RECIPE_CROP, f"crop: {RECIPE_CROP}x{RECIPE_CROP}, the recipe's: {median} (crop_size null)"
    crop = max(CROP_STEP, side // CROP_STEP * CROP_STEP)
    return crop, (
        f"crop: {crop}x{crop}, from the data: {median}, under the recipe's {RECIPE_CROP} (crop_size null: the "
        f"largest multiple of {CROP_STEP} within it; --data.init_args.crop_size sets one)"
    )


def reading_lines(args: Mapping[str, Any]) -> list[str]:
    """How the pairs of both splits of the dataset of the data module arguments ``args`` are read, from their
    headers, for the dry run: a line per image mode other than 8-bit RGB, with how many files and the first, once
    that file was read as a fit reads it (so that a mode with no way to 8-bit RGB stops here, not in the fit); a
    line for the images, and one for the masks, that carry an EXIF orientation. ``DatasetErrors`` naming the files
    of the modes that do not read."""
    root = Path(args["data_dir"])
    modes: dict[str, list[Path]] = {}
    turned = {"image": 0, "mask": 0}
    for split in dict.fromkeys((args.get("train_split") or "train", args.get("val_split") or "val")):
        for sample in index_split(root, split)[0]:
            image = read_header(sample.image)
            modes.setdefault(image.mode, []).append(sample.image)
            turned["image"] += image.orientation in TURNED
            turned["mask"] += read_header(sample.label, "mask").orientation in TURNED
    lines, problems = [], []
    for mode, paths in sorted(modes.items()):
        if mode == "RGB":
            continue
        try:
            read_image(paths[0])
        except DatasetError as err:
            problems.append(str(err))
            continue
        files = f"{len(paths)} file{'s' if len(paths) > 1 else ''}"
        lines.append(f"images of mode {mode} ({files}, e.g. {paths[0]}): {how_read(mode)}")
    if problems:
        raise DatasetErrors(problems)
    return lines + [
        f"{count} {kind}{'s carry' if count > 1 else ' carries'} an EXIF orientation: read as displayed"
        for kind, count in turned.items()
        if count
    ]
