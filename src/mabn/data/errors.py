"""The one error type for bad datasets: its message names the offending file or folder; and the pairing check
both segmentation layouts (Cityscapes, a folder of the user's own) share."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

from ..errors import UserError


class DatasetError(UserError):
    """A dataset that is missing, incomplete or unreadable."""


def require_pairs(
    images: Mapping[str, Path],
    labels: Mapping[str, Path],
    without_label: Callable[[str, int], str],
    without_image: Callable[[str, int], str],
) -> None:
    """A ``DatasetError`` for the first key (in sorted order) of ``images`` without a label, or of ``labels``
    without an image: the message ``without_label(key, count)`` / ``without_image(key, count)``, with the count of
    such keys."""
    for keys, message in (
        (images.keys() - labels.keys(), without_label),
        (labels.keys() - images.keys(), without_image),
    ):
        if keys:
            raise DatasetError(message(min(keys), len(keys)))
