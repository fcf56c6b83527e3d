"""Swap the norms of a built model (``convert_norm``) and fold them away for inference (``fold_norms``)."""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from .batchrenorm import BatchRenorm2d
from .cenconv import CenConv2d, conv_like
from .mabn import MABN2d


@dataclass(frozen=True)
class NormPreset:
    """A named norm: the layer kind, fixed layer arguments, and whether convs get centred weights."""

    kind: str  # bn | syncbn | gn | brn | mabn
    description: str
    layer_kwargs: dict[str, Any] = field(default_factory=dict)
    centralize_weights: bool = False


# The paper's comparisons (Tables 1, 2, 6 and the Cityscapes table) by name.
NORM_PRESETS: dict[str, NormPreset] = {
    "bn": NormPreset("bn", "BatchNorm; ghost-batch BN when norm_batch_size is set"),
    "syncbn": NormPreset("syncbn", "BatchNorm synchronized across devices"),
    "gn": NormPreset("gn", "GroupNorm, 32 groups"),
    "brn": NormPreset("brn", "Batch Renormalization"),
    "mabn": NormPreset("mabn", "MABN: SMA statistics in BP, EMA in FP, centred conv weights", {}, True),
    "mabn_nowc": NormPreset("mabn", "MABN without weight centralization", {}, False),
    "mbn": NormPreset("mabn", "modified BN (x / chi_B, batch statistics)", {"stats": "batch", "renorm": False}, True),
    "mbn_emas": NormPreset("mabn", "modified BN with EMAS in FP", {"stats": "batch", "renorm": True}, True),
    "mabn_smas": NormPreset("mabn", "modified BN, SMAS in FP and BP", {"stats": "sma", "renorm": False}, True),
    "mabn_emas": NormPreset("mabn", "modified BN, EMAS in FP and BP", {"stats": "ema", "renorm": True}, True),
}

_BATCH_NORMS = (nn.BatchNorm2d, nn.SyncBatchNorm)
_LINEAR_NORMS = (nn.BatchNorm2d, nn.SyncBatchNorm, BatchRenorm2d, MABN2d)
_ALL_NORMS = (*_LINEAR_NORMS, nn.GroupNorm)


def _num_channels(norm: nn.Module) -> int:
    return norm.num_channels if isinstance(norm, nn.GroupNorm) else norm.num_features


def _conv_norm_pairs(model: nn.Module) -> Iterator[tuple[nn.Module, str, str]]:
    """(parent, conv name, norm name) for every conv registered right before the norm it feeds.

    torchvision's ResNet (conv1/bn1, downsample.0/.1) and smp's Conv2dReLU (conv, norm, act) register
    each conv directly before its norm, with matching channels; that is the pairing used here.
    """
    for parent in model.modules():
        children = list(parent.named_children())
        for (conv_name, conv), (norm_name, norm) in zip(children, children[1:]):
            if (
                isinstance(conv, nn.Conv2d)
                and isinstance(norm, _ALL_NORMS)
                and conv.out_channels == _num_channels(norm)
            ):
                yield parent, conv_name, norm_name


def _make_norm(kind: str, c: int, kwargs: dict[str, Any]) -> nn.Module:
    kw = dict(kwargs)
    momentum = kw.pop("momentum", None)  # the paper's convention: weight of the old value
    eps = kw.pop("eps", 1e-5)
    norm_batch_size = kw.pop("norm_batch_size", None)
    if kind == "mabn":
        if momentum is not None:
            kw["momentum"] = momentum
        return MABN2d(c, eps=eps, norm_batch_size=norm_batch_size, **kw)
    if kind == "brn" or (kind == "bn" and norm_batch_size):
        if kind == "bn":  # ghost-batch BN: renormalization switched off
            kw.update(r_max=1.0, d_max=0.0)
        if momentum is not None:
            kw["momentum"] = momentum
        return BatchRenorm2d(c, eps=eps, norm_batch_size=norm_batch_size, **kw)
    if kw:
        raise TypeError(f"convert_norm: arguments {sorted(kw)} do not apply to norm {kind!r}")
    torch_momentum = 0.1 if momentum is None else 1.0 - momentum
    if kind == "bn":
        return nn.BatchNorm2d(c, eps=eps, momentum=torch_momentum)
    if kind == "syncbn":
        if norm_batch_size:
            raise ValueError("convert_norm: syncbn normalizes over all devices; norm_batch_size does not apply")
        return nn.SyncBatchNorm(c, eps=eps, momentum=torch_momentum)
    if kind == "gn":
        return nn.GroupNorm(math.gcd(32, c), c, eps=eps)
    raise AssertionError(kind)


def _copy_state(old: nn.Module, new: nn.Module) -> None:
    """Carry over gamma/beta always, and running statistics where both sides mean the same thing."""
    with torch.no_grad():
        if getattr(old, "weight", None) is not None and getattr(new, "weight", None) is not None:
            new.weight.copy_(old.weight)
            new.bias.copy_(old.bias)
        if isinstance(old, _BATCH_NORMS) and old.running_var is not None:
            if isinstance(new, _BATCH_NORMS):
                new.running_mean.copy_(old.running_mean)
                new.running_var.copy_(old.running_var)
            elif isinstance(new, BatchRenorm2d):
                new.running_mean.copy_(old.running_mean)
                new.running_std.copy_((old.running_var + new.eps).sqrt())


def convert_norm(model: nn.Module, norm: str, centralize_weights: bool | None = None, **kwargs: Any) -> nn.Module:
    """Replace every BatchNorm2d of ``model`` (in place) by the norm named ``norm``; returns ``model``.

    ``norm`` is a key of ``NORM_PRESETS`` (bn, syncbn, gn, brn, mabn and the ablation variants).
    ``kwargs`` go to the new layers (momentum always in the paper's convention: the weight of the old
    value, converted for torch's BatchNorm). For MABN presets, convs that feed a norm become CenConv2d
    sharing their weights, unless ``centralize_weights=False``. Gamma and beta are kept; BN running
    statistics are kept only for bn/syncbn/brn (MABN's running_var is a second moment, not a variance).
    """
    if norm not in NORM_PRESETS:
        raise ValueError(f"convert_norm: unknown norm {norm!r}; choose one of {sorted(NORM_PRESETS)}")
    preset = NORM_PRESETS[norm]
    layer_kwargs = {**preset.layer_kwargs, **kwargs}
    centralize = preset.centralize_weights if centralize_weights is None else centralize_weights

    if centralize:
        for parent, conv_name, _ in list(_conv_norm_pairs(model)):
            conv = getattr(parent, conv_name)
            if type(conv) is nn.Conv2d:
                setattr(parent, conv_name, CenConv2d.from_conv(conv))

    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, _BATCH_NORMS):
                new = _make_norm(preset.kind, child.num_features, layer_kwargs)
                new.to(device=child.weight.device if child.weight is not None else None)
                _copy_state(child, new)
                new.train(child.training)
                setattr(parent, name, new)
    return model


def _inference_affine(norm: nn.Module) -> tuple[Tensor, Tensor]:
    """(scale, shift) per channel of a linear norm in eval mode, in float64."""
    if isinstance(norm, _BATCH_NORMS):
        if norm.running_var is None:
            raise ValueError(f"fold_norms: {norm} tracks no running statistics, so it is not linear at inference")
        scale = (norm.running_var.double() + norm.eps).rsqrt()
        weight = norm.weight.double() if norm.weight is not None else torch.ones_like(scale)
        bias = norm.bias.double() if norm.bias is not None else torch.zeros_like(scale)
        return weight * scale, bias - norm.running_mean.double() * weight * scale
    scale, shift = norm.inference_affine()
    return scale.detach().double(), shift.detach().double()


def _plain_conv(conv: nn.Conv2d, weight: Tensor, bias: Tensor | None) -> nn.Conv2d:
    new = conv_like(nn.Conv2d, conv, bias=bias is not None)
    with torch.no_grad():
        new.weight.copy_(weight)
        if bias is not None:
            new.bias.copy_(bias)
    return new


def fold_norms(model: nn.Module) -> nn.Module:
    """An eval-mode copy of ``model`` with every norm that is linear at inference folded into its conv.

    BN, SyncBN, BatchRenorm2d and MABN2d become part of the preceding conv (centred weights first for
    CenConv2d), leaving a plain ``nn.Conv2d`` with bias; GroupNorm stays, since it needs per-sample
    statistics. Remaining CenConv2d become plain convs with their centred weights, and a linear norm
    with no conv before it becomes a depthwise 1x1 conv, so no norm or centring cost is left.
    """
    model = copy.deepcopy(model).eval()
    with torch.no_grad():
        for parent, conv_name, norm_name in list(_conv_norm_pairs(model)):
            conv, norm = getattr(parent, conv_name), getattr(parent, norm_name)
            if not isinstance(norm, _LINEAR_NORMS):
                continue
            scale, shift = _inference_affine(norm)
            w = conv.centered_weight() if isinstance(conv, CenConv2d) else conv.weight
            bias = shift if conv.bias is None else conv.bias.double() * scale + shift
            folded = w.double() * scale.view(-1, 1, 1, 1)
            setattr(parent, conv_name, _plain_conv(conv, folded, bias))
            setattr(parent, norm_name, nn.Identity())

        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, CenConv2d):
                    setattr(parent, name, _plain_conv(child, child.centered_weight(), child.bias))
                elif isinstance(child, _LINEAR_NORMS):
                    c = child.num_features
                    scale, shift = _inference_affine(child)
                    dw = nn.Conv2d(c, c, 1, groups=c, bias=True, device=scale.device, dtype=child.weight.dtype)
                    dw.weight.copy_(scale.view(c, 1, 1, 1))
                    dw.bias.copy_(shift)
                    setattr(parent, name, dw)
    return model
