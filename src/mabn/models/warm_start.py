"""A MABN network started from a BN network's weights (beyond the paper; docs/backbones.md, "Warm start").

``make pretrain NORM=mabn INIT=<file>`` re-pretrains briefly from a BN ResNet (torchvision's state dict, or a
stage-1 ``bn`` / ``bn32`` file) instead of for the recipe's 120 epochs from random weights; stage 2 converts a BN
backbone for a MABN encoder the same way and fine-tunes it (``backbone.converts``). The copy:

- convs: each filter minus its mean over (in_channels, kH, kW), the weights a centred conv (``CenConv2d``) computes
  with anyway, stored centred. Centring changes what every conv computes, which is why the network is trained after
  the copy, never used as it is;
- norms: BN's gamma and beta become MABN's weight and bias; MABN's forward statistics, estimates of the second
  moment chi^2 = E[x^2] of the conv's output, are seeded with BN's running variance: the EMA (``running_var``)
  and every slot of the SMA's ring buffer (``buffer_x2``), whose count says it is full. The variance, not
  E[x^2] = var + mean^2 of the uncentred output, because centring the filters is what keeps the output's mean near
  0 (the reason MABN may drop the mean), so the centred output's second moment is near BN's variance. The backward
  statistics (psi) have no BN counterpart: their streams start empty;
- the classifier, where the file holds one of the network's shape (torchvision's ``fc``); otherwise it keeps its
  random weights.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor, nn

from ..norm import NORM_PRESETS, CenConv2d, MABN2d, norm_entry
from ..norm.factory import norms_where
from .backbone import STAGE1, Backbone, BackboneError, arch_title, read_backbone, warm_norm
from .resnet import DEFAULT_ARCH


def check_init(path: str | Path, norm: str, arch: str = DEFAULT_ARCH) -> Backbone:
    """The BN network at ``path`` (read by ``read_backbone``), checked to warm-start a ResNet ``arch`` of ``norm``;
    ``BackboneError`` naming the file otherwise (a missing or foreign file, another norm, another depth)."""
    if not warm_norm(norm):
        centring = ", ".join(n for n in NORM_PRESETS if warm_norm(n))
        raise BackboneError(
            f"--init {path}: a warm start centres a BN network's convs and seeds MABN's statistics, so it starts a "
            f"centring MABN norm ({centring}), not {norm!r}: train {norm} from scratch (drop INIT) or use NORM=mabn"
        )
    backbone = read_backbone(path, arch)
    if backbone.source == STAGE1 and not norm_entry(backbone.norm).bn_statistics:
        sources = " or ".join(norms_where(lambda entry: entry.bn_statistics))
        raise BackboneError(
            f"--init {path} is a stage-1 file of norm {backbone.norm!r}: a warm start takes a BN network (a stage-1 "
            f"{sources} file, e.g. of NORM=bn32, or torchvision's {arch_title(arch)} state dict)"
        )
    if backbone.arch != arch:
        raise BackboneError(
            f"arch mismatch: --init {path} is a stage-1 {backbone.arch} file, but the model is {arch}: set the "
            f"model's arch to {backbone.arch} or pre-train BN with arch {arch}"
        )
    return backbone


def _take(state: Mapping[str, Tensor], key: str, like: Tensor) -> Tensor:
    """``state[key]`` in ``like``'s dtype; ``BackboneError`` when it is missing or of another shape."""
    if key not in state:
        raise BackboneError(f"the BN network has no {key}: it is not the network being warm-started")
    value = state[key]
    if value.shape != like.shape:
        raise BackboneError(f"the BN network's {key} is {tuple(value.shape)}, the network's {tuple(like.shape)}")
    return value.to(like.dtype)


def bn_variance(state: Mapping[str, Tensor], prefix: str, eps: float, like: Tensor) -> Tensor:
    """The BN layer ``prefix``'s running variance in ``like``'s dtype: ``running_var`` (BatchNorm), or
    ``running_std`` ** 2 - ``eps`` (BatchRenorm2d and ghost-batch BN keep the std with the source's eps inside)."""
    if f"{prefix}running_var" not in state and f"{prefix}running_std" in state:
        std = _take(state, f"{prefix}running_std", like).double()
        return (std.square() - eps).clamp_min(0.0).to(like.dtype)  # clamp: a std rounded below sqrt(eps)
    return _take(state, f"{prefix}running_var", like)


@torch.no_grad()
def seed_from_bn(model: nn.Module, state: Mapping[str, Tensor], eps: float) -> list[str]:
    """Copy the BN network ``state`` (its layers' keys as ``model``'s; BN's ``eps``) into ``model``, whose norms are
    MABN2d and whose convs feeding them are centred (see the module's description). Returns what was not copied, as
    lines to report (a classifier of another shape)."""
    notes = []
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(module, MABN2d):
            var = bn_variance(state, prefix, eps, module.running_var)
            module.reset_stream(reset_ema=True)  # psi's streams start empty; the chi^2 streams take the seed
            module.weight.copy_(_take(state, f"{prefix}weight", module.weight))
            module.bias.copy_(_take(state, f"{prefix}bias", module.bias))
            module.running_var.copy_(var)
            module.buffer_x2.copy_(var.expand_as(module.buffer_x2))
            module.count_x2.fill_(module.buffer_size)  # the SMA counts as full: moving statistics from step 1
        elif isinstance(module, nn.Conv2d):
            weight = _take(state, f"{prefix}weight", module.weight)
            if isinstance(module, CenConv2d):
                weight = weight - weight.mean(dim=(1, 2, 3), keepdim=True)  # the filter CenConv2d convolves with
            module.weight.copy_(weight)
            if module.bias is not None:
                module.bias.copy_(_take(state, f"{prefix}bias", module.bias))
        elif isinstance(module, nn.Linear):
            key = f"{prefix}weight"
            if key in state and state[key].shape == module.weight.shape:
                module.weight.copy_(state[key])
                module.bias.copy_(_take(state, f"{prefix}bias", module.bias))
            else:
                found = f"of shape {tuple(state[key].shape)}" if key in state else "none"
                notes.append(
                    f"classifier {name or 'fc'}: the file's is {found}, the network's {tuple(module.weight.shape)}; "
                    "it starts from random weights"
                )
    return notes


def load_warm_start(model: nn.Module, path: str | Path, norm: str, arch: str = DEFAULT_ARCH) -> list[str]:
    """Start ``model`` (a ResNet ``arch`` built with the centring ``norm``) from the BN network at ``path``; returns
    the lines that say what it started from and what it could not copy."""
    backbone = check_init(path, norm, arch)
    try:
        notes = seed_from_bn(model, {**backbone.state_dict, **backbone.head}, backbone.eps)
    except BackboneError as err:
        raise BackboneError(f"--init {path}: {err}") from err
    return [f"Warm start from {path} ({backbone.describe()}): convs centred, MABN's chi^2 seeded from BN", *notes]
