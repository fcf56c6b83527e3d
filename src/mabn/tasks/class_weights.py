"""The class weights of stage 2's loss (``SegmentationTask``'s ``class_weights``): given as a list, from the class
table's file, or computed from the training split's pixels per class (``counts``, ENet's rule)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..errors import ConfigError

COUNTS = "counts"  # class_weights computed from the training split's pixels per class
# ENet's constant (Paszke et al. 2016): a class's weight 1 / ln(C + share) lies between 1 / ln(C + 1) = 1.42 (a
# class of every pixel) and 1 / ln(C) = 50.5 (a class of none).
LOG_OFFSET = 1.02


def inverse_log_weights(pixels: Sequence[int]) -> list[float]:
    """Class weights from the pixels of each class (the ignored ones left out): ``1 / ln(1.02 + share)``, the share
    being the class's fraction of the labelled pixels (ENet's rule). Bounded: from 1.42 for a class of every pixel
    to 50.5 for a class of none, so that a rare class weighs at most about 35 times a common one, where median
    frequency balancing (median share / share) grows without bound as a class's share falls."""
    total = sum(pixels)
    return [1.0 / math.log(LOG_OFFSET + (count / total if total else 0.0)) for count in pixels]


def resolve_class_weights(
    class_weights: str | Sequence[float] | None,
    names: Sequence[str],
    file_weights: Sequence[float] | None,
    source: str,
    pixels: Sequence[int] | None,
) -> tuple[list[float] | None, str]:
    """(the weight of each class of ``names``, or None for none; where they come from, for the lines that say
    them). ``class_weights``: the task's argument; ``file_weights``: the classes file's (``source``), None where
    it gives none; ``pixels``: the training split's pixels per class, None where the data module counts none.
    ``ConfigError`` for weights given twice, ``counts`` without counts, a list of another length."""
    if class_weights is None:
        return (None, "") if file_weights is None else (list(file_weights), f"weights of {source}")
    if file_weights is not None:
        raise ConfigError(
            f"class_weights={class_weights!r} and {source}'s weights both weigh the classes: remove one of them"
        )
    if class_weights == COUNTS:
        if pixels is None:
            raise ConfigError(
                f"class_weights={COUNTS}: this data module counts no pixels per class (a dataset of your own, "
                "python -m mabn segment --data DIR, does); give the weights as a list, one per class"
            )
        return inverse_log_weights(pixels), f"from the training pixels per class, 1 / ln({LOG_OFFSET} + share)"
    if len(class_weights) != len(names):
        raise ConfigError(
            f"class_weights={list(class_weights)!r}: {len(class_weights)} weights for {len(names)} classes; give "
            "one per class, in class-index order"
        )
    return [float(w) for w in class_weights], "as given"


def weights_line(weights: Sequence[float], names: Sequence[str], origin: str) -> str:
    """The line that says the class weights a fit trains with."""
    return f"class weights ({origin}): " + ", ".join(f"{name} {w:.2f}" for name, w in zip(names, weights))
