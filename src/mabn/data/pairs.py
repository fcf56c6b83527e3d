"""The pairs of a dataset in the folder layout (``mabn.data.folder``): the image/mask pairs of a split and their
problems (``index_split``), and the images' sizes from their headers."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from .classes import CLASSES_FILE
from .errors import DatasetError, pair_problems
from .images import (
    image_size,
)

IMAGES, MASKS = "images", "masks"
IMAGE_TYPES = (".png", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff", ".webp")
MASK_TYPE = ".png"
MASK_TERM = "mask"  # what the messages call a mask file
MASK_EXPECTED = "a single-channel PNG of mask values (greyscale or palette), not a colour image"
LAYOUT = f"DIR/{IMAGES}/<split>/<name>.<png|jpg|...> with masks DIR/{MASKS}/<split>/<name>.png and DIR/{CLASSES_FILE}"


class Sample(NamedTuple):
    """One image/mask pair; ``name`` is the image's file name without its suffix (Cityscapes: the frame id)."""

    name: str
    image: Path
    label: Path


def _files(folder: Path, suffixes: tuple[str, ...]) -> dict[str, Path]:
    """The files below ``folder`` with one of ``suffixes`` (any case; hidden files left out), by their path
    below ``folder`` without the suffix; two files of one such name are an error."""
    found: dict[str, Path] = {}
    for path in sorted(folder.rglob("*")):
        if path.suffix.lower() not in suffixes or path.name.startswith(".") or not path.is_file():
            continue
        key = path.relative_to(folder).with_suffix("").as_posix()
        if key in found:
            raise DatasetError(f"{found[key]} and {path} have the same name: one mask pairs with one image")
        found[key] = path
    return found


def index_split(root: Path, split: str) -> tuple[list[Sample], list[str]]:
    """(the image/mask pairs of ``split`` in sorted order, as ``(name, image, mask)``; the problems of its layout,
    one line per kind naming the folder or the first file, with how many: a missing split folder, a split without
    images, masks of another type than PNG, images without their mask and masks without their image)."""
    image_dir, mask_dir = root / IMAGES / split, root / MASKS / split
    missing = [str(folder) for folder in (image_dir, mask_dir) if not folder.is_dir()]
    if missing:
        return [], [f"missing folder {' and '.join(missing)}; expected {LAYOUT}"]
    images = _files(image_dir, IMAGE_TYPES)
    if not images:
        return [], [f"no images ({', '.join(IMAGE_TYPES)}) in {image_dir}; expected {LAYOUT}"]
    # Masks of every image type are looked for, so that a JPEG mask is named as found rather than as missing.
    masks = _files(mask_dir, IMAGE_TYPES)
    problems = []
    other = {key for key, path in masks.items() if path.suffix.lower() != MASK_TYPE}
    if other:
        path = masks[min(other)]
        problems.append(
            f"{path}: masks are PNG files (a lossy format such as JPEG changes mask values): save it as "
            f"{path.with_suffix(MASK_TYPE).name} ({len(other)} mask(s) of another type in {mask_dir})"
        )
    problems += pair_problems(
        images,
        masks,
        lambda key, n: (
            f"image {images[key]} has no mask {mask_dir / (key + MASK_TYPE)} "
            f"({n} image(s) without masks in {image_dir})"
        ),
        lambda key, n: (
            f"mask {masks[key]} has no image {image_dir / key}.<{'|'.join(t[1:] for t in IMAGE_TYPES)}> "
            f"({n} mask(s) without images in {mask_dir})"
        ),
    )
    paired = sorted(images.keys() & masks.keys() - other)
    return [Sample(Path(key).name, images[key], masks[key]) for key in paired], problems


def find_pairs(root: str | Path, split: str) -> list[Sample]:
    """The image/mask pairs of ``split`` in sorted order, as ``(name, image, mask)``; ``DatasetError`` for the
    first problem of its layout (``index_split``)."""
    samples, problems = index_split(Path(root), split)
    if problems:
        raise DatasetError(problems[0])
    return samples


def read_sizes(samples: list[Sample], image_dir: Path) -> tuple[dict[Sample, tuple[int, int]], list[str]]:
    """(the (width, height) of each pair's image, read from the headers, by pair, for the pairs whose headers
    read; the lines for unreadable files and for masks of another size than their image, the first such pair
    named, with how many)."""
    sizes: dict[Sample, tuple[int, int]] = {}
    mismatched, unreadable = [], []
    for sample in samples:
        try:
            image, mask = image_size(sample.image), image_size(sample.label, "mask")
        except DatasetError as err:
            unreadable.append(str(err))
            continue
        sizes[sample] = image
        if image != mask:
            mismatched.append((sample, image, mask))
    problems = [f"{unreadable[0]} ({len(unreadable)} unreadable pair(s) in {image_dir})"] if unreadable else []
    if mismatched:
        sample, (iw, ih), (mw, mh) = mismatched[0]
        problems.append(
            f"size mismatch: image {sample.image} is {iw}x{ih} but mask {sample.label} is {mw}x{mh} (WxH) "
            f"({len(mismatched)} of the {len(samples)} pairs in {image_dir} differ): give each mask its image's size"
        )
    return sizes, problems


def pair_sizes(samples: list[Sample], image_dir: Path) -> list[tuple[int, int]]:
    """The (width, height) of each pair's image, read from the headers; ``DatasetError`` for the first problem
    of ``read_sizes`` (an unreadable file, masks of another size than their image)."""
    sizes, problems = read_sizes(samples, image_dir)
    if problems:
        raise DatasetError(problems[0])
    return list(sizes.values())
