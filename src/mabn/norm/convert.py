"""Swap the norms of a built model (``convert_norm``) and fold them away for inference (``fold_norms``)."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from .batchrenorm import BatchRenorm2d
from .cenconv import CenConv2d, conv_like
from .factory import NORM_PRESETS, create_norm
from .mabn import MABN2d

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

    ``norm`` is a key of ``NORM_PRESETS`` (bn, syncbn, gn, brn, mabn and the ablation variants); every new layer
    is ``create_norm(norm, channels, **kwargs)`` (momentum always in the paper's convention: the weight of the old
    value, converted for torch's BatchNorm). For MABN presets, convs that feed a norm become CenConv2d
    sharing their weights, unless ``centralize_weights=False``. Gamma and beta are kept; BN running
    statistics are kept only for bn/syncbn/brn (MABN's running_var is a second moment, not a variance).
    """
    if norm not in NORM_PRESETS:
        raise ValueError(f"convert_norm: unknown norm {norm!r}; choose one of {sorted(NORM_PRESETS)}")
    centre = NORM_PRESETS[norm].centre_weights if centralize_weights is None else centralize_weights

    if centre:
        for parent, conv_name, _ in list(_conv_norm_pairs(model)):
            conv = getattr(parent, conv_name)
            if type(conv) is nn.Conv2d:
                setattr(parent, conv_name, CenConv2d.from_conv(conv))

    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, _BATCH_NORMS):
                new = create_norm(norm, child.num_features, **kwargs)
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
            w = conv.centred_weight() if isinstance(conv, CenConv2d) else conv.weight
            bias = shift if conv.bias is None else conv.bias.double() * scale + shift
            folded = w.double() * scale.view(-1, 1, 1, 1)
            setattr(parent, conv_name, _plain_conv(conv, folded, bias))
            setattr(parent, norm_name, nn.Identity())

        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, CenConv2d):
                    setattr(parent, name, _plain_conv(child, child.centred_weight(), child.bias))
                elif isinstance(child, _LINEAR_NORMS):
                    c = child.num_features
                    scale, shift = _inference_affine(child)
                    dw = nn.Conv2d(c, c, 1, groups=c, bias=True, device=scale.device, dtype=child.weight.dtype)
                    dw.weight.copy_(scale.view(c, 1, 1, 1))
                    dw.bias.copy_(shift)
                    setattr(parent, name, dw)
    return model
