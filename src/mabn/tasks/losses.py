"""Stage 2's training loss (``SegmentationTask``'s ``loss`` and ``class_weights``): a registry of losses, each one
``LossEntry`` that takes its own options.

``loss`` names one loss or a weighted sum of several; each term is a name alone (its options at their defaults), a
weight, or a mapping of its options with an optional ``weight`` (1 by default)::

    loss: ce
    loss: {ce: 1.0, dice: 0.5}
    loss: {ce: 1.0, ohem: {weight: 0.5, thresh: 0.7, min_kept: 2000}}

The built-in losses (``LOSSES``; docs/training.md's table lists them with their options):

- ``ce``: cross-entropy averaged over the labelled pixels (the recipe's, and the default);
- ``dice``, ``focal``, ``lovasz``: segmentation_models_pytorch's ``DiceLoss``, ``FocalLoss`` and ``LovaszLoss``
  in ``multiclass`` mode with the ignored pixels left out (``ignore_index``): Dice ``1 - (|P∩Y| + smooth) /
  ((|P| + |Y|) / 2 + smooth)`` (smp's form) per class over the batch (a class absent from the batch's labels
  counts 0), averaged over the classes; Focal the one-vs-rest sigmoid focal loss of each class's logit
  (``gamma``), averaged over the labelled pixels and then the classes; Lovász the Lovász-Softmax over the batch's
  labelled pixels, averaged over the classes present;
- ``ohem``: cross-entropy over the hard pixels only, chosen as mmsegmentation's ``OHEMPixelSampler`` chooses
  them: a labelled pixel is kept where the softmax probability of its true class is below ``thresh``, and the
  ``min_kept`` x images of the batch with the lowest such probability are kept whatever it is (all labelled
  pixels where there are fewer). A tie at that cut keeps every pixel of the tie (mmsegmentation's strict ``<``
  keeps none of them), so at least that many are kept. The loss is the mean over the kept pixels. ``min_kept``
  null (the default) scales mmsegmentation's Cityscapes setting, 100000 of a 512x1024 crop, to the run's crop
  (``OhemOptions.kept``): a count of pixels means another share of another crop, and at a crop of fewer pixels
  than it keeps OHEM is plain cross-entropy.

A loss of one's own is one entry, ``register_loss(LossEntry(...))``, from any module; a loss named
``module.name`` imports ``module`` first (which registers ``name``), so that every process that builds the task
(a fit, ``test``, ``predict``, ``mabn.load``, ``export``, each from the checkpoint's ``loss``) finds it.

Class weights (``mabn.tasks.class_weights``) multiply each pixel's cross-entropy by its true class's weight and
average with those weights (``sum w_y l / sum w_y``, PyTorch's weighted mean, so that the loss keeps the scale
of cross-entropy); Dice and Focal take them as smp does, as weights of the per-class terms in their average;
Lovász takes none (its entry's ``class_weights`` is False).

Host reads (each entry's ``host_reads``): ``ce`` and ``dice`` on a GPU, weighted or not, never read the device
from the host; ``ohem``, ``focal`` and ``lovasz`` do in every step: on a GPU each such read waits for the step's
queued kernels.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from segmentation_models_pytorch import losses as smp_losses

from ..data.classes import IGNORE_INDEX, weight_out_of_range
from ..errors import ConfigError
from .class_weights import COUNTS

__all__ = [
    "LOSSES",
    "LossData",
    "LossEntry",
    "LossTerm",
    "OhemOptions",
    "PixelLoss",
    "build_loss",
    "check_loss",
    "loss_entry",
    "loss_terms",
    "register_loss",
    "unregister_loss",
]

WEIGHT = "weight"  # the key of a term's factor among its options
# The loss's options that were the task's arguments, and where they are now (the one-line error names it).
MOVED = {
    "ohem_thresh": "an option of the ohem loss, --model.init_args.loss '{ohem: {thresh: 0.7}}'",
    "ohem_min_kept": "an option of the ohem loss, --model.init_args.loss '{ohem: {min_kept: 2000}}'",
}

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class LossData:
    """What a fit's data tells its loss (at the fit's setup, and in its dry run): the weight of each class (None:
    none) and the side in pixels of the square training crop (None: not known, a task built outside a fit)."""

    class_weights: tuple[float, ...] | None = None
    crop: int | None = None


@dataclass(frozen=True)
class LossEntry:
    """One loss: everything the task, its plan and the docs ask about it.

    ``build(options, data)`` returns the loss of logits (N, K, H, W) against class maps (N, H, W) with
    ``IGNORE_INDEX`` for ignored pixels, a scalar that is 0 (with a zero gradient) for a batch without a labelled
    pixel; ``options`` is an instance of ``options`` (None where the entry has none), ``data`` a ``LossData``.
    ``options``: a frozen dataclass of its options, their types and defaults in its fields (int, float, bool, str,
    or one of them or None); its ``__post_init__`` raises ValueError for a value that cannot train. ``title``:
    the loss in words (the plan's ``loss:`` line, docs/training.md's table); ``detail(options)``: its options in
    words after the title ("" for none); ``data_lines(options, data)``: what the dry run and the fit say of it
    once the data is known. ``class_weights``: it takes class weights. ``host_reads``: why a training step of it
    reads the device from the host ("" where it does not), which docs/training.md's table says.
    """

    name: str
    title: str
    build: Callable[[Any, LossData], LossFn]
    options: type | None = None
    class_weights: bool = True
    host_reads: str = ""
    detail: Callable[[Any], str] | None = None
    data_lines: Callable[[Any, LossData], list[str]] | None = None


@dataclass(frozen=True)
class LossTerm:
    """One term of a ``loss`` argument: its entry, its factor and its options (``loss_terms``)."""

    entry: LossEntry
    weight: float
    options: Any = None

    def describe(self) -> str:
        detail = "" if self.entry.detail is None else self.entry.detail(self.options)
        return f"{self.entry.title} ({detail})" if detail else self.entry.title


LOSSES: dict[str, LossEntry] = {}


def register_loss(entry: LossEntry) -> LossEntry:
    """Add the loss ``entry``: from here on ``loss`` takes its name, with its options. A name already taken, a name
    with a dot (which names a module to import) or an option named ``weight`` (the term's factor) is a
    ValueError naming it. Returns ``entry``."""
    if entry.name in LOSSES:
        raise ValueError(f"register_loss: loss {entry.name!r} exists already")
    if not entry.name.isidentifier():
        raise ValueError(f"register_loss: loss name {entry.name!r} is not an identifier (a dot names a module)")
    if entry.options is not None:
        if not (dataclasses.is_dataclass(entry.options) and isinstance(entry.options, type)):
            raise ValueError(f"register_loss: loss {entry.name!r}: options must be a dataclass, got {entry.options!r}")
        if WEIGHT in {field.name for field in dataclasses.fields(entry.options)}:
            raise ValueError(f"register_loss: loss {entry.name!r}: an option named {WEIGHT!r} is the term's factor")
    LOSSES[entry.name] = entry
    return entry


def unregister_loss(name: str) -> None:
    """Remove the loss ``name`` (the inverse of ``register_loss``)."""
    del LOSSES[loss_entry(name).name]


def loss_entry(name: str) -> LossEntry:
    """The entry of ``name``: a registered loss, or ``module.loss``, for which ``module`` is imported first (it
    registers ``loss``). ``ConfigError`` naming the known losses when there is none."""
    if name in LOSSES:
        return LOSSES[name]
    module, dot, last = name.rpartition(".")
    if dot and module:
        try:
            importlib.import_module(module)
        except (ImportError, ValueError) as err:  # not found, or its registration refused (a name taken)
            raise ConfigError(f"loss {name!r}: cannot import module {module!r} ({err})") from None
        if last in LOSSES:
            return LOSSES[last]
        raise ConfigError(
            f"loss {name!r}: module {module!r} registers no loss {last!r} (mabn.tasks.losses.register_loss)"
        )
    raise ConfigError(f"loss {name!r} is not a loss; choose one of {', '.join(LOSSES)}, or module.name")


def _accepts(hint: Any, value: Any) -> bool:
    """Whether ``value`` is of the option type ``hint`` (int, float, bool, str, a union of them with None; a number
    where a float is asked; never a bool for a number)."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return any(_accepts(h, value) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint) if isinstance(hint, type) else True


def _options(entry: LossEntry, given: Mapping[str, Any], said: str) -> Any:
    """The options instance of ``entry`` from ``given``; ``ConfigError`` naming ``said`` and the option at fault."""
    if entry.options is None:
        if given:
            raise ConfigError(f"{said}: {entry.name} takes no options, got {', '.join(map(str, given))}")
        return None
    fields = {field.name: field for field in dataclasses.fields(entry.options)}
    hints = typing.get_type_hints(entry.options)
    for key, value in given.items():
        if key not in fields:
            known = ", ".join([WEIGHT, *fields])
            raise ConfigError(f"{said}: {entry.name} has no option {key!r}; its options are {known}")
        if not _accepts(hints[key], value):
            raise ConfigError(f"{said}: {entry.name}'s {key}={value!r} is not of type {hints[key]}")
    values = {k: float(v) if hints[k] is float else v for k, v in given.items()}
    try:
        return entry.options(**values)
    except ValueError as err:
        raise ConfigError(f"{said}: {entry.name}'s {err}") from None


def _factor(value: Any, name: str, said: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value < math.inf):
        raise ConfigError(f"{said}: the weight of {name} must be a number > 0, got {value!r}")
    return float(value)


def loss_terms(loss: str | Mapping[str, Any]) -> list[LossTerm]:
    """The terms of a ``loss`` argument (see the module's doc). ``ConfigError``, one line naming the value, for a
    name that is no loss, a weight that is not a number > 0, an option the loss does not take or a value it
    refuses."""
    said = f"loss={loss!r}" if isinstance(loss, str) else f"loss={dict(loss)!r}" if isinstance(loss, Mapping) else ""
    if isinstance(loss, str):
        return [LossTerm(loss_entry(loss), 1.0, _options(loss_entry(loss), {}, said))]
    if not isinstance(loss, Mapping) or not loss:
        raise ConfigError(
            f"loss={loss!r}: a loss name ({', '.join(LOSSES)}) or a weighted sum such as {{ce: 1.0, dice: 0.5}}, "
            "each term a weight or its options: {dice: {weight: 0.5, smooth: 1.0}}"
        )
    terms = []
    for name, value in loss.items():
        entry = loss_entry(str(name))
        if isinstance(value, Mapping):
            options = {k: v for k, v in value.items() if k != WEIGHT}
            factor = _factor(value[WEIGHT], entry.name, said) if WEIGHT in value else 1.0
            terms.append(LossTerm(entry, factor, _options(entry, options, said)))
        else:
            terms.append(LossTerm(entry, _factor(value, entry.name, said), _options(entry, {}, said)))
    return terms


def _positive_numbers(values: Any) -> bool:
    return isinstance(values, (list, tuple)) and all(
        not isinstance(v, bool) and isinstance(v, (int, float)) and 0 < v < math.inf for v in values
    )


def check_loss(loss: Any, class_weights: Any) -> None:
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
    if class_weights is not None and not any(term.entry.class_weights for term in terms):
        raise ConfigError(f"class_weights={class_weights!r}: loss {loss} takes no class weights")


def from_checkpoint(hparams: Mapping[str, Any]) -> dict[str, Any]:
    """A checkpoint's hyperparameters with the loss's options under ``loss``: a checkpoint whose task took OHEM's
    options as ``ohem_thresh`` and ``ohem_min_kept`` has them moved into its ``ohem`` term."""
    out = dict(hparams)
    moved = {key.removeprefix("ohem_"): out.pop(key) for key in MOVED if key in out}
    loss = out.get("loss")
    if moved and (loss == "ohem" or (isinstance(loss, Mapping) and "ohem" in loss)):
        terms = {"ohem": 1.0} if loss == "ohem" else dict(loss)
        weight = terms["ohem"]
        terms["ohem"] = {**moved, **(weight if isinstance(weight, Mapping) else {WEIGHT: weight})}
        out["loss"] = terms
    return out


def describe(terms: Sequence[LossTerm]) -> str:
    """The loss in words, for the plan's ``loss:`` line."""
    parts = [term.describe() for term in terms]
    if len(terms) == 1 and terms[0].weight == 1:
        return parts[0]
    return " + ".join(f"{term.weight:g} x {text}" for term, text in zip(terms, parts))


def data_lines(terms: Sequence[LossTerm], data: LossData) -> list[str]:
    """What each term says once the data is known (``LossEntry.data_lines``)."""
    return [line for t in terms if t.entry.data_lines is not None for line in t.entry.data_lines(t.options, data)]


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


def _weight(data: LossData) -> torch.Tensor | None:
    return None if data.class_weights is None else torch.tensor(data.class_weights, dtype=torch.float32)


def _on(weight: torch.Tensor | None, logits: torch.Tensor) -> torch.Tensor | None:
    return None if weight is None else weight.to(logits.device)


def _ce(options: None, data: LossData) -> LossFn:
    weight = _weight(data)
    return lambda logits, labels: cross_entropy(logits, labels, _on(weight, logits))


# mmsegmentation's OHEM on Cityscapes (its configs' OHEMPixelSampler(thresh=0.7, min_kept=100000), at the
# 512x1024 crop of its Cityscapes dataset config): the share of a crop that min_kept null keeps at any crop.
OHEM_REFERENCE_KEPT, OHEM_REFERENCE_CROP = 100_000, (512, 1024)
OHEM_SHARE = OHEM_REFERENCE_KEPT / math.prod(OHEM_REFERENCE_CROP)


@dataclass(frozen=True)
class OhemOptions:
    """``thresh``: a labelled pixel whose true class has a softmax probability below it is kept. ``min_kept``: at
    least this many pixels per image are kept, those of the lowest such probability; null: mmsegmentation's
    Cityscapes share, 100000 of a 512x1024 crop (19.1 %), of the run's crop."""

    thresh: float = 0.7
    min_kept: int | None = None

    def __post_init__(self) -> None:
        if not 0 < self.thresh <= 1:
            raise ValueError(f"thresh={self.thresh!r}: a probability in (0, 1]")
        if self.min_kept is not None and self.min_kept < 1:
            raise ValueError(f"min_kept={self.min_kept!r}: a whole number of pixels per image, >= 1, or null")

    def kept(self, crop: int | None) -> int:
        """The pixels kept at least per image at a square crop of ``crop`` px: ``min_kept`` as given, else
        ``OHEM_SHARE`` of the crop (the reference's count where the crop is not known)."""
        if self.min_kept is not None:
            return self.min_kept
        return OHEM_REFERENCE_KEPT if crop is None else max(1, round(OHEM_SHARE * crop * crop))


def _ohem(options: OhemOptions, data: LossData) -> LossFn:
    weight, kept = _weight(data), options.kept(data.crop)
    return lambda logits, labels: ohem_cross_entropy(logits, labels, options.thresh, kept, _on(weight, logits))


def _ohem_detail(options: OhemOptions) -> str:
    at_least = (
        f"at least the {options.min_kept} hardest per image"
        if options.min_kept is not None
        else f"at least the hardest {100 * OHEM_SHARE:.1f} % of each crop"
    )
    return f"pixels of true-class probability < {options.thresh:g}, {at_least}"


def _ohem_lines(options: OhemOptions, data: LossData) -> list[str]:
    """What OHEM keeps at the run's crop; a warning where ``min_kept`` keeps every pixel, plain cross-entropy."""
    if data.crop is None:
        return []
    pixels, kept = data.crop * data.crop, options.kept(data.crop)
    crop = f"{data.crop}x{data.crop}"
    if kept >= pixels:
        scaled = OhemOptions(options.thresh).kept(data.crop)
        return [
            f"warning: ohem keeps at least {kept} pixels per image, every pixel of a {crop} crop ({pixels}): the loss "
            f"is plain cross-entropy; give min_kept below {pixels}, or null for {100 * OHEM_SHARE:.1f} % of the crop "
            f"({scaled}), --model.init_args.loss '{{ohem: {{min_kept: null}}}}'"
        ]
    why = (
        f"min_kept {kept} as given"
        if options.min_kept is not None
        else f"{100 * OHEM_SHARE:.1f} % of the crop: mmsegmentation's {OHEM_REFERENCE_KEPT} of "
        f"{OHEM_REFERENCE_CROP[0]}x{OHEM_REFERENCE_CROP[1]}"
    )
    return [
        f"ohem: keeps the pixels of true-class probability < {options.thresh:g}, and at least the {kept} hardest of "
        f"each {crop} crop's {pixels} ({why})"
    ]


def _unless_void(loss: Callable[..., torch.Tensor]) -> LossFn:
    """``loss`` where the batch has a labelled pixel, else 0: smp's Focal averages over no pixel (NaN) and its
    Lovász returns an empty tensor for such a batch; a crop of void only trains nothing, as cross-entropy's 0
    says. The check reads the host."""

    def guarded(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if not (labels != IGNORE_INDEX).any():
            return logits.sum() * 0.0
        return loss(logits.float(), labels)

    return guarded


@dataclass(frozen=True)
class DiceOptions:
    """``smooth``: added to the numerator and the denominator of each class's Dice, (I + smooth) / ((P + T) / 2 +
    smooth) as smp writes it (0: none)."""

    smooth: float = 0.0

    def __post_init__(self) -> None:
        if not 0 <= self.smooth < math.inf:
            raise ValueError(f"smooth={self.smooth!r}: a number >= 0")


def _dice(options: DiceOptions, data: LossData) -> LossFn:
    weights = None if data.class_weights is None else list(data.class_weights)
    dice = smp_losses.DiceLoss(
        "multiclass", ignore_index=IGNORE_INDEX, class_weights=weights, smooth=options.smooth
    )  # fmt: skip
    return lambda logits, labels: dice(logits.float(), labels)


@dataclass(frozen=True)
class FocalOptions:
    """``gamma``: the focusing exponent, (1 - q) ** gamma on each pixel's log-probability q (0: plain sigmoid
    cross-entropy)."""

    gamma: float = 2.0

    def __post_init__(self) -> None:
        if not 0 <= self.gamma < math.inf:
            raise ValueError(f"gamma={self.gamma!r}: a number >= 0")


def _focal(options: FocalOptions, data: LossData) -> LossFn:
    weights = None if data.class_weights is None else list(data.class_weights)
    return _unless_void(
        smp_losses.FocalLoss("multiclass", ignore_index=IGNORE_INDEX, class_weights=weights, gamma=options.gamma)
    )


def _lovasz(options: None, data: LossData) -> LossFn:
    return _unless_void(smp_losses.LovaszLoss("multiclass", ignore_index=IGNORE_INDEX))


for _entry in (
    LossEntry("ce", "cross-entropy", _ce),
    LossEntry(
        "dice", "Dice (smp)", _dice, DiceOptions, detail=lambda o: "" if not o.smooth else f"smooth {o.smooth:g}"
    ),
    LossEntry(
        "focal", "Focal (smp)", _focal, FocalOptions,
        host_reads="its check for a batch without a labelled pixel, and smp's selection of the labelled pixels",
        detail=lambda o: "" if o.gamma == 2 else f"gamma {o.gamma:g}",
    ),
    LossEntry(
        "lovasz", "Lovász-Softmax (smp)", _lovasz, class_weights=False,
        host_reads="its check for a batch without a labelled pixel, and smp's selection of the labelled pixels",
    ),
    LossEntry(
        "ohem", "OHEM cross-entropy", _ohem, OhemOptions,
        host_reads="the count of its labelled pixels, which it ranks",
        detail=_ohem_detail, data_lines=_ohem_lines,
    ),
):  # fmt: skip
    register_loss(_entry)


class PixelLoss:
    """The training loss of one head's logits (N, K, H, W) against class maps (N, H, W) with ``IGNORE_INDEX`` for
    ignored pixels: the weighted sum of ``terms`` (``loss_terms``), each built with ``data``. A plain object, not a
    module: it holds no state that a checkpoint would carry."""

    def __init__(self, terms: Sequence[LossTerm], data: LossData = LossData()) -> None:
        self.terms = list(terms)
        self.parts = [(term.entry.build(term.options, data), term.weight) for term in self.terms]

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        total = None
        for loss, factor in self.parts:
            value = loss(logits, labels)
            value = value if factor == 1 else factor * value
            total = value if total is None else total + value
        return total


def build_loss(
    loss: str | Mapping[str, Any], class_weights: Sequence[float] | None = None, crop: int | None = None
) -> PixelLoss:
    """The loss of a ``loss`` argument with ``class_weights`` (one per class, or None) at a training crop of
    ``crop`` px (None: not known)."""
    weights = None if class_weights is None else tuple(float(w) for w in class_weights)
    return PixelLoss(loss_terms(loss), LossData(weights, crop))
