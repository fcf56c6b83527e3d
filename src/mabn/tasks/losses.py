"""Stage 2's training loss (``SegmentationTask``'s ``loss``, ``class_weights``, ``ohem_thresh``, ``ohem_min_kept``).

``loss`` names one loss or a weighted sum of several, ``{name: weight, ...}``:

- ``ce``: cross-entropy averaged over the labelled pixels (the recipe's, and the default);
- ``dice``, ``focal``, ``lovasz``: segmentation_models_pytorch's ``DiceLoss``, ``FocalLoss`` and ``LovaszLoss``
  in ``multiclass`` mode with the ignored pixels left out (``ignore_index``), at smp's defaults: Dice
  ``1 - 2|P∩Y| / (|P| + |Y|)`` per class over the batch (a class absent from the batch's labels counts 0),
  averaged over the classes; Focal the one-vs-rest sigmoid focal loss of each class's logit (gamma 2), averaged
  over the labelled pixels and then the classes; Lovász the Lovász-Softmax over the batch's labelled pixels,
  averaged over the classes present;
- ``ohem``: cross-entropy over the hard pixels only, chosen as mmsegmentation's ``OHEMPixelSampler`` chooses
  them: a labelled pixel is kept where the softmax probability of its true class is below ``ohem_thresh``, and
  the ``ohem_min_kept`` x images of the batch with the lowest such probability are kept whatever it is (all
  labelled pixels where there are fewer). A tie at that cut keeps every pixel of the tie (mmsegmentation's strict
  ``<`` keeps none of them), so at least that many are kept. The loss is the mean over the kept pixels.

Class weights (``resolve_class_weights``) multiply each pixel's cross-entropy by its true class's weight and
average with those weights (``sum w_y l / sum w_y``, PyTorch's weighted mean, so that the loss keeps the scale
of cross-entropy); Dice and Focal take them as smp does, as weights of the per-class terms in their average;
Lovász takes none.

Host reads: ``ce``, weighted or not, never reads the device from the host. ``ohem`` does in every step (its
labelled pixels are a boolean selection, whose count the host reads before ranking them), and so do ``focal``
and ``lovasz`` (the check for a batch without a labelled pixel, and smp's selection of the labelled pixels): on
a GPU each such read waits for the step's queued kernels.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from segmentation_models_pytorch import losses as smp_losses

from ..data.classes import IGNORE_INDEX, weight_out_of_range
from ..errors import ConfigError

__all__ = [
    "COUNTS",
    "LOSSES",
    "PixelLoss",
    "check_loss",
    "inverse_log_weights",
    "loss_terms",
    "resolve_class_weights",
]

LOSSES = {
    "ce": "cross-entropy",
    "dice": "Dice (smp)",
    "focal": "Focal (smp)",
    "lovasz": "Lovász-Softmax (smp)",
    "ohem": "OHEM cross-entropy",
}
UNWEIGHTED = ("lovasz",)  # smp's LovaszLoss has no class weights
COUNTS = "counts"  # class_weights computed from the training split's pixels per class
# ENet's constant (Paszke et al. 2016): a class's weight 1 / ln(C + share) lies between 1 / ln(C + 1) = 1.42 (a
# class of every pixel) and 1 / ln(C) = 50.5 (a class of none).
LOG_OFFSET = 1.02


def loss_terms(loss: str | Mapping[str, float]) -> dict[str, float]:
    """The terms of a ``loss`` argument, ``{name: weight}``: a name alone is that loss at weight 1. ``ConfigError``
    naming the value when a name is not one of ``LOSSES`` or a weight is not a number > 0."""
    names = ", ".join(LOSSES)
    if isinstance(loss, str):
        if loss not in LOSSES:
            raise ConfigError(f"loss={loss!r}: choose one of {names}, or a weighted sum such as {{ce: 1.0, dice: 0.5}}")
        return {loss: 1.0}
    if not isinstance(loss, Mapping) or not loss:
        raise ConfigError(f"loss={loss!r}: a loss name ({names}) or a weighted sum such as {{ce: 1.0, dice: 0.5}}")
    for name, weight in loss.items():
        if name not in LOSSES:
            raise ConfigError(f"loss={dict(loss)!r}: {name!r} is not a loss; choose among {names}")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not (0 < weight < math.inf):
            raise ConfigError(f"loss={dict(loss)!r}: the weight of {name} must be a number > 0, got {weight!r}")
    return {name: float(weight) for name, weight in loss.items()}


def _positive_numbers(values: Any) -> bool:
    return isinstance(values, (list, tuple)) and all(
        not isinstance(v, bool) and isinstance(v, (int, float)) and 0 < v < math.inf for v in values
    )


def check_loss(loss: Any, class_weights: Any, ohem_thresh: Any, ohem_min_kept: Any) -> None:
    """Refuse loss arguments that cannot train, before any data is read: ``ConfigError``, one line naming the
    argument (the number of weights against the classes is checked where the classes are known,
    ``resolve_class_weights``)."""
    terms = loss_terms(loss)
    if not (class_weights is None or class_weights == COUNTS or (_positive_numbers(class_weights) and class_weights)):
        raise ConfigError(
            f"class_weights={class_weights!r}: null (classes.yaml's weights where it gives some, else none), "
            f"{COUNTS} (from the training pixels per class) or a list of numbers > 0, one per class"
        )
    if isinstance(class_weights, (list, tuple)) and (why := weight_out_of_range(class_weights)):
        raise ConfigError(f"class_weights={list(class_weights)!r}: {why}")
    if class_weights is not None and all(name in UNWEIGHTED for name in terms):
        raise ConfigError(f"class_weights={class_weights!r}: loss {loss} takes no class weights (smp's LovaszLoss)")
    if "ohem" in terms:
        if isinstance(ohem_thresh, bool) or not isinstance(ohem_thresh, (int, float)) or not 0 < ohem_thresh <= 1:
            raise ConfigError(f"ohem_thresh={ohem_thresh!r}: a probability in (0, 1]")
        if isinstance(ohem_min_kept, bool) or not isinstance(ohem_min_kept, int) or ohem_min_kept < 1:
            raise ConfigError(f"ohem_min_kept={ohem_min_kept!r}: a whole number of pixels per image, >= 1")


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


def describe(terms: Mapping[str, float], ohem_thresh: float, ohem_min_kept: int) -> str:
    """The loss in words, for the plan's ``loss:`` line."""
    parts = []
    for name, weight in terms.items():
        text = LOSSES[name]
        if name == "ohem":
            text += (
                f" (pixels of true-class probability < {ohem_thresh:g}, at least the {ohem_min_kept} hardest per image)"
            )
        parts.append(text if len(terms) == 1 and weight == 1 else f"{weight:g} x {text}")
    return " + ".join(parts)


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    """Cross-entropy averaged over the labelled pixels (``IGNORE_INDEX`` left out), with ``weight`` per class a
    weighted mean; 0 for a batch without any, where the mean over no pixel would be NaN and poison the weights (a
    crop of void only)."""
    total = F.cross_entropy(logits, labels, weight=weight, ignore_index=IGNORE_INDEX, reduction="sum")
    labelled = labels != IGNORE_INDEX
    if weight is None:
        return total / labelled.sum().clamp(min=1)
    # The denominator is 0 only where the total is (no labelled pixel): the smallest positive float leaves it 0.
    weights = weight[torch.where(labelled, labels, 0)] * labelled
    return total / weights.sum().clamp(min=torch.finfo(weights.dtype).tiny)


def ohem_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    thresh: float,
    min_kept: int,
    weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """Cross-entropy (weighted by ``weight`` per class) averaged over the hard pixels (see the module's doc)."""
    pixel = F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="none")
    labelled = labels != IGNORE_INDEX
    with torch.no_grad():
        true_prob = torch.exp(-pixel)  # the softmax probability of the true class
        hard = labelled & (true_prob < thresh)
        candidates = true_prob[labelled]
        count = min(min_kept * labels.shape[0], candidates.numel())
        if count:
            cut = candidates.kthvalue(count).values  # the count-th lowest: every pixel up to it is kept
            hard |= labelled & (true_prob <= cut)
    kept = hard.to(pixel.dtype)
    if weight is not None:
        kept = kept * weight.to(pixel.dtype)[torch.where(labelled, labels, 0)]
    return (pixel * kept).sum() / kept.sum().clamp(min=torch.finfo(kept.dtype).tiny)


class PixelLoss:
    """The training loss of one head's logits (N, K, H, W) against class maps (N, H, W) with ``IGNORE_INDEX`` for
    ignored pixels: the weighted sum of ``terms`` (``loss_terms``), with ``class_weights`` (one per class, or
    None). A plain object, not a module: it holds no state that a checkpoint would carry."""

    def __init__(
        self,
        terms: Mapping[str, float],
        class_weights: Sequence[float] | None = None,
        ohem_thresh: float = 0.7,
        ohem_min_kept: int = 100_000,
    ) -> None:
        self.terms = dict(terms)
        self.ohem_thresh, self.ohem_min_kept = ohem_thresh, ohem_min_kept
        self.weight = None if class_weights is None else torch.tensor(list(class_weights), dtype=torch.float32)
        weights = None if class_weights is None else list(class_weights)
        smp = {
            "dice": lambda: smp_losses.DiceLoss("multiclass", ignore_index=IGNORE_INDEX, class_weights=weights),
            "focal": lambda: smp_losses.FocalLoss("multiclass", ignore_index=IGNORE_INDEX, class_weights=weights),
            "lovasz": lambda: smp_losses.LovaszLoss("multiclass", ignore_index=IGNORE_INDEX),
        }
        self.smp = {name: smp[name]() for name in self.terms if name in smp}

    def term(self, name: str, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """One term of the loss, unweighted by its factor."""
        weight = None if self.weight is None else self.weight.to(logits.device)
        if name == "ce":
            return cross_entropy(logits, labels, weight)
        if name == "ohem":
            return ohem_cross_entropy(logits, labels, self.ohem_thresh, self.ohem_min_kept, weight)
        # smp's Focal averages over no pixel (NaN) and its Lovász returns an empty tensor for a batch with no
        # labelled pixel; a crop of void only trains nothing, as the cross-entropy's 0 says.
        if name != "dice" and not (labels != IGNORE_INDEX).any():
            return logits.sum() * 0.0
        return self.smp[name](logits.float(), labels)

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        total = None
        for name, factor in self.terms.items():
            value = self.term(name, logits, labels)
            value = value if factor == 1 else factor * value
            total = value if total is None else total + value
        return total
