"""The masks' values: reading a mask, checking every value is a class's or ignored while counting the pixels per
class (``unknown_values``), in worker processes for many masks, with the verdicts kept in a cache file of the
user's cache directory (``MaskCache``: never in the data folder), so that later dry runs and fits decode only new
or changed masks; and the classes' shares of the training pixels that a dry run prints (``ClassPixels``)."""

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
from itertools import repeat
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import yaml

from ..distributed import first_process
from ..errors import WriteError
from ..run import TMP_SUFFIX, first_line, write_text_atomic
from .classes import COLOR, IGNORE_INDEX, ClassTable
from .errors import DatasetError
from .images import (
    read_values,
)
from .pairs import MASK_EXPECTED, MASK_TERM, MASKS, Sample

CACHE_DIR_ENV = "MABN_CACHE_DIR"  # the variable naming the folder of the mask check's cache (``cache_dir``)
CACHE_FORM = 2  # the form of the cache's entries (``MaskCache``): the file's stamp, then its pixels per class
SCAN_PARALLEL = 64  # masks: fewer are decoded in this process, where a pool's start would cost more than it saves
SCAN_WORKERS = 4  # decoding processes: a few, since the other cores may be a fit's or another user's
SCAN_REPORTS = 10  # progress lines on stderr in a parallel scan
# A file's change time moves in ticks (up to 2 s on some filesystems): a mask changed within a tick of its decode
# could keep its stamp, so masks changed this shortly before a scan are not recorded clean.
RECENT_NS = 2_000_000_000
# A cache write lasts milliseconds: its temporary file this old is a killed write's, a younger one may be another
# process's write in progress.
STALE_TMP_NS = 60 * 10**9


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


def unknown_masks(
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


def unknown_line(root: Path, split: str, classes: ClassTable, bad: list[tuple[Path, np.ndarray]], total: int) -> str:
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
    bad, pixels = unknown_masks(root, samples, classes, save)
    return (unknown_line(root, split, classes, bad, len(samples)) if bad else None), pixels
