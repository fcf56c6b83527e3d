"""ResNet-101 (or another torchvision ResNet, the ``arch`` option) with any norm, keeping torchvision's
state-dict keys."""

from __future__ import annotations

from typing import Any

import segmentation_models_pytorch as smp
import timm
import torchvision
from torch import nn

from ..norm import NORMS, check_norm, convert_norm

# The ``arch`` model option of stage 1: torchvision's ResNets, which smp's encoders of the same names mirror key for
# key. The paper's network, and every default, is ResNet-101. Stage 2 takes any smp encoder (``check_encoder``).
ARCHS = ("resnet18", "resnet34", "resnet50", "resnet101", "resnet152")
TIMM_PREFIX = "tu-"  # smp's prefix for any timm model, as an encoder
DEFAULT_ARCH = "resnet101"


def check_arch(arch: str) -> str:
    """``arch`` when it is one of ``ARCHS``; otherwise a ValueError naming it and the choices."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHS)}")
    return arch


def check_encoder(arch: str) -> str:
    """``arch`` when smp builds an encoder of that name (its own encoders, ``ARCHS`` among them, or ``tu-`` and a
    timm model); otherwise a ValueError naming it and where the choices are listed."""
    known = arch in smp.encoders.get_encoder_names() or (
        arch.startswith(TIMM_PREFIX) and timm.is_model(arch.removeprefix(TIMM_PREFIX))
    )
    if not known:
        raise ValueError(
            f"unknown encoder arch {arch!r}: name an smp encoder (segmentation_models_pytorch.encoders."
            f"get_encoder_names()) or {TIMM_PREFIX}<a timm model> (timm.list_models()); see docs/models.md, Encoders"
        )
    return arch


def norm_kwargs_for(
    norm: str, norm_batch_size: int | None = None, norm_options: dict[str, dict[str, Any]] | None = None
) -> dict[str, Any]:
    """Layer arguments for ``convert_norm``: the options given for the norm's kind (e.g. "mabn" also
    covers the ablation presets built from MABN2d) plus the ghost-batch size where it applies: to a norm that
    normalizes over the batch (its entry's ``batch``)."""
    kind = check_norm(norm).kind
    kwargs = dict((norm_options or {}).get(kind, {}))
    if norm_batch_size and NORMS[kind].batch:
        kwargs["norm_batch_size"] = norm_batch_size
    return kwargs


def resnet(
    norm: str = "mabn",
    num_classes: int = 1000,
    norm_batch_size: int | None = None,
    norm_options: dict[str, dict[str, Any]] | None = None,
    zero_init_residual: bool = False,
    arch: str = DEFAULT_ARCH,
) -> nn.Module:
    """torchvision's ResNet ``arch`` (default ResNet-101; random init, never downloaded) with every norm replaced
    by ``norm``.

    torchvision initializes convs with Kaiming normal (fan_out) and norms with gamma 1 / beta 0 (the
    paper's choice); ``zero_init_residual`` zeroes the last gamma of each block instead (Goyal et al.),
    so each block starts as the identity. The conversion keeps those weights, and MABN presets centre
    the convs that feed a norm.
    """
    build = getattr(torchvision.models, check_arch(arch))
    model = build(weights=None, num_classes=num_classes, zero_init_residual=zero_init_residual)
    return convert_norm(model, norm, **norm_kwargs_for(norm, norm_batch_size, norm_options))


def resnet101(
    norm: str = "mabn",
    num_classes: int = 1000,
    norm_batch_size: int | None = None,
    norm_options: dict[str, dict[str, Any]] | None = None,
    zero_init_residual: bool = False,
) -> nn.Module:
    """``resnet`` at the paper's depth: ResNet-101."""
    return resnet(norm, num_classes, norm_batch_size, norm_options, zero_init_residual, arch="resnet101")


def logged_norms(names: list[str]) -> list[str]:
    """Of the qualified names of a network's norms (or of a LightningModule's, under ``model.``), those whose
    statistics are logged by default: the first norm under ResNet's ``layer1`` (an encoder without one: its first
    norm) and the first norm of each top-level part besides the ResNet (PSPNet's heads)."""

    def top(n: str) -> str:
        return n.split(".")[1] if n.startswith("model.") else n.split(".")[0]

    layer1 = next((n for n in names if ".layer1." in f".{n}"), None)
    chosen = [layer1 or next((n for n in names if top(n) == "encoder"), None)]
    parts: dict[str, str] = {}
    for n in names:
        if top(n) not in ("encoder", "layer1", "layer2", "layer3", "layer4", "bn1"):
            parts.setdefault(top(n), n)
    return [n for n in [*chosen, *parts.values()] if n is not None]
