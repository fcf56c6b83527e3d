"""Segmentation datasets: the base of every one (``FolderDataset``, ``FolderDataModule``: reading, the checks, the
class coverage, the mask cache, the crop, the recipe's augmentation and loaders), in the layout of a dataset of the
user's own, in one folder: what ``python -m mabn segment --data DIR`` trains on (docs/your-data.md). A dataset of
another layout is a subclass that names its layout, its ids and its classes (``mabn.data.cityscapes``).

Layout::

    DIR/classes.yaml                    the classes (``mabn.data.classes``)
    DIR/images/<split>/<name>.<ext>     .png, .jpg, .jpeg, .bmp, .tif, .tiff or .webp, any mode (read as displayed)
    DIR/masks/<split>/<name>.png        one PNG per image, of the image's size: single-channel mask values, or
                                        the class colours with ``mask_format: color``

for the splits ``train`` and ``val``. An image and its mask pair by their path below the split folder without
the suffix (``images/val/a/x.jpg`` and ``masks/val/a/x.png``). The recipe is stage 2's (``train_transform``'s
augmentation, ``FolderDataModule``'s batches, loaders and crop): a training image smaller than the crop is padded
up to it as the augmentation pads (the image with the mean pixel, the mask with ignored pixels), and
``small_images`` says how many are.

What is checked when: ``--dry-run`` checks the whole dataset (``check_dataset``) and names every problem at once,
one line per kind: ``classes.yaml``; for both splits the folders, that every image has its PNG mask and the
reverse, the sizes (from the files' headers, no pixel decoded) and every mask's values (decoded, in worker
processes for many masks); and that the training images fill one global batch. A fit checks ``classes.yaml`` when
the data module is made, then each split's pairs and sizes as it is indexed and its mask values before the first
step (stopping at the first problem). A fit records the masks its scan found clean in a file of the user's cache
directory (``MaskCache``: never in the data folder), so that later dry runs and fits decode only new or changed
masks; a dry run reads it and, writing nothing, decodes each other mask once. A mask read during the fit that
holds a value of no class ends it with the same line, whatever the cache said.

The pass over the mask values also counts each mask's pixels per class, kept in the cache with its verdict: the
dry run prints each class's share of the training pixels, with a warning line for a class of none and for
ignored pixels of more than half (``ClassPixels``).
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Mapping
from concurrent.futures import ProcessPoolExecutor
from contextlib import suppress
from dataclasses import dataclass
from functools import cached_property
from itertools import repeat
from pathlib import Path
from typing import Any, NamedTuple

import albumentations as A
import cv2
import numpy as np
import pytorch_lightning as pl
import torch
import yaml
from torch.utils.data import DataLoader, Dataset

from ..distributed import first_process, say
from ..errors import WriteError
from ..run import TMP_SUFFIX, first_line, per_device_batch, write_text_atomic
from .classes import CLASSES_FILE, COLOR, IGNORE_INDEX, ClassTable
from .errors import DatasetError, DatasetErrors, pair_problems
from .images import (
    IMAGENET_MEAN,
    TURNED,
    how_read,
    image_size,
    imagenet_normalize,
    read_header,
    read_image,
    read_values,
)
from .loading import DataLayout, DataPlan, make_loader, node_devices

__all__ = [
    "ClassPixels",
    "FolderDataModule",
    "FolderDataset",
    "Sample",
    "check_dataset",
    "data_crop",
    "find_pairs",
    "small_images",
    "train_transform",
]

IMAGES, MASKS = "images", "masks"
IMAGE_TYPES = (".png", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff", ".webp")
MASK_TYPE = ".png"
MASK_TERM = "mask"  # what the messages call a mask file
MASK_EXPECTED = "a single-channel PNG of mask values (greyscale or palette), not a colour image"
LAYOUT = f"DIR/{IMAGES}/<split>/<name>.<png|jpg|...> with masks DIR/{MASKS}/<split>/<name>.png and DIR/{CLASSES_FILE}"
CACHE_DIR_ENV = "MABN_CACHE_DIR"  # the variable naming the folder of the mask check's cache (``cache_dir``)
CACHE_FORM = 2  # the form of the cache's entries (``MaskCache``): the file's stamp, then its pixels per class
# The crop a dataset of large images keeps: the recipe's (configs/cityscapes.yaml); images whose median is smaller
# get a crop from the data (``data_crop``), in steps of PSPNet's output stride.
RECIPE_CROP = 713
CROP_STEP = 8
SCAN_PARALLEL = 64  # masks: fewer are decoded in this process, where a pool's start would cost more than it saves
SCAN_WORKERS = 4  # decoding processes: a few, since the other cores may be a fit's or another user's
SCAN_REPORTS = 10  # progress lines on stderr in a parallel scan
# A file's change time moves in ticks (up to 2 s on some filesystems): a mask changed within a tick of its decode
# could keep its stamp, so masks changed this shortly before a scan are not recorded clean.
RECENT_NS = 2_000_000_000
# A cache write lasts milliseconds: its temporary file this old is a killed write's, a younger one may be another
# process's write in progress.
STALE_TMP_NS = 60 * 10**9
# Padding the uint8 image with the mean pixel makes padded areas exactly 0 after normalization (as hszhao pads).
MEAN_PIXEL = tuple(255.0 * m for m in IMAGENET_MEAN)


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


def _sizes(samples: list[Sample], image_dir: Path) -> tuple[dict[Sample, tuple[int, int]], list[str]]:
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
    of ``_sizes`` (an unreadable file, masks of another size than their image)."""
    sizes, problems = _sizes(samples, image_dir)
    if problems:
        raise DatasetError(problems[0])
    return list(sizes.values())


def read_mask(
    path: Path,
    classes: ClassTable,
    term: str = MASK_TERM,
    expected: str = MASK_EXPECTED,
) -> np.ndarray:
    """The mask's values (H x W), or its RGB colours (H x W x 3) for colour masks; errors name it a ``term`` file,
    and say ``expected`` of one that is not single-channel."""
    if classes.mask_format == COLOR:
        return read_values(path, term, "RGB")
    mask = read_values(path, term)
    if mask.ndim != 2:
        raise DatasetError(f"{term} file {path} has shape {mask.shape}; expected {expected}")
    return mask


class MaskCheck(NamedTuple):
    """What the check of one mask finds: its values (colours) that are neither a class's nor ignored
    (``ClassTable.classes_of``), and its pixels of each class index, those of ``IGNORE_INDEX`` last (the ignored
    value's or colour's, and any of no class)."""

    unknown: np.ndarray
    pixels: list[int]


def class_pixels(class_map: np.ndarray, count: int) -> list[int]:
    """The pixels of each class index 0..``count - 1`` of the uint8 ``class_map``, then those of ``IGNORE_INDEX``."""
    flat = class_map.ravel()
    # np.bincount widens each element to 64 bits: counting pairs of pixels, as uint16, halves that pass, which is
    # what counting adds to the decode of a mask. A pair (a, b) is bin a + 256 b on a little-endian machine,
    # 256 a + b on a big-endian one: either way, summing the 256 x 256 bins over each axis counts both pixels.
    pairs = np.bincount(flat[: flat.size // 2 * 2].view(np.uint16), minlength=1 << 16).reshape(256, 256)
    counts = pairs.sum(axis=0) + pairs.sum(axis=1)
    if flat.size % 2:
        counts[flat[-1]] += 1
    return [*counts[:count].tolist(), int(counts[IGNORE_INDEX])]


def unknown_in(path: Path, classes: ClassTable) -> MaskCheck:
    """The values (colours) of the mask at ``path`` that are neither a class's nor ignored, and its pixels per
    class, counted on the class map the check makes anyway (the dry run's coverage lines, ``ClassPixels``)."""
    class_map, unknown = classes.classes_of(read_mask(path, classes))
    return MaskCheck(unknown, class_pixels(class_map, len(classes.names)))


def _share(part: int, total: int) -> str:
    """``part`` of ``total`` in whole percent; a share that would round to 0% or 100% without being it is said
    ``<1%`` or ``>99%``, so that a class with few pixels never reads as one with none."""
    if 0 < part and part * 200 < total:
        return "<1%"
    if part < total and part * 200 >= total * 199:
        return ">99%"
    return f"{100 * part / total:.0f}%"


@dataclass(frozen=True)
class ClassPixels:
    """The pixels of the ``masks`` masks of a split, counted by the mask check (``unknown_values``): ``pixels[i]``
    of class ``i`` of ``classes``, and ``ignored`` (the ignored value's or colour's). What the dry run's coverage
    lines say (``lines``), and what class weights can be computed from."""

    classes: ClassTable
    pixels: tuple[int, ...]
    ignored: int
    masks: int

    @classmethod
    def total_of(cls, classes: ClassTable, counts: list[list[int]]) -> ClassPixels:
        """The sum of ``counts``, one per mask (``MaskCheck.pixels``)."""
        summed = np.asarray(counts, dtype=np.int64).reshape(-1, len(classes.names) + 1).sum(axis=0).tolist()
        return cls(classes, tuple(summed[:-1]), summed[-1], len(counts))

    @property
    def total(self) -> int:
        return sum(self.pixels) + self.ignored

    def _marks(self, index: int) -> str:
        """What marks class ``index`` in the masks: its mask values, or its colour."""
        if self.classes.mask_format == COLOR:
            return f"colour {list(self.classes.colors[index])}"
        values = [value for value, target in self.classes.mask_values if target == index]
        return f"mask value{'s' if len(values) > 1 else ''} {', '.join(map(str, values))}"

    def lines(self) -> list[str]:
        """The dry run's lines on the training split (of at least one mask): the share of each class and of the
        ignored pixels; a warning naming the classes of no pixel, which the run cannot learn; and one where the
        ignored pixels are more than half, which train nothing: the mark of a class taken for the ignored one,
        as in binary masks of 0/255 read with the default ``ignore_index: 255``."""
        names, total, source = self.classes.names, self.total, self.classes.source
        plural = "s" if self.masks > 1 else ""
        shares = [f"{name} {_share(count, total)}" for name, count in zip(names, self.pixels)]
        shares.append(f"ignored {_share(self.ignored, total)}")
        lines = [f"training pixels per class ({self.masks} mask{plural}): {', '.join(shares)}"]
        absent = [index for index, count in enumerate(self.pixels) if not count]
        if absent:
            shown = ", ".join(f"{names[index]!r} ({self._marks(index)})" for index in absent[:5])
            shown += ", ..." if len(absent) > 5 else ""
            one = len(absent) == 1
            which, them = (f"class {shown} has", "it") if one else (f"{len(absent)} classes {shown} have", "them")
            lines.append(
                f"warning: {which} no pixel in the {self.masks} training mask{plural}: the run never learns {them}; "
                f"add training images that show {them}, or correct {'its' if one else 'their'} "
                f"{self.classes.mask_unit} in {source}"
            )
        if self.ignored * 2 > total:
            lines.append(f"warning: {self._ignored_line(absent)}")
        return lines

    def _ignored_line(self, absent: list[int]) -> str:
        """The warning on ignored pixels that cover more than half of the training pixels, with the likely cause
        and its fix in ``classes.yaml``'s terms; ``absent``: the classes of no pixel, the likely owners of the
        ignored mark."""
        classes, source = self.classes, self.classes.source
        share = f"covers {_share(self.ignored, self.total)} of the training pixels"
        target = repr(classes.names[absent[0]]) if absent else "its class"
        if classes.mask_format == COLOR:
            # Colour masks have ignored pixels of ignore_color only: any other colour of no class fails the check.
            color = list(classes.ignore_color)  # type: ignore[arg-type]
            return (
                f"ignore_color {color} {share}: is {color} the colour of a class? give it to {target} in "
                f"{source}'s colors, and set ignore_color to another colour (or null)"
            )
        value = classes.ignore_index
        fix = f"map {value} to {target} in {source}'s mask_values and set ignore_index: null (or another value)"
        if not absent:
            return f"{value} is ignore_index and {share}: does {value} mark a class? {fix}"
        # Where the classes with pixels have few values, the masks likely hold just those and the ignored one
        # (0 and 255 in a binary mask): the question names them, and the fix is the whole mask_values to write.
        kept = [(v, i) for v, i in classes.mask_values if i != absent[0]]
        seen = [v for v, i in kept if self.pixels[i]]
        if len(seen) > 3:
            return f"{value} is ignore_index and {share}: is {value} the value of {target}? {fix}"
        mapping = {v: classes.names[i] for v, i in sorted([*kept, (value, absent[0])])}
        written = yaml.safe_dump(mapping, default_flow_style=True, sort_keys=False, width=1 << 20).strip()
        masks = "/".join(map(str, [*seen, value]))
        return (
            f"{value} is ignore_index and {share}: masks of {masks}? map {value} to {target} in {source}: "
            f"mask_values: {written} and ignore_index: null"
        )


def cache_dir() -> Path:
    """The folder of the mask check's cache: ``$MABN_CACHE_DIR``, else ``$XDG_CACHE_HOME/mabn`` (where that is an
    absolute path, as the XDG specification asks), else ``~/.cache/mabn``."""
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    return (Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache") / "mabn"


def _warn(message: str) -> None:
    """A warning line on stderr, once per launch: every process of a launch reads the same cache file."""
    if first_process():
        print(f"warning: {message}", file=sys.stderr, flush=True)


@dataclass
class _Known:
    """What one process knows of a cache file: the masks found clean (``MaskCache``'s entries), and whether a write
    is still worth trying (not after one failed, or where something other than a file has the cache's name)."""

    clean: dict[str, list[Any]]
    writable: bool = True


class MaskCache:
    """The masks of the dataset under ``root`` found to hold only values (colours) of ``classes``, by path below
    ``root``: each entry the file's size, modification time, inode and change time (ns) when it was decoded, then
    its pixels per class (``MaskCheck.pixels``). A later check (a fit's or a dry run's) decodes only masks that are
    new, changed or not clean, and takes the others' pixels from here. A file's change time moves with any write
    and with any setting of its times (``touch -r`` included), so a replaced mask never keeps its verdict.

    Kept in ``cache_dir()``, one file per dataset (its resolved path: every spelling of ``--data`` is one entry)
    and class table, written by the launch's first process only; and in this process too, so that one process
    (a dry run, which writes no file) decodes each mask once. A cache file that does not read as this form is
    ignored with one warning line, and one that cannot be written is one warning line: the cache only saves
    time, every mask it does not vouch for is decoded."""

    _memory: dict[Path, _Known] = {}  # by cache file

    def __init__(self, root: Path, classes: ClassTable) -> None:
        self.root, self.resolved = root, str(root.resolve())
        # What decides a mask's verdict: the values and colours, not the class names or weights or where the table
        # was read.
        verdict = {k: v for k, v in classes.as_dict().items() if k not in ("names", "source", "weights")}
        self.table = json.dumps(verdict, sort_keys=True)
        self.width = len(classes.names) + 1  # an entry's pixel counts: one per class, then the ignored pixels
        # The form of the entries is part of the name: a file of another form is another file, never read as this.
        digest = hashlib.sha256(f"{CACHE_FORM}\0{self.resolved}\0{self.table}".encode()).hexdigest()[:24]
        self.path = cache_dir() / f"mask-check-{digest}.json"
        if self.path not in self._memory:
            self._memory[self.path] = self._read()
        self.known = self._memory[self.path]
        self.clean = dict(self.known.clean)

    def _read(self) -> _Known:
        """The masks the cache file holds clean; none, with a warning line, when it does not read as written."""
        self._remove_killed_writes()
        try:
            if not self.path.is_file():
                if self.path.exists():
                    _warn(f"ignoring {self.path}: not a file; remove it to let the mask check keep its cache")
                    return _Known({}, writable=False)
                return _Known({})
            saved = json.loads(self.path.read_bytes())
        except OSError as err:
            _warn(f"ignoring {self.path}: cannot read it ({err.strerror or first_line(err)}); decoding every mask")
            return _Known({})
        except (ValueError, RecursionError):  # not UTF-8, not JSON, or nested past the parser's depth
            saved = None
        clean = saved.get("clean") if isinstance(saved, dict) else None
        if (
            not isinstance(clean, dict)
            or saved.get("root") != self.resolved
            or saved.get("classes") != self.table
            or not all(self._is_entry(entry) for entry in clean.values())
        ):
            _warn(f"ignoring {self.path}: not the mask check's cache of {self.resolved}; decoding every mask")
            return _Known({})
        return _Known(clean)

    def _remove_killed_writes(self) -> None:
        """Remove the temporary files that killed writes of this cache left (``mabn.run.files.atomic_path``)."""
        stale = time.time_ns() - STALE_TMP_NS
        for tmp in self.path.parent.glob(f".{self.path.name}.*{TMP_SUFFIX}"):
            with suppress(OSError):  # gone already, or not this user's to remove: it is ignored all the same
                if tmp.lstat().st_mtime_ns < stale:
                    tmp.unlink()

    def _key_stamp(self, path: Path) -> tuple[str, list[int]]:
        stat = path.stat()
        return path.relative_to(self.root).as_posix(), [stat.st_size, stat.st_mtime_ns, stat.st_ino, stat.st_ctime_ns]

    def _is_entry(self, entry: Any) -> bool:
        """Whether ``entry`` reads as one this cache writes: 4 integers of the file, then its pixel counts."""
        return (
            isinstance(entry, list)
            and len(entry) == 5
            and all(type(n) is int for n in entry[:4])
            and isinstance(entry[4], list)
            and len(entry[4]) == self.width
            and all(type(n) is int and n >= 0 for n in entry[4])
        )

    def pixels(self, path: Path) -> list[int] | None:
        """The pixels per class (``MaskCheck.pixels``) of the mask at ``path`` where the cache vouches for it
        (found clean, and the same file since), else None."""
        key, stamp = self._key_stamp(path)
        entry = self.clean.get(key)
        return entry[4] if entry is not None and entry[:4] == stamp else None

    def add(self, checked: Mapping[Path, list[int]], started_ns: int, save: bool) -> None:
        """Record the masks of ``checked``, decoded from ``started_ns`` (``time.time_ns``) on, as clean with their
        pixels per class, but for those changed less than ``RECENT_NS`` before; with ``save``, in the launch's
        first process, write the cache too."""
        before = dict(self.clean)
        for path, pixels in checked.items():
            key, stamp = self._key_stamp(path)
            if stamp[3] < started_ns - RECENT_NS:
                self.clean[key] = [*stamp, pixels]
        self.known.clean = self.clean
        if save and self.known.writable and first_process() and self.clean != before:
            self._write()

    def _write(self) -> None:
        text = json.dumps({"root": self.resolved, "classes": self.table, "clean": self.clean}, sort_keys=True)
        try:
            write_text_atomic(self.path, text)
        except (WriteError, OSError) as err:  # a full disk, a read-only home, a network filesystem's error
            cause = err.cause if isinstance(err, WriteError) else err.strerror or first_line(err)
            _warn(f"cannot write {self.path} ({cause}): the next check decodes these masks again")
            self.known.writable = False  # one line per process, not one per split


def _decode(paths: list[Path], classes: ClassTable) -> list[MaskCheck]:
    """``unknown_in`` of each mask: in worker processes, with progress lines on stderr, for many masks (not in a
    daemonic process, such as a DataLoader worker, which may not start processes)."""
    if len(paths) < SCAN_PARALLEL or multiprocessing.current_process().daemon:
        return [unknown_in(path, classes) for path in paths]
    found, step = [], max(1, len(paths) // SCAN_REPORTS)
    with ProcessPoolExecutor(max_workers=min(SCAN_WORKERS, os.cpu_count() or 1)) as pool:
        for done, values in enumerate(pool.map(unknown_in, paths, repeat(classes), chunksize=8), 1):
            found.append(values)
            if done % step == 0 or done == len(paths):
                print(f"checking mask values: {done}/{len(paths)} masks", file=sys.stderr, flush=True)
    return found


def _unknown_masks(
    root: Path, samples: list[Sample], classes: ClassTable, save: bool
) -> tuple[list[tuple[Path, np.ndarray]], ClassPixels]:
    """(the masks of ``samples`` (of the dataset under ``root``) that hold values (colours) of no class, in sorted
    order, with those values; the pixels per class of all of them). Masks ``MaskCache`` knows clean are not
    decoded again, their pixels are the cache's; ``save``: write the masks found clean into its file."""
    cache = MaskCache(root, classes)
    vouched = {sample.label: cache.pixels(sample.label) for sample in samples}
    todo = [path for path, pixels in vouched.items() if pixels is None]
    started_ns = time.time_ns()
    found = dict(zip(todo, _decode(todo, classes)))
    cache.add({path: check.pixels for path, check in found.items() if not check.unknown.size}, started_ns, save)
    counts = [found[path].pixels if pixels is None else pixels for path, pixels in vouched.items()]
    bad = [(path, check.unknown) for path, check in found.items() if check.unknown.size]
    return bad, ClassPixels.total_of(classes, counts)


def _unknown_line(root: Path, split: str, classes: ClassTable, bad: list[tuple[Path, np.ndarray]], total: int) -> str:
    """The line for the masks ``bad`` of the ``total`` of ``split``: the first one named with its values."""
    path, values = bad[0]
    return (
        f"mask {path} holds {classes.describe_unknown(values)}; {len(bad)} of the {total} masks in "
        f"{root / MASKS / split} hold such {classes.mask_unit}: map them to a class (or ignore them) in "
        f"{classes.source}, or correct the masks"
    )


def unknown_values(
    root: Path, split: str, samples: list[Sample], classes: ClassTable, save: bool = True
) -> tuple[str | None, ClassPixels]:
    """(the line for the masks of ``samples`` (the ``split`` of the dataset under ``root``) that hold values
    (colours) of no class: the first such mask (in sorted order), its values, and how many of the split's masks
    hold some; None when none does. The pixels per class of the masks, counted in the same pass.) ``save``: write
    the masks found clean into ``MaskCache``'s file."""
    bad, pixels = _unknown_masks(root, samples, classes, save)
    return (_unknown_line(root, split, classes, bad, len(samples)) if bad else None), pixels


class DatasetCheck(NamedTuple):
    """What ``check_dataset`` finds in a dataset that passes: the (width, height) of each training image, and the
    pixels per class of the training masks."""

    sizes: list[tuple[int, int]]
    pixels: ClassPixels


def check_dataset(args: Mapping[str, Any]) -> DatasetCheck:
    """Check the dataset of the data module arguments ``args`` (``data_dir``, the splits, ``global_batch_size``)
    as a dry run does, and return the training images' sizes and the training masks' pixels per class:
    ``classes.yaml``, then for both splits the layout and the pairs (``index_split``), the sizes from the headers
    (``_sizes``) and every mask's values, counting its pixels per class in the same pass (``unknown_values``: read
    from the cache a fit wrote, not written; the masks whose headers read), and that the training pairs fill one
    global batch. ``DatasetErrors`` with one line per problem found, all of them."""
    root = Path(args["data_dir"])
    classes = ClassTable.read(root / CLASSES_FILE)
    problems: list[str] = []
    train_split = args.get("train_split") or "train"
    train_sizes: list[tuple[int, int]] = []
    for split in dict.fromkeys((train_split, args.get("val_split") or "val")):  # one split may serve both
        samples, found = index_split(root, split)
        sizes, bad_sizes = _sizes(samples, root / IMAGES / split)
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


def train_transform(
    crop_size: int = 713,
    scale_range: tuple[float, float] = (0.5, 2.0),
    rotate_limit: float = 10.0,
    blur_p: float = 0.5,
    seed: int | None = None,
) -> A.Compose:
    """The hszhao/semseg PSPNet training augmentation (before normalization), in its order.

    Random scale in ``scale_range`` (image bilinear, mask nearest) -> rotation within +-``rotate_limit``
    degrees with p 0.5 (image padded with the mean pixel, mask with 255) -> 5x5 Gaussian blur with p
    ``blur_p`` -> horizontal flip -> centred pad to ``crop_size`` (mean / 255) -> random ``crop_size`` crop.

    The default crop is the paper's (and hszhao's) 713: PSPNet takes any input size (its encoder at output
    stride 8 gives 90x90 features for 713, and both heads upsample to the input size).
    """
    low, high = scale_range
    return A.Compose(
        [
            # RandomScale samples from 1 + scale_limit.
            A.RandomScale(
                scale_limit=(low - 1.0, high - 1.0),
                interpolation=cv2.INTER_LINEAR,
                mask_interpolation=cv2.INTER_NEAREST,
                p=1.0,
            ),
            A.Rotate(
                limit=(-rotate_limit, rotate_limit),
                interpolation=cv2.INTER_LINEAR,
                mask_interpolation=cv2.INTER_NEAREST,
                border_mode=cv2.BORDER_CONSTANT,
                fill=MEAN_PIXEL,
                fill_mask=IGNORE_INDEX,
                p=0.5,
            ),
            # hszhao calls cv2.GaussianBlur(img, (5, 5), 0); OpenCV derives sigma 1.1 for a 5-tap kernel.
            A.GaussianBlur(blur_limit=(5, 5), sigma_limit=(1.1, 1.1), p=blur_p),
            A.HorizontalFlip(p=0.5),
            A.PadIfNeeded(
                min_height=crop_size,
                min_width=crop_size,
                position="center",
                border_mode=cv2.BORDER_CONSTANT,
                fill=MEAN_PIXEL,
                fill_mask=IGNORE_INDEX,
            ),
            A.RandomCrop(height=crop_size, width=crop_size),
        ],
        seed=seed,
    )


class FolderDataset(Dataset):
    """The ``split`` of a segmentation dataset under ``root``, yielding normalized images and class maps: the base
    of every segmentation dataset, in the layout of this module. A dataset of another layout names it on top
    (``mabn.data.cityscapes``): its pairing (``find_pairs``), what its messages call a mask (``mask_term``,
    ``mask_expected``), whether indexing reads the sizes (``index_sizes``) and how its mask values map to classes
    (``class_map``).

    Items are ``(image, label)``: a float32 tensor 3xHxW normalized with the ImageNet mean/std and an int64 tensor
    HxW of class indices with ``IGNORE_INDEX`` (255) for ignored pixels, the mask values (or colours) mapped to
    classes by ``classes`` (``ClassTable.classes_of``). ``transform`` is an albumentations-style callable applied to
    ``image=`` (uint8 HxWx3 RGB) and ``mask=`` (uint8 class map) before normalization, e.g. :func:`train_transform`;
    ``None`` keeps the full image. ``samples[i]`` names the files of item ``i``; ``sizes[i]`` is its (width,
    height), read from the headers when the split is indexed (None where ``index_sizes`` is off).
    """

    image_folder = IMAGES  # the folder of the images below the root, which holds the split folders
    mask_term, mask_expected = MASK_TERM, MASK_EXPECTED
    # Where ``python -m mabn predict`` writes a frame's mask in the dataset's values, below its output folder, and
    # what a split's predictions are scored with there ("" where the dataset names no scorer).
    prediction_masks = MASKS
    prediction_scorer = ""
    # Whether indexing a split reads every pair's size from the headers, so that a mask of another size than its
    # image is named before the first step (its pair is checked when it is read either way).
    index_sizes = True

    def __init__(
        self,
        root: str | Path,
        split: str,
        classes: ClassTable,
        transform: A.BasicTransform | A.Compose | None = None,
    ) -> None:
        self.root, self.split, self.classes, self.transform = Path(root), split, classes, transform
        self.samples = self.find_pairs(self.root, split)
        self.sizes: list[tuple[int, int]] | None = None
        if self.index_sizes:
            self.sizes = self.image_sizes()
        self._normalize = imagenet_normalize()

    @staticmethod
    def find_pairs(root: Path, split: str) -> list[Sample]:
        """The image/mask pairs of ``split`` under ``root`` in sorted order; ``DatasetError`` for the first problem
        of the layout."""
        return find_pairs(root, split)

    @classmethod
    def split_images(cls, root: Path, split: str) -> list[Path]:
        """What ``predict --split`` predicts of ``split`` under ``root``: folders or image files (the split's folder
        of images, searched recursively)."""
        return [root / cls.image_folder / split]

    @staticmethod
    def frame_name(image: Path) -> str:
        """The frame an image file holds, which names its prediction files: the file's stem."""
        return image.stem

    @classmethod
    def mask_file(cls, frame: str) -> Path:
        """The mask prediction of ``frame`` below the output folder, as the dataset's own masks are named."""
        return Path(cls.prediction_masks, f"{frame}{MASK_TYPE}")

    def image_sizes(self) -> list[tuple[int, int]]:
        """``sizes``, read from the headers now where indexing did not read them; ``DatasetError`` for an unreadable
        file or a mask of another size than its image (``pair_sizes``)."""
        if self.sizes is not None:
            return self.sizes
        return pair_sizes(self.samples, self.root / self.image_folder / self.split)

    @property
    def class_names(self) -> tuple[str, ...]:
        """The classes' names in index order: what a task evaluating this dataset names in its tables."""
        return self.classes.names

    def __len__(self) -> int:
        return len(self.samples)

    def read_pair(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """The raw item: uint8 RGB image HxWx3 and uint8 class map HxW, checked to have the same size."""
        sample = self.samples[index]
        image = read_image(sample.image)
        mask = read_mask(sample.label, self.classes, self.mask_term, self.mask_expected)
        if image.shape[:2] != mask.shape[:2]:  # sizes not indexed, or the files changed since
            (ih, iw), (mh, mw) = image.shape[:2], mask.shape[:2]
            raise DatasetError(
                f"size mismatch: image {sample.image} is {iw}x{ih} but {self.mask_term} {sample.label} is "
                f"{mw}x{mh} (WxH)"
            )
        return image, self.class_map(mask, sample.label)

    def class_map(self, mask: np.ndarray, path: Path) -> np.ndarray:
        """The uint8 class map of the mask read from ``path`` (``ClassTable.classes_of``); a value (colour) of no
        class is an error naming the file (``unknown_values``)."""
        classes, unknown = self.classes.classes_of(mask)
        if unknown.size:
            raise self.unknown_values(path, unknown)
        return classes

    def unknown_values(self, path: Path, values: np.ndarray) -> DatasetError:
        """The error for the values (colours) ``values`` of no class that the mask at ``path`` holds, naming it
        first, with how many of the split's masks hold such values (a scan of the others, on this error only:
        ``FolderDataModule`` scans before a fit, so this is met by files changed since, or by a mask its cache
        vouched for)."""
        scanned = _unknown_masks(self.root, self.samples, self.classes, save=False)[0]
        others = [bad for bad in scanned if bad[0] != path]
        bad = [(path, values), *others]
        return DatasetError(_unknown_line(self.root, self.split, self.classes, bad, len(self.samples)))

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        image, label = self.read_pair(index)
        if self.transform is not None:
            out = self.transform(image=image, mask=label)
            image, label = out["image"], out["mask"]
        image = self._normalize(image=image)["image"]
        return torch.from_numpy(np.ascontiguousarray(image.transpose(2, 0, 1))), torch.from_numpy(
            label.astype(np.int64)
        )


class FolderDataModule(pl.LightningDataModule):
    """Stage 2's data: the train and val splits of a segmentation dataset under ``data_dir``, with the hszhao/semseg
    PSPNet recipe; the base of every segmentation data module, in the layout of this module (a dataset of one's
    own). A dataset of another layout names it on top (``mabn.data.cityscapes``): its dataset (``dataset``), its
    classes where it fixes them (``fixed_classes``), its default crop and its dry-run plan.

    Training batches are ``batch_size`` (per device) random ``crop_size`` crops (``train_transform``); with
    ``global_batch_size`` the per-device batch is its share instead, by the rule of ``mabn.run.scaling.device_batch``
    with the model's normalization batch. The train loader shuffles and drops the last partial batch so every batch
    splits into whole ghost batches. Validation yields full, untransformed images (``val_batch_size`` 1 by default)
    for sliding-window evaluation.

    The classes come from ``data_dir/classes.yaml``: ``num_classes`` (linked to the model's) and ``class_names``
    (the validation tables) are read from it when the module is made. The crop is ``crop_size``, or where that is
    null one from the training images' sizes (``data_crop``), decided when the module is set up; smaller training
    images are padded up to it, and a fit says how many are (``small_images``, as ``--dry-run`` does). The class
    table and the crop are kept in the module's hyperparameters (``classes``, ``crop_size``), which Lightning writes
    into every checkpoint: what ``python -m mabn test`` and ``predict`` read. ``class_pixels``: the training split's
    pixels per class (``ClassPixels``), counted by the check of its masks when the module is set up for a fit (None
    before, and for classes a dataset fixes, whose masks are not checked).

    Args:
        data_dir: the dataset's folder, which holds ``classes.yaml``, ``images/<split>/`` and ``masks/<split>/``
            (docs/your-data.md).
        crop_size: the side in pixels of the square random training crops; null (configs/segment.yaml): from the
            data, the recipe's 713 where the median training image's shorter side holds it, else the largest
            multiple of 8 within that side. Smaller images are padded up to it.
        batch_size: training crops per device and step (replaced by the share of ``global_batch_size`` if set).
        val_batch_size: full images per device and validation step.
        num_workers: data loading processes per device; 0: load in the training process; null: the cores
            shared by the node's devices, at most 8 (``mabn.data.loading.default_workers``).
        scale_range: the lowest and highest factor of the random training rescale, before the crop.
        rotate_limit: the largest random training rotation, in degrees either way (applied with p 0.5).
        blur_p: the probability of a 5x5 Gaussian blur of a training image.
        train_split: the split folder trained on, below the image and mask folders (``images/`` and ``masks/``;
            Cityscapes: ``leftImg8bit/`` and ``gtFine/``).
        val_split: the split folder validated on, below the image and mask folders.
        global_batch_size: the largest training batch over all devices: each device takes its share, in whole
            normalization batches (never under one); null: ``batch_size`` per device.
    """

    # The classes a dataset defines itself, whose masks hold only their values or ignored ones (Cityscapes'); None:
    # those of the data folder's classes.yaml, which the checkpoints record and whose masks are checked for values
    # of no class before a fit.
    fixed_classes: ClassTable | None = None
    # The dataset of its layout: what ``full_dataset`` makes, and what inference reads a split and names frames by.
    dataset_class: type[FolderDataset] = FolderDataset
    layout = DataLayout(
        (IMAGES, MASKS),
        "No dataset given (DATA=...): expected images/<split>/*, masks/<split>/*.png and classes.yaml\n"
        "(docs/your-data.md). Running the demo profile on the generated example (configs/demo/cityscapes.yaml).",
        "segment",
        files=(CLASSES_FILE,),
    )
    # Init arguments that change how a run reads its data, not what it trains on (mabn.cli.lightning.run_settings).
    run_settings = frozenset({"num_workers", "val_batch_size"})
    class_pixels: ClassPixels | None = None

    def __init__(
        self,
        data_dir: str,
        crop_size: int | None = None,
        batch_size: int = 2,
        val_batch_size: int = 1,
        num_workers: int | None = None,
        scale_range: tuple[float, float] = (0.5, 2.0),
        rotate_limit: float = 10.0,
        blur_p: float = 0.5,
        train_split: str = "train",
        val_split: str = "val",
        global_batch_size: int | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.data_dir = data_dir
        self.crop_size = crop_size
        self.batch_size = batch_size
        self.val_batch_size = val_batch_size
        self.num_workers = num_workers
        self.scale_range = scale_range
        self.rotate_limit = rotate_limit
        self.blur_p = blur_p
        self.train_split = train_split
        self.val_split = val_split
        self.global_batch_size = global_batch_size
        self.train_set: FolderDataset | None = None
        self.val_set: FolderDataset | None = None

    @cached_property
    def classes(self) -> ClassTable:
        return self.fixed_classes or ClassTable.read(Path(self.data_dir) / CLASSES_FILE)

    @property
    def num_classes(self) -> int:
        return len(self.classes.names)

    @property
    def class_names(self) -> tuple[str, ...]:
        return self.classes.names

    @classmethod
    def recorded_classes(cls, hparams: Mapping[str, Any]) -> ClassTable | None:
        """The classes of a model trained on this module with hyperparameters ``hparams`` (a checkpoint's): the
        fixed ones, else the table ``setup`` recorded; None where it records none."""
        if cls.fixed_classes is not None:
            return cls.fixed_classes
        return ClassTable.from_dict(hparams["classes"]) if "classes" in hparams else None

    @classmethod
    def full_dataset(cls, root: str | Path, split: str, classes: ClassTable) -> FolderDataset:
        """The full images and labels of ``split`` under ``root`` with ``classes``: what validation, ``test`` and
        ``predict --split`` read."""
        return cls.dataset_class(root, split, classes=classes)

    def dataset(self, split: str) -> FolderDataset:
        """The full-image dataset of ``split``."""
        return self.full_dataset(self.data_dir, split, self.classes)

    def setup(self, stage: str | None = None) -> None:
        """Index the splits the stage needs; raises ``DatasetError`` if the layout is missing or broken."""
        if self.fixed_classes is None:
            self.hparams["classes"] = self.classes.as_dict()
        if self.crop_size is None:  # from the data, and so into the checkpoints, which test and predict read
            self.crop_size, line = data_crop(self.dataset(self.train_split).image_sizes(), None)
            self.hparams["crop_size"] = self.crop_size
            say(line)
        world = self.trainer.world_size if self.trainer is not None else 1
        module = self.trainer.lightning_module if self.trainer is not None else None
        norm_batch = module.hparams.get("norm_batch_size") if module is not None else None
        self.batch_size = per_device_batch(self.batch_size, self.global_batch_size, world, norm_batch)
        if stage in (None, "fit"):
            self.train_set = self.make_dataset(self.train_split, train=True)
        if stage in (None, "fit", "validate"):
            self.val_set = self.make_dataset(self.val_split, train=False)

    def make_dataset(self, split: str, train: bool) -> FolderDataset:
        """The dataset of ``split``: with the training augmentation (``train_transform`` at ``crop_size``) when
        ``train``, full images otherwise."""
        dataset = self.dataset(split)
        if self.fixed_classes is None:
            # Every mask's values before the first step, not at the mask's first read hours in; the masks found
            # clean go into the cache, so the next fit (a resume, a rerun) and dry run decode only new or changed
            # ones.
            problem, pixels = unknown_values(dataset.root, split, dataset.samples, self.classes)
            if problem:
                raise DatasetError(problem)
            if train:
                self.class_pixels = pixels  # what class_weights=counts weighs the classes by (mabn.tasks.losses)
        if train:
            if dataset.sizes is not None:
                count, line = small_images(dataset.sizes, self.crop_size)
                if count:  # a fit speaks of padding only where there is some; a dry run always says the count
                    say(line)
            dataset.transform = self.augmentation()
        return dataset

    def augmentation(self) -> A.Compose:
        """``train_transform`` with this module's settings; the training loader seeds it for each sample
        (``mabn.data.loading.TrainingSampler``)."""
        return train_transform(self.crop_size, self.scale_range, self.rotate_limit, self.blur_p)

    @staticmethod
    def plan(args: Mapping[str, Any]) -> DataPlan:
        """``--dry-run``'s plan once the whole dataset passed ``check_dataset``, before the plan's own count of
        batches, so that too few training images for the global batch is said with the dataset's other problems
        and its fix: the size of the training split, the crop and why (``data_crop``), how many of its images are
        smaller than the crop (``small_images``), the share of each class in the training pixels with warnings on
        classes of none and on ignored pixels of more than half (``ClassPixels.lines``), and how images of other
        modes than 8-bit RGB or of an EXIF orientation are read (``reading_lines``)."""
        sizes, pixels = check_dataset(args)
        crop, crop_line = data_crop(sizes, args.get("crop_size"))
        lines = [crop_line, small_images(sizes, crop)[1], *pixels.lines(), *reading_lines(args)]
        return DataPlan(len(sizes), lines, crop, pixels)

    def _loader(self, dataset: FolderDataset | None, batch_size: int, train: bool) -> DataLoader:
        if dataset is None:
            raise RuntimeError("call setup() before asking for a dataloader")
        return make_loader(dataset, batch_size, train, self.num_workers, node_devices(self.trainer))

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, self.batch_size, train=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, self.val_batch_size, train=False)
