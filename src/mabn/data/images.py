"""Image files and pixels: the one reader every dataset and prediction uses, and ImageNet's normalization.

Every reader goes through ``read_image``, so an unreadable file is the same one-line ``DatasetError`` naming it,
whichever stage, split or command meets it.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import albumentations as A
import numpy as np
from PIL import Image

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


def read_image(path: str | Path, kind: str = "image", mode: str | None = "RGB") -> np.ndarray:
    """The pixels of the file at ``path`` as an array (converted to ``mode``; ``None`` keeps the file's own, as a
    label or mask PNG needs), or a ``DatasetError`` naming the ``kind`` of file and its path."""
    try:
        with warnings.catch_warnings():  # readers run in the main thread or a DataLoader worker's
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(path)
        with img:
            return np.asarray(img if mode is None else img.convert(mode))
    except _UNREADABLE as err:
        raise DatasetError(f"cannot read {kind} file {path}: {err}") from err


def image_size(path: str | Path, kind: str = "image") -> tuple[int, int]:
    """(width, height) from the file's header, no pixel decoded (a file over ``MAX_IMAGE_PIXELS`` is refused)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(path)
        with img:
            return img.size
    except _UNREADABLE as err:
        raise DatasetError(f"cannot read {kind} file {path}: {err}") from err


def imagenet_normalize() -> A.Normalize:
    """uint8 RGB pixels -> float32, standardized with the ImageNet mean and std."""
    return A.Normalize(mean=IMAGENET_MEAN, std=IMAGENET_STD, max_pixel_value=MAX_PIXEL_VALUE)
