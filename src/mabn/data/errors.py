"""The one error type for bad datasets: its message names the offending file or folder; and the pairing check
both segmentation layouts (Cityscapes, a folder of the user's own) share."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

from ..errors import UserError, UserErrors


class DatasetError(UserError):
    """A dataset that is missing, incomplete or unreadable."""


class DatasetErrors(DatasetError, UserErrors):
    """Several problems of one dataset found by one check (a dry run's): one line each."""


def pair_problems(
    images: Mapping[str, Path],
    labels: Mapping[str, Path],
    without_label: Callable[[str, int], str],
    without_image: Callable[[str, int], str],
) -> list[str]:
    """The lines for the keys of ``images`` without a label and of ``labels`` without an image: the message
    ``without_label(key, count)`` / ``without_image(key, count)`` for the first such key (in sorted order), with
    the count of such keys; none when every key pairs."""
    return [
        message(min(keys), len(keys))
        for keys, message in (
            (images.keys() - labels.keys(), without_label),
            (labels.keys() - images.keys(), without_image),
        )
        if keys
    ]


def require_pairs(
    images: Mapping[str, Path],
    labels: Mapping[str, Path],
    without_label: Callable[[str, int], str],
    without_image: Callable[[str, int], str],
) -> None:
    """A ``DatasetError`` for the first of ``pair_problems``, if any."""
    problems = pair_problems(images, labels, without_label, without_image)
    if problems:
        raise DatasetError(problems[0])
