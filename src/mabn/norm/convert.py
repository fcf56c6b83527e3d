"""Swap the norms of a built model (``convert_norm``) and fold them away for inference (``fold_norms``)."""

from __future__ import annotations

import copy
import logging
import sys
import warnings
from collections import Counter, OrderedDict
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from .cenconv import CenConv2d, conv_like
from .factory import NormEntry, check_norm, create_norm, entry_of, layer_classes, norm_entry

_BATCH_NORMS = (nn.BatchNorm2d, nn.SyncBatchNorm)  # the layers convert_norm replaces (with timm's subclasses)
log = logging.getLogger(__name__)
# LayerNorms over the channels of an NCHW map (smp's UPerNet and timm build them): a 2d norm can take their place,
# which ``convert_norm`` does only when asked (``layer_norms=True``), since it changes what they normalize over.
_CHANNEL_LAYER_NORMS = (
    ("segmentation_models_pytorch.decoders.upernet.decoder", "LayerNorm2d"),
    ("timm.layers", "LayerNorm2d"),
)
# timm's fused norm and activation (EfficientNet, RegNet, MobileNetV3).
_NORM_ACTS = (("timm.layers", "BatchNormAct2d"), ("timm.layers", "SyncBatchNormAct"))


def _loaded(classes: tuple[tuple[str, str], ...]) -> tuple[type, ...]:
    """The classes (module, name) whose module is imported: a model can hold instances of no other, so the
    libraries that define them (smp, timm, seconds of imports) are never imported here."""
    return tuple(getattr(sys.modules[m], name) for m, name in classes if m in sys.modules)


class NormAct(nn.Sequential):
    """A converted norm followed by the dropout and activation that timm's fused BatchNormAct2d (or SyncBatchNormAct)
    applied after its normalization (timm's EfficientNet, RegNet and MobileNetV3 use it): the norm stays a layer of
    its own, which centring and folding pair with the conv before it."""

    def __init__(self, norm: nn.Module, drop: nn.Module, act: nn.Module) -> None:
        super().__init__(OrderedDict(norm=norm, drop=drop, act=act))


def _num_channels(norm: nn.Module) -> int:
    if isinstance(norm, nn.LayerNorm):
        return norm.normalized_shape[0]
    return norm.num_channels if isinstance(norm, nn.GroupNorm) else norm.num_features


def _fed_norms(
    model: nn.Module, norms: tuple[type[nn.Module], ...] | None = None
) -> Iterator[tuple[nn.Module, str, nn.Module, str]]:
    """(parent, layer name, norm parent, norm name) for every conv or transposed conv registered right before the
    norm it feeds (inside a ``NormAct`` after a conversion), of the types ``norms`` (default: every registered
    norm's layers).

    torchvision's ResNet (conv1/bn1, downsample.0/.1), smp's Conv2dReLU (conv, norm, act) and timm's blocks
    (conv_pw/bn1, conv/bn) register each conv directly before its norm, with matching channels; that is the
    pairing used here.
    """
    norms = layer_classes() if norms is None else norms
    for parent in model.modules():
        children = list(parent.named_children())
        for (conv_name, conv), (norm_name, norm) in zip(children, children[1:]):
            holder = parent
            if isinstance(norm, NormAct):
                holder, norm_name, norm = norm, "norm", norm.norm
            if (
                isinstance(conv, nn.Conv2d | nn.ConvTranspose2d)
                and isinstance(norm, norms)
                and conv.out_channels == _num_channels(norm)
            ):
                yield parent, conv_name, holder, norm_name


def _conv_norm_pairs(model: nn.Module) -> Iterator[tuple[nn.Module, str, nn.Module, str]]:
    """``_fed_norms`` of the convs (not transposed): the pairs that centring and folding act on."""
    for parent, conv_name, holder, norm_name in _fed_norms(model):
        if isinstance(getattr(parent, conv_name), nn.Conv2d):
            yield parent, conv_name, holder, norm_name


def _centrable(conv: nn.Module) -> bool:
    """Whether ``conv`` can become a CenConv2d: a plain Conv2d (a subclass has its own forward, e.g. smp's
    EfficientNet's static same padding, which CenConv2d's would drop) whose filters hold more than one weight
    (a one-weight filter, a 1x1 depthwise conv, is zero once centred)."""
    return type(conv) is nn.Conv2d and conv.weight[0].numel() > 1


def _copy_state(old: nn.Module, new: nn.Module, entry: NormEntry) -> None:
    """Carry over gamma/beta always, and running statistics where the new norm's entry takes them (``from_bn``)."""
    with torch.no_grad():
        if getattr(old, "weight", None) is not None and getattr(new, "weight", None) is not None:
            new.weight.copy_(old.weight)
            new.bias.copy_(old.bias)
        if isinstance(old, _BATCH_NORMS) and old.running_var is not None and entry.from_bn is not None:
            entry.from_bn(old, new)


def convert_norm(
    model: nn.Module,
    norm: str,
    centralize_weights: bool | None = None,
    *,
    layer_norms: bool = False,
    **kwargs: Any,
) -> nn.Module:
    """Replace every BatchNorm2d of ``model`` (in place) by the norm named ``norm``; returns ``model``.

    ``norm`` is a key of ``NORM_PRESETS`` (bn, syncbn, gn, brn, mabn and the ablation variants); every new layer
    is ``create_norm(norm, channels, **kwargs)`` (momentum always in the paper's convention: the weight of the old
    value, converted for torch's BatchNorm). timm's BatchNormAct2d becomes a ``NormAct``: the new norm, then its
    dropout and activation. For MABN presets, convs that feed a norm become CenConv2d sharing their weights,
    unless ``centralize_weights=False``; a norm fed by a layer that cannot be centred (a transposed conv, a conv
    subclass with its own forward, a one-weight filter) is converted all the same, with one warning naming those
    layers. Gamma and beta are kept; BN running statistics are carried as the norm's entry says (``from_bn``: bn,
    syncbn, frozenbn and brn take them; MABN's running_var is a second moment, not a variance, and it takes none).
    LayerNorms stay unless ``layer_norms=True``, which converts those over an NCHW map's channels (smp's and timm's
    LayerNorm2d) too; a LayerNorm over tokens always stays.

    One INFO line of this module's logger counts what was converted, by kind, and what was kept; a warning says
    when nothing was converted.
    """
    preset = check_norm(norm)
    entry = norm_entry(norm)
    centre = preset.centre_weights if centralize_weights is None else centralize_weights
    names = {id(m): n for n, m in model.named_modules()}

    channel_layer_norms, norm_acts = _loaded(_CHANNEL_LAYER_NORMS), _loaded(_NORM_ACTS)
    centred, uncentred = 0, []
    if centre:
        paired = (*layer_classes(), *channel_layer_norms) if layer_norms else layer_classes()
        for parent, layer_name, _, _ in list(_fed_norms(model, paired)):
            layer = getattr(parent, layer_name)
            if _centrable(layer):
                setattr(parent, layer_name, CenConv2d.from_conv(layer))
                centred += 1
            elif not isinstance(layer, CenConv2d):
                uncentred.append(f"{names[id(layer)]} ({type(layer).__name__})")

    converted: Counter[str] = Counter()
    kept: Counter[str] = Counter()
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            convert = isinstance(child, _BATCH_NORMS) or (layer_norms and isinstance(child, channel_layer_norms))
            if isinstance(child, nn.LayerNorm) and not convert:
                kept[type(child).__name__] += 1
            if not convert:
                continue
            channels = child.num_features if isinstance(child, _BATCH_NORMS) else child.normalized_shape[0]
            new = create_norm(norm, channels, **kwargs)
            device = child.weight.device if child.weight is not None else None
            # Moved only where it was built elsewhere: inside a meta build a move to where it is already costs a
            # Python call of the build's torch function modes per tensor op.
            if device is not None and any(t.device != device for t in (*new.parameters(), *new.buffers())):
                new.to(device=device)
            _copy_state(child, new, entry)
            new.train(child.training)
            if isinstance(child, norm_acts):
                new = NormAct(new, child.drop, child.act).train(child.training)
            setattr(parent, name, new)
            converted[type(child).__name__] += 1

    if uncentred:
        warnings.warn(
            f"convert_norm: {len(uncentred)} norm(s) converted to {norm} after a layer that cannot be centred, "
            f"so their inputs are not centred: {', '.join(uncentred)}",
            stacklevel=2,
        )
    done = ", ".join(f"{n} {kind}" for kind, n in converted.items())
    left = f"; kept {', '.join(f'{n} {kind}' for kind, n in kept.items())}" if kept else ""
    hint = " (layer_norms=True converts channel LayerNorm2d)" if kept and not layer_norms else ""
    if not converted:
        warnings.warn(
            f"convert_norm: converted nothing to {norm}: {type(model).__name__} has no BatchNorm2d{left}{hint}",
            stacklevel=2,
        )
    else:
        log.info("convert_norm: %s -> %s, %d conv(s) centred%s%s", done, norm, centred, left, hint)
    return model


def _inference_affine(norm: nn.Module) -> tuple[Tensor, Tensor]:
    """(scale, shift) per channel of a linear norm in eval mode, as its entry computes them, in float64."""
    scale, shift = entry_of(norm).inference_affine(norm)
    return scale.detach().double(), shift.detach().double()


def _plain_conv(conv: nn.Conv2d, weight: Tensor, bias: Tensor | None) -> nn.Conv2d:
    if type(conv) not in (nn.Conv2d, CenConv2d):
        # a conv subclass has a forward of its own (e.g. static same padding): keep it, with the new weights
        conv.weight = nn.Parameter(weight.to(conv.weight.dtype))
        conv.bias = None if bias is None else nn.Parameter(bias.to(conv.weight.dtype))
        return conv
    new = conv_like(nn.Conv2d, conv, bias=bias is not None)
    with torch.no_grad():
        new.weight.copy_(weight)
        if bias is not None:
            new.bias.copy_(bias)
    return new


def fold_norms(model: nn.Module) -> nn.Module:
    """An eval-mode copy of ``model`` with every norm that is linear at inference folded into its conv.

    The norms whose entry is linear at inference (BN, SyncBN, BatchRenorm2d and MABN2d) become part of the
    preceding conv (centred weights first for CenConv2d), leaving a plain ``nn.Conv2d`` with bias; GroupNorm
    stays, since it needs per-sample statistics. Remaining CenConv2d become plain convs with their centred
    weights, and a linear norm with no conv before it becomes a depthwise 1x1 conv, so no norm or centring cost
    is left.
    """
    model = copy.deepcopy(model).eval()
    linear = layer_classes(lambda entry: entry.linear)
    with torch.no_grad():
        for parent, conv_name, holder, norm_name in list(_conv_norm_pairs(model)):
            conv, norm = getattr(parent, conv_name), getattr(holder, norm_name)
            if not isinstance(norm, linear):
                continue
            scale, shift = _inference_affine(norm)
            w = conv.centred_weight() if isinstance(conv, CenConv2d) else conv.weight
            bias = shift if conv.bias is None else conv.bias.double() * scale + shift
            folded = w.double() * scale.view(-1, 1, 1, 1)
            setattr(parent, conv_name, _plain_conv(conv, folded, bias))
            setattr(holder, norm_name, nn.Identity())

        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, CenConv2d):
                    setattr(parent, name, _plain_conv(child, child.centred_weight(), child.bias))
                elif isinstance(child, linear):
                    c = child.num_features
                    scale, shift = _inference_affine(child)
                    dw = nn.Conv2d(c, c, 1, groups=c, bias=True, device=scale.device, dtype=child.weight.dtype)
                    dw.weight.copy_(scale.view(c, 1, 1, 1))
                    dw.bias.copy_(shift)
                    setattr(parent, name, dw)
    return model
