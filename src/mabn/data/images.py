"""Image files and pixels: the one reader every dataset and prediction uses, and ImageNet's normalization.

Every reader goes through ``read_image`` (pictures) or ``read_values`` (masks and labels), so an unreadable file
is the same one-line ``DatasetError`` naming it, whichever stage, split or command meets it, and every file is
read as a viewer shows it: turned by its EXIF orientation, as a phone photo's pixels are stored sideways with the
orientation that turns them upright (OpenCV's ``imread`` does the same). A picture of more than 8 bits per pixel
is scaled to 8 bits by its own range (``eight_bits``); a mask keeps its values.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import NamedTuple

import albumentations as A
import numpy as np
from PIL import ExifTags, Image, ImageOps
from PIL.PngImagePlugin import PngImageFile

from .errors import DatasetError

# The statistics torchvision's ImageNet weights were trained with; both stages normalize every image with them.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
MAX_PIXEL_VALUE = 255.0  # 8-bit pixels are divided by this before the mean and std apply

# The largest image opened, in pixels: 2**28 (268 million, 1 GiB of 8-bit RGBA). Cityscapes images are 2048x1024
# (2**21) and the largest ImageNet ones a few tens of megapixels, so every real file fits with room to spare, while
# a decompression bomb (a small file whose header claims gigapixels) stops at its header, before a decoder asks for
# memory. PIL's own default (about 89 million) is an upper bound set for the web. PIL only warns up to twice its
# limit (DecompressionBombWarning) and raises above; the readers here turn the warning into the error too, so any
# image over the limit is the one-line error naming the file.
MAX_IMAGE_PIXELS = 2**28
Image.MAX_IMAGE_PIXELS = MAX_IMAGE_PIXELS

# PIL reports undecodable files as OSError (UnidentifiedImageError, truncated data), corrupt PNG chunks as
# SyntaxError, some bad headers as ValueError, and an image over MAX_IMAGE_PIXELS as DecompressionBombError (an
# Exception of its own) or, up to twice the limit, DecompressionBombWarning (raised, above).
_UNREADABLE = (OSError, SyntaxError, ValueError, Image.DecompressionBombError, Image.DecompressionBombWarning)

# The EXIF orientations that turn or mirror the stored pixels (1 is as stored; PIL ignores any other value, and so
# do the readers), and those among them that turn by a quarter, so that width and height swap.
TURNED = frozenset(range(2, 9))
QUARTER_TURNED = frozenset(range(5, 9))


class Header(NamedTuple):
    """What a file's header says of its pixels, none decoded: ``size`` (width, height) as displayed, PIL's ``mode``
    of the pixels (``RGB``, ``L``, ``I;16``, ...) and the EXIF ``orientation`` (1: as stored)."""

    size: tuple[int, int]
    mode: str
    orientation: int


def _open(path: str | Path) -> Image.Image:
    """The file at ``path`` opened, its header read (a file over ``MAX_IMAGE_PIXELS`` refused)."""
    with warnings.catch_warnings():  # readers run in the main thread or a DataLoader worker's
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        return Image.open(path)


def orientation(img: Image.Image) -> int:
    """The EXIF orientation of ``img`` (1 where none is given). PIL looks for a PNG's eXIf chunk past the pixels by
    decoding them all; only one ahead of the pixels (where PIL and other writers put it) counts here, so that a
    header read decodes no pixel and the sizes it gives are those the readers turn the pixels to."""
    if isinstance(img, PngImageFile) and "exif" not in img.info:
        return 1
    return img.getexif().get(ExifTags.Base.Orientation, 1)


def upright(img: Image.Image) -> Image.Image:
    """``img`` turned as its EXIF orientation says a viewer shows it (``img`` itself where it is as stored)."""
    return ImageOps.exif_transpose(img) if orientation(img) in TURNED else img


# The pixels of one strip of rows that the readers copy and scale at a time (``pixels``, ``eight_bits``): numpy
# reads a whole PIL image through ``tobytes``, which joins its encoded chunks into one more copy, and the scaling's
# float64 temporaries take 8 bytes a pixel each; a strip at a time, the peak of reading a float32 file is its
# decoded pixels (4 bytes a pixel), the array (4) and the result (1 for a mask's values, 3 for RGB) plus a strip.
STRIP_PIXELS = 2**16


def _strips(height: int, width: int) -> range:
    return range(0, height, max(1, STRIP_PIXELS // max(width, 1)))


def pixels(img: Image.Image, mode: str | None = None) -> np.ndarray:
    """``np.asarray(img)``, or of ``img.convert(mode)``, read a strip of rows at a time (``STRIP_PIXELS``)."""
    width, height = img.size
    starts = _strips(height, width)

    def strip(top: int) -> np.ndarray:
        part = img.crop((0, top, width, min(top + starts.step, height)))
        return np.asarray(part if mode is None else part.convert(mode))

    first = strip(0)
    values = np.empty((height, *first.shape[1:]), first.dtype)
    values[: len(first)] = first
    for top in starts[1:]:
        values[top : top + starts.step] = strip(top)
    return values


def eight_bits(values: np.ndarray) -> np.ndarray:
    """The single-channel ``values`` (a 16-bit, 32-bit or floating-point picture) scaled linearly from their own
    minimum..maximum to 0..255, as uint8: the whole 8-bit range for whatever range a sensor or format fills (12
    bits of a 16-bit file, floats of 0..1 or of metres). A constant picture is 0; a pixel that is no number (NaN,
    an infinity) is 0 and left out of the range. Computed a strip of rows at a time (``STRIP_PIXELS``)."""
    starts = _strips(*values.shape[:2])
    # float64: exact for 16- and 32-bit integers, and no overflow in the subtraction
    low, high = np.inf, -np.inf
    for top in starts:
        rows = values[top : top + starts.step].astype(np.float64)
        finite = np.isfinite(rows)
        low = min(low, rows.min(where=finite, initial=np.inf))
        high = max(high, rows.max(where=finite, initial=-np.inf))
    out = np.zeros(values.shape, np.uint8)
    if not high > low:  # no finite pixel, or a constant picture
        return out
    for top in starts:
        rows = values[top : top + starts.step].astype(np.float64)
        finite = np.isfinite(rows)
        spread = (rows - low) * (255 / (high - low))
        out[top : top + starts.step] = np.rint(np.where(finite, spread, 0))
    return out


def scaled(mode: str) -> bool:
    """Whether pixels of PIL's ``mode`` are scaled by their own range (``eight_bits``): the 16-bit (``I;16``,
    ``I;16B``, ...), 32-bit integer (``I``) and floating-point (``F``) modes, which PIL's own conversion to RGB clips
    at 255."""
    return mode.startswith("I") or mode == "F"


def how_read(mode: str) -> str:
    """How ``to_rgb`` reads pixels of PIL's ``mode`` (other than ``RGB``), as the dry run says it."""
    if scaled(mode):
        bits = "floating-point" if mode == "F" else "32-bit" if mode == "I" else "16-bit"
        return f"{bits}, scaled to 8 bits by each image's own range"
    if mode in ("1", "L"):
        return "grey, the grey in each of the three channels"
    if mode in ("LA", "PA", "RGBA", "RGBa"):
        return "with an alpha channel, which is dropped"
    return "converted to 8-bit RGB by PIL"


def to_rgb(img: Image.Image) -> np.ndarray:
    """``img`` as a viewer shows it, as H x W x 3 uint8 RGB: turned by its EXIF orientation (``upright``); a
    picture of a ``scaled`` mode scaled to 8 bits by its own range (``eight_bits``), grey in each channel; any
    other mode converted by PIL (grey repeated, a palette's colours, an alpha channel dropped)."""
    img = upright(img)
    if scaled(img.mode):
        return np.repeat(eight_bits(pixels(img))[..., None], 3, axis=2)
    return pixels(img, "RGB")


def read_image(path: str | Path, kind: str = "image") -> np.ndarray:
    """The picture in the file at ``path`` as H x W x 3 uint8 RGB, as a viewer shows it (``to_rgb``), or a
    ``DatasetError`` naming the ``kind`` of file and its path."""
    try:
        with _open(path) as img:
            return to_rgb(img)
    except _UNREADABLE as err:
        raise DatasetError(f"cannot read {kind} file {path}: {err}") from err


def read_values(path: str | Path, kind: str, mode: str | None = None) -> np.ndarray:
    """The values of the mask or label file at ``path``, turned by its EXIF orientation as its picture is: the
    file's own (a 16-bit PNG's stay 16-bit), or with ``mode`` converted by PIL (a colour mask's RGB), never
    rescaled; or a ``DatasetError`` naming the ``kind`` of file and its path."""
    try:
        with _open(path) as img:
            return pixels(upright(img), mode)
    except _UNREADABLE as err:
        raise DatasetError(f"cannot read {kind} file {path}: {err}") from err


def read_header(path: str | Path, kind: str = "image") -> Header:
    """The ``Header`` of the file at ``path``, no pixel decoded, or a ``DatasetError`` naming the ``kind`` of file
    and its path."""
    try:
        with _open(path) as img:
            turn = orientation(img)
            width, height = img.size
            return Header((height, width) if turn in QUARTER_TURNED else (width, height), img.mode, turn)
    except _UNREADABLE as err:
        raise DatasetError(f"cannot read {kind} file {path}: {err}") from err


def image_size(path: str | Path, kind: str = "image") -> tuple[int, int]:
    """(width, height) as displayed (``read_header``), no pixel decoded."""
    return read_header(path, kind).size


def imagenet_normalize() -> A.Normalize:
    """uint8 RGB pixels -> float32, standardized with the ImageNet mean and std."""
    return A.Normalize(mean=IMAGENET_MEAN, std=IMAGENET_STD, max_pixel_value=MAX_PIXEL_VALUE)
