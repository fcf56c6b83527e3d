"""The norms by name: ``NORM_PRESETS`` (the paper's comparisons and ablations) and ``create_norm``, which builds one
layer of a named norm (in the manner of timm's ``create_norm_layer``). ``convert_norm`` builds every norm it swaps
in through it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from .batchrenorm import BatchRenorm2d, GhostBatchNorm2d
from .mabn import MABN2d


@dataclass(frozen=True)
class NormPreset:
    """A named norm: the layer kind, fixed layer arguments, and whether convs get centred weights."""

    kind: str  # bn | syncbn | gn | brn | mabn
    description: str
    layer_kwargs: dict[str, Any] = field(default_factory=dict)
    centre_weights: bool = False


# The paper's comparisons (Tables 1, 2, 6 and the Cityscapes table) by name.
NORM_PRESETS: dict[str, NormPreset] = {
    "bn": NormPreset("bn", "BatchNorm; GhostBatchNorm2d when norm_batch_size is set"),
    "syncbn": NormPreset("syncbn", "BatchNorm synchronized across devices"),
    "gn": NormPreset("gn", "GroupNorm, 32 groups"),
    "brn": NormPreset("brn", "Batch Renormalization"),
    "mabn": NormPreset("mabn", "MABN: SMA statistics in BP, EMA in FP, centred conv weights", {}, True),
    "mabn_nowc": NormPreset("mabn", "MABN without centred conv weights", {}, False),
    "mbn": NormPreset("mabn", "modified BN (x / chi_B, batch statistics)", {"stats": "batch", "renorm": False}, True),
    "mbn_emas": NormPreset("mabn", "modified BN with EMAS in FP", {"stats": "batch", "renorm": True}, True),
    "mabn_smas": NormPreset("mabn", "modified BN, SMAS in FP and BP", {"stats": "sma", "renorm": False}, True),
    "mabn_emas": NormPreset("mabn", "modified BN, EMAS in FP and BP", {"stats": "ema", "renorm": True}, True),
}


def create_norm(name: str, channels: int, **options: Any) -> nn.Module:
    """One layer of the norm ``name`` (a key of ``NORM_PRESETS``) over ``channels`` channels.

    ``options`` are the layer's arguments over the preset's; ``momentum`` always in the paper's convention (the
    weight of the old value, converted for torch's BatchNorm), ``eps`` and ``norm_batch_size`` for every batch
    norm. ``bn`` with ``norm_batch_size`` is a ``GhostBatchNorm2d``; ``syncbn`` refuses one (it normalizes over
    all devices). An option that the layer does not take is a TypeError naming it.
    """
    if name not in NORM_PRESETS:
        raise ValueError(f"create_norm: unknown norm {name!r}; choose one of {sorted(NORM_PRESETS)}")
    preset = NORM_PRESETS[name]
    kind = preset.kind
    kw = {**preset.layer_kwargs, **options}
    momentum = kw.pop("momentum", None)
    eps = kw.pop("eps", 1e-5)
    norm_batch_size = kw.pop("norm_batch_size", None)
    managed = {"mabn": MABN2d, "brn": BatchRenorm2d, "bn": GhostBatchNorm2d if norm_batch_size else None}.get(kind)
    if managed is not None:
        if momentum is not None:
            kw["momentum"] = momentum
        return managed(channels, eps=eps, norm_batch_size=norm_batch_size, **kw)
    if kw:
        raise TypeError(f"create_norm: arguments {sorted(kw)} do not apply to norm {name!r}")
    torch_momentum = 0.1 if momentum is None else 1.0 - momentum
    if kind == "bn":
        return nn.BatchNorm2d(channels, eps=eps, momentum=torch_momentum)
    if kind == "syncbn":
        if norm_batch_size:
            raise ValueError("create_norm: syncbn normalizes over all devices; norm_batch_size does not apply")
        return nn.SyncBatchNorm(channels, eps=eps, momentum=torch_momentum)
    if kind == "gn":
        return nn.GroupNorm(math.gcd(32, channels), channels, eps=eps)
    raise AssertionError(kind)
