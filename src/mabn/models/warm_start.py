"""A MABN network started from a BN network's weights (beyond the paper; docs/backbones.md, "Warm start").

``make pretrain NORM=mabn INIT=<file>`` re-pretrains briefly from a BN ResNet (torchvision's state dict, or a
stage-1 ``bn`` / ``bn32`` file) instead of for the recipe's 120 epochs from random weights; stage 2 converts a BN
backbone for a MABN encoder the same way and fine-tunes it (``backbone.converts``). The copy
(``backbone.seed_from_bn``):

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

from pathlib import Path

from torch import nn

from ..norm import NORM_PRESETS, norm_entry
from ..norm.factory import norms_where
from .backbone import STAGE1, Backbone, BackboneError, arch_title, read_backbone, seed_from_bn, warm_norm
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


def load_warm_start(model: nn.Module, path: str | Path, norm: str, arch: str = DEFAULT_ARCH) -> list[str]:
    """Start ``model`` (a ResNet ``arch`` built with the centring ``norm``) from the BN network at ``path``; returns
    the lines that say what it started from and what it could not copy."""
    backbone = check_init(path, norm, arch)
    try:
        notes = seed_from_bn(model, {**backbone.state_dict, **backbone.head}, backbone.eps)
    except BackboneError as err:
        raise BackboneError(f"--init {path}: {err}") from err
    return [f"Warm start from {path} ({backbone.describe()}): convs centred, MABN's chi^2 seeded from BN", *notes]
