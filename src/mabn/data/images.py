"""Image files and pixels: the one reader every dataset and prediction uses, and ImageNet's normalization.

Every reader goes through ``read_image``, so an unreadable file is the same one-line ``DatasetError`` naming it,
whichever stage, split or command meets it.
"""

from __future__ import annotations

from pathlib import Path

import albumentations as A
import numpy as np
from PIL import Image

from .errors import DatasetError

# The statistics torchvision's ImageNet weights were trained with; both stages normalize every image with them.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

# PIL reports undecodable files as OSError (UnidentifiedImageError, truncated data), corrupt PNG chunks as
# SyntaxError, and some bad headers as ValueError.
_UNREADABLE = (OSError, SyntaxError, ValueError)


def read_image(path: str | Path, kind: str = "image", mode: str | None = "RGB") -> np.ndarray:
    """The pixels of the file at ``path`` as an array (converted to ``mode``; ``None`` keeps the file's own, as a
    label or mask PNG needs), or a ``DatasetError`` naming the ``kind`` of file and its path."""
    try:
        with Image.open(path) as img:
            return np.asarray(img if mode is None else img.convert(mode))
    except _UNREADABLE as err:
        raise DatasetError(f"cannot read {kind} file {path}: {err}") from err


def image_size(path: str | Path, kind: str = "image") -> tuple[int, int]:
    """(width, height) from the file's header, no pixel decoded."""
    try:
        with Image.open(path) as img:
            return img.size
    except _UNREADABLE as err:
        raise DatasetError(f"cannot read {kind} file {path}: {err}") from err


def imagenet_normalize() -> A.Normalize:
    """uint8 RGB pixels -> float32, standardized with the ImageNet mean and std."""
    return A.Normalize(mean=IMAGENET_MEAN, std=IMAGENET_STD, max_pixel_value=255.0)
