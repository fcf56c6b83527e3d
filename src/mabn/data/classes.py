"""The classes of a segmentation dataset: names, colours, and how mask values map to class indices.

A dataset of the user's own (``mabn.data.folder``) describes its classes in ``classes.yaml``::

    classes: [background, road, car]   # required: the names, in class-index order (at most 255)
    colors: [[0, 0, 0], [128, 64, 128], [0, 0, 142]]   # optional: [R, G, B] per class (default: PASCAL VOC's)
    ignore_index: 255                  # optional: the mask value of unlabelled pixels (default 255; null: none)
    mask_values: {0: background, 7: road, 26: car}   # optional: mask value -> class (name or index);
                                                     # default: value i is class i
    mask_format: index                 # optional: index (one value per pixel, the default) or color
    weights: [0.5, 1.0, 4.0]           # optional: a weight in [1e-6, 1e6] per class, for the loss
                                       # (mabn.tasks.losses)

The file is UTF-8. A class name is printable text (``str.isprintable``: no line break, tab or terminal escape
code) without ``|``, of at most 64 characters: the names are printed as they are in the validation table (a
markdown table, whose cells ``|`` would split) and in the logs, where a line break could forge a line of its own
(``error: ...``) and an escape code could rewrite the terminal.

Several mask values may map to one class; every class needs at least one (``predict`` writes the smallest).
With ``mask_format: color`` a mask is an RGB image and each pixel's colour is the class of that colour in
``colors`` (so the colours must differ); ``ignore_color: [R, G, B]`` (colour masks only, default none) is the
colour of unlabelled pixels, and ``mask_values`` and ``ignore_index`` do not apply.
Inside the product a class is its index 0..K-1 and an ignored pixel is 255 (``IGNORE_INDEX``), whatever the
file says, so the loss, the metrics and the sliding-window evaluation are those of Cityscapes. A mask value that
is neither a class's nor ignored (a colour neither a class's nor ``ignore_color``) is an error (``FolderDataset``
names the file).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from .errors import DatasetError

__all__ = [
    "CLASSES_FILE",
    "COLOR",
    "IGNORE_INDEX",
    "INDEX",
    "WEIGHT_RANGE",
    "ClassTable",
    "color_codes",
    "voc_palette",
    "weight_out_of_range",
]

# The class index of an ignored pixel inside the product, whatever dataset it comes from: the loss, the metrics,
# the augmentation's padding and the sliding-window evaluation leave it out.
IGNORE_INDEX = 255
CLASSES_FILE = "classes.yaml"
KEYS = ("classes", "colors", "ignore_index", "mask_values", "mask_format", "ignore_color", "weights")
INDEX, COLOR = "index", "color"  # the mask formats: one value per pixel, or one colour per pixel
MAX_CLASSES = IGNORE_INDEX  # class indices 0..254: 255 is the ignored pixel inside the product
# Class weights are relative, and the loss sums them over a batch's pixels in float32 (largest 3.4e38): 1e308 is
# infinite there and 1e-300 zero (a batch of that class alone divides 0 by 0); within this range a batch of 2^31
# pixels sums to at most 2e15.
WEIGHT_RANGE = (1e-6, 1e6)


def weight_out_of_range(weights: list[float] | tuple[float, ...]) -> str | None:
    """The refusal's words for the first of ``weights`` (numbers > 0) outside ``WEIGHT_RANGE``; None where all fit."""
    low, high = WEIGHT_RANGE
    outside = [w for w in weights if not low <= w <= high]
    if not outside:
        return None
    return (
        f"{outside[0]!r} is outside [{low:g}, {high:g}]: class weights are relative, summed over a batch's pixels "
        f"in float32; divide them all by one number to bring them into it"
    )


MAX_MASK_VALUE = 65535  # a 16-bit PNG's largest value
MAX_NAME_CHARS = 64  # a class name's length: a row of the validation table, a legend entry of a logged mask
_UNKNOWN = -1  # in the lookup table: a mask value of no class, not ignored


def voc_palette(count: int) -> list[tuple[int, int, int]]:
    """The PASCAL VOC colour map's first ``count`` colours (class 0 black), the default colours of a class table."""
    colors = []
    for index in range(count):
        r = g = b = 0
        c = index
        for bit in range(8):
            r |= (c & 1) << (7 - bit)
            g |= ((c >> 1) & 1) << (7 - bit)
            b |= ((c >> 2) & 1) << (7 - bit)
            c >>= 3
        colors.append((r, g, b))
    return colors


def _number_text(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_color(value: Any) -> bool:
    return isinstance(value, list) and len(value) == 3 and all(_is_int(v) and 0 <= v <= 255 for v in value)


def _name_problem(name: str) -> str | None:
    """Why ``name`` cannot be a class name (see the module's docstring), or None when it can."""
    unprintable = next((c for c in name if not c.isprintable()), None)
    if unprintable is not None:
        return f"holds {unprintable!r}, which is not printable"
    if "|" in name:
        return "holds '|', which splits a row of the validation table"
    if len(name) > MAX_NAME_CHARS:
        return f"has {len(name)} characters"
    return None


def _yaml_problem(err: yaml.YAMLError) -> str:
    """YAML's complaint in one line, with where it is."""
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    mark = getattr(err, "problem_mark", None)
    return f"{problem} (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else problem


def _values_text(values: list[int]) -> str:
    """``0..7`` for a run of values, else the values (the first 8)."""
    if len(values) > 2 and values == list(range(values[0], values[-1] + 1)):
        return f"{values[0]}..{values[-1]}"
    shown = ", ".join(map(str, values[:8]))
    return shown + (", ..." if len(values) > 8 else "")


def color_codes(rgb: np.ndarray) -> np.ndarray:
    """One integer per colour (``0xRRGGBB``) of an ... x 3 array, so that colours compare and sort as numbers."""
    rgb = np.asarray(rgb, dtype=np.uint32)
    return (rgb[..., 0] << 16) | (rgb[..., 1] << 8) | rgb[..., 2]


def _color_text(code: int) -> str:
    return f"[{code >> 16}, {(code >> 8) & 255}, {code & 255}]"


@dataclass(frozen=True)
class ClassTable:
    """The classes of a dataset: ``names`` in class-index order, a colour per class, the mask value of unlabelled
    pixels (``ignore_index``, or None) and the (mask value, class index) pairs, sorted by value; ``mask_format``:
    whether masks hold those values (``index``) or the class colours (``color``, unlabelled pixels in
    ``ignore_color``, or None). ``source`` names where it came from, for messages. ``weights``: a weight per class
    for the training loss, or None where the file gives none."""

    names: tuple[str, ...]
    colors: tuple[tuple[int, int, int], ...]
    ignore_index: int | None
    mask_values: tuple[tuple[int, int], ...]
    source: str = CLASSES_FILE
    mask_format: str = INDEX
    ignore_color: tuple[int, int, int] | None = None
    weights: tuple[float, ...] | None = None

    @classmethod
    def read(cls, path: str | Path) -> ClassTable:
        """The table of a ``classes.yaml``; a ``DatasetError`` naming the file when it cannot be read or parsed."""
        path = Path(path)
        try:
            data = path.read_bytes()
        except OSError as err:
            raise DatasetError(f"cannot read classes file {path}: {err.strerror or err}") from err
        try:
            text = data.decode("utf-8")  # whatever the locale says: the file is the same on every machine
        except UnicodeDecodeError as err:
            raise DatasetError(
                f"classes file {path} is not UTF-8 text: byte 0x{data[err.start]:02x} at offset {err.start}; "
                "save it as UTF-8"
            ) from None
        try:
            raw = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise DatasetError(f"classes file {path} is not valid YAML: {_yaml_problem(err)}") from err
        return cls.parse(raw, str(path))

    @classmethod
    def parse(cls, raw: Any, source: str = CLASSES_FILE) -> ClassTable:
        """The table of a parsed ``classes.yaml`` (see the module's docstring); ``DatasetError`` naming ``source``.
        A table of one class is refused after every other check: every pixel of one class leaves nothing to learn,
        and a mean over one class's IoU is no table."""
        table = cls._parse(raw, source)
        if len(table.names) < 2:
            raise DatasetError(
                f"classes file {source}: 1 class ({table.names[0]!r}): a segmentation needs at least 2 classes, "
                f"e.g. classes: [background, {table.names[0]}]"
            )
        return table

    @classmethod
    def _parse(cls, raw: Any, source: str) -> ClassTable:
        def bad(why: str) -> DatasetError:
            return DatasetError(f"classes file {source}: {why}")

        if not isinstance(raw, Mapping) or "classes" not in raw:
            raise bad("expected a mapping with the class names, e.g. classes: [background, road, car]")
        unknown = [key for key in raw if key not in KEYS]
        if unknown:
            raise bad(f"unknown key {unknown[0]!r} (the keys are {', '.join(KEYS)})")
        names = raw["classes"]
        if not isinstance(names, list) or not names or not all(isinstance(n, str) and n.strip() for n in names):
            raise bad(f"classes must be a list of class names (text), e.g. [background, road, car]; got {names!r}")
        for index, name in enumerate(names):
            problem = _name_problem(name)
            if problem is not None:
                # repr, cut: the name itself may be a line break or an escape code, or 20,000 characters long.
                shown = repr(name[:MAX_NAME_CHARS]) + ("..." if len(name) > MAX_NAME_CHARS else "")
                raise bad(
                    f"class {index} {shown} {problem}; a class name is printable text without '|', "
                    f"at most {MAX_NAME_CHARS} characters"
                )
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise bad(f"class {repeated[0]!r} is named twice")
        if len(names) > MAX_CLASSES:
            raise bad(f"{len(names)} classes: at most {MAX_CLASSES}")
        count = len(names)
        mask_format = raw.get("mask_format", INDEX)
        if mask_format not in (INDEX, COLOR):
            raise bad(f"mask_format={mask_format!r}: {INDEX} (a value per pixel) or {COLOR} (an RGB colour per pixel)")

        colors = raw.get("colors")
        if colors is None:
            colors = voc_palette(count)
        elif not (isinstance(colors, list) and len(colors) == count and all(_is_color(c) for c in colors)):
            raise bad(f"colors must hold one [R, G, B] (each 0..255) per class, {count} in all; got {colors!r}")
        weights = raw.get("weights")
        # PyYAML (YAML 1.1) reads a number with an exponent only with a dot and a signed exponent: 1e-3 is text.
        text = [w for w in weights if isinstance(w, str) and _number_text(w)] if isinstance(weights, list) else []
        if text:
            raise bad(
                f"weights: YAML reads {text[0]!r} as text, not a number (it takes an exponent only after a dot and "
                f"with a sign, 1.0e-3): write {float(text[0])!r}"
            )
        if weights is not None and not (
            isinstance(weights, list)
            and len(weights) == count
            and all(isinstance(w, (int, float)) and not isinstance(w, bool) and 0 < w < math.inf for w in weights)
        ):
            raise bad(f"weights must hold one number > 0 per class, {count} in all; got {weights!r}")
        if weights is not None and (why := weight_out_of_range(weights)):
            raise bad(f"weights: {why}")
        if mask_format == COLOR:
            table = cls._parse_color(raw, names, colors, bad, source)
            return table if weights is None else replace(table, weights=tuple(map(float, weights)))
        if "ignore_color" in raw:
            raise bad(f"ignore_color applies to colour masks (mask_format: {COLOR}); index masks use ignore_index")

        ignore = raw.get("ignore_index", IGNORE_INDEX)
        if ignore is not None and not (_is_int(ignore) and 0 <= ignore <= MAX_MASK_VALUE):
            raise bad(f"ignore_index={ignore!r}: a mask value 0..{MAX_MASK_VALUE}, or null (no pixel is ignored)")

        given = raw.get("mask_values")
        if given is None:
            if ignore is not None and ignore < count:
                raise bad(
                    f"ignore_index {ignore} is also the mask value of class {names[ignore]!r} (without mask_values, "
                    "value i is class i): give mask_values, or another ignore_index"
                )
            pairs = [(index, index) for index in range(count)]
        else:
            if not isinstance(given, Mapping) or not given:
                raise bad(f"mask_values must map mask values to classes, e.g. {{0: sky, 7: road}}; got {given!r}")
            pairs = []
            for value, target in given.items():
                value = int(value) if isinstance(value, str) and value.isdigit() else value  # "7": 7
                if not (_is_int(value) and 0 <= value <= MAX_MASK_VALUE):
                    raise bad(f"mask_values: {value!r} is not a mask value (0..{MAX_MASK_VALUE})")
                if value == ignore:
                    raise bad(f"mask_values: {value} is also the ignore_index")
                if isinstance(target, str) and target in names:
                    pairs.append((value, names.index(target)))
                elif _is_int(target) and 0 <= target < count:
                    pairs.append((value, target))
                else:
                    raise bad(f"mask_values: {value} maps to {target!r}, not a class name or index 0..{count - 1}")
            missing = [names[i] for i in range(count) if i not in {index for _, index in pairs}]
            if missing:
                raise bad(f"class {missing[0]!r} has no mask value in mask_values")
        return cls(
            tuple(names),
            tuple(tuple(c) for c in colors),
            ignore,
            tuple(sorted(pairs)),
            source,  # type: ignore[misc]
            weights=None if weights is None else tuple(map(float, weights)),
        )

    @classmethod
    def _parse_color(
        cls,
        raw: Mapping[str, Any],
        names: list[str],
        colors: list[Any],
        bad: Callable[[str], DatasetError],
        source: str,
    ) -> ClassTable:
        """The table of colour masks: each pixel's colour is its class's (or ``ignore_color``), so no two share one."""
        for key in ("mask_values", "ignore_index"):
            if key in raw:
                raise bad(f"{key} applies to index masks; with mask_format: {COLOR} give ignore_color: [R, G, B]")
        ignore = raw.get("ignore_color")
        if ignore is not None and not _is_color(ignore):
            raise bad(f"ignore_color must be one [R, G, B] (each 0..255), or null; got {ignore!r}")
        seen: dict[tuple[int, ...], str] = {}
        for name, color in [*zip(names, colors), *([("ignore_color", ignore)] if ignore is not None else [])]:
            if tuple(color) in seen:
                raise bad(f"{list(color)} is the colour of both {seen[tuple(color)]!r} and {name!r}")
            seen[tuple(color)] = name
        return cls(
            tuple(names),
            tuple(tuple(c) for c in colors),  # type: ignore[misc]
            None,
            tuple((index, index) for index in range(len(names))),
            source,
            COLOR,
            None if ignore is None else tuple(ignore),  # type: ignore[arg-type]
        )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ClassTable:
        """The table ``as_dict`` wrote (into a checkpoint's data module hyperparameters)."""
        return cls(
            tuple(data["names"]),
            tuple(tuple(c) for c in data["colors"]),
            data["ignore_index"],
            tuple(sorted((int(v), int(c)) for v, c in data["mask_values"].items())),
            data.get("source", CLASSES_FILE),
            data.get("mask_format", INDEX),
            None if data.get("ignore_color") is None else tuple(data["ignore_color"]),
            None if data.get("weights") is None else tuple(data["weights"]),
        )

    def as_dict(self) -> dict[str, Any]:
        """Plain values (a checkpoint is read weights-only): names, colors, ignore_index, mask_values, source,
        mask_format, ignore_color, weights."""
        return {
            "names": list(self.names),
            "colors": [list(c) for c in self.colors],
            "ignore_index": self.ignore_index,
            "mask_values": dict(self.mask_values),
            "source": self.source,
            "mask_format": self.mask_format,
            "ignore_color": None if self.ignore_color is None else list(self.ignore_color),
            "weights": None if self.weights is None else list(self.weights),
        }

    @property
    def palette(self) -> np.ndarray:
        """The colours as a K x 3 uint8 array: ``palette[class_map]`` is the colour image of a class map."""
        return np.asarray(self.colors, dtype=np.uint8).reshape(len(self.names), 3)

    @cached_property
    def class_values(self) -> np.ndarray:
        """The mask value of each class (the smallest that maps to it): ``class_values[class_map]`` is a mask in
        the dataset's own values, uint8 when they fit, else uint16."""
        values = np.zeros(len(self.names), dtype=np.int64)
        for value, index in reversed(self.mask_values):
            values[index] = value
        return values.astype(np.uint8 if values.max() <= 255 else np.uint16)

    def to_mask(self, class_map: np.ndarray) -> np.ndarray:
        """A class map as the dataset's masks hold it: its mask values (``class_values``), or its colours."""
        return self.palette[class_map] if self.mask_format == COLOR else self.class_values[class_map]

    @cached_property
    def _color_lookup(self) -> tuple[np.ndarray, np.ndarray]:
        """(the codes of the class colours and ``ignore_color``, sorted; the class index of each, ``IGNORE_INDEX``
        for ``ignore_color``), for ``np.searchsorted``."""
        colors, index = list(self.colors), list(range(len(self.names)))
        if self.ignore_color is not None:
            colors.append(self.ignore_color)
            index.append(IGNORE_INDEX)
        codes = color_codes(np.asarray(colors))
        order = np.argsort(codes)
        return codes[order], np.asarray(index, dtype=np.uint8)[order]

    @cached_property
    def _lookup(self) -> np.ndarray:
        lut = np.full(MAX_MASK_VALUE + 1, _UNKNOWN, dtype=np.int16)
        for value, index in self.mask_values:
            lut[value] = index
        if self.ignore_index is not None:
            lut[self.ignore_index] = IGNORE_INDEX
        return lut

    def classes_of(self, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(the uint8 class map of ``mask``, with ignored pixels ``IGNORE_INDEX``; the sorted mask values that are
        neither a class's nor ignored, empty when there is none). Those pixels are ``IGNORE_INDEX`` in the map.
        With colour masks ``mask`` is H x W x 3 and the unknown values are colour codes (``color_codes``)."""
        mask = np.asarray(mask)
        if self.mask_format == COLOR:
            return self._classes_of_colors(mask)
        if mask.dtype == np.bool_:
            mask = mask.astype(np.uint8)
        if not np.issubdtype(mask.dtype, np.integer):
            raise TypeError(f"mask values must be integers, got dtype {mask.dtype}")
        if mask.dtype in (np.uint8, np.uint16):
            mapped = self._lookup[mask]
        else:
            inside = (mask >= 0) & (mask <= MAX_MASK_VALUE)
            mapped = np.full(mask.shape, _UNKNOWN, dtype=np.int16)
            mapped[inside] = self._lookup[mask[inside]]
        unknown = mapped == _UNKNOWN
        if unknown.any():
            mapped = np.where(unknown, IGNORE_INDEX, mapped)
            return mapped.astype(np.uint8), np.unique(mask[unknown])
        return mapped.astype(np.uint8), np.empty(0, dtype=mask.dtype)

    def _classes_of_colors(self, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if mask.ndim != 3 or mask.shape[2] != 3:
            raise ValueError(f"colour masks are H x W x 3, got shape {mask.shape}")
        codes, (known, index) = color_codes(mask), self._color_lookup
        at = np.minimum(np.searchsorted(known, codes), len(known) - 1)
        found = known[at] == codes
        classes = np.where(found, index[at], np.uint8(IGNORE_INDEX)).astype(np.uint8)
        return classes, np.unique(codes[~found])

    def describe_unknown(self, values: np.ndarray) -> str:
        """What a mask holding ``values`` (``classes_of``'s unknown ones) holds, for messages: ``value 99, neither
        a class nor ignored by ...``, or ``colour [1, 2, 3], neither a class's nor ignored by ...``."""
        many = "s" if len(values) > 1 else ""
        more = ", ..." if len(values) > 5 else ""
        if self.mask_format == COLOR:
            shown = ", ".join(_color_text(int(code)) for code in values[:5]) + more
            ignored = "no ignore_color" if self.ignore_color is None else f"ignore_color {list(self.ignore_color)}"
            return f"colour{many} {shown}, neither a class's nor ignored by {self.source} (colors, {ignored})"
        shown = ", ".join(map(str, values[:5].tolist())) + more
        return f"value{many} {shown}, neither a class nor ignored by {self.source} ({self.describe_values()})"

    @property
    def mask_unit(self) -> str:
        """What a mask holds per pixel, in the plural, for messages."""
        return "colours" if self.mask_format == COLOR else "values"

    def describe_values(self) -> str:
        """The mask values of the classes and the ignored one, for messages: ``mask values 7, 8, 11, ..., ignore_index
        0``."""
        ignore = "no ignore_index" if self.ignore_index is None else f"ignore_index {self.ignore_index}"
        return f"class mask values {_values_text([v for v, _ in self.mask_values])}, {ignore}"
