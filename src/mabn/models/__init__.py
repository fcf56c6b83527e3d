"""Networks built with a chosen norm: ResNet-101 (stage 1) and PSPNet-101 (stage 2), or another ResNet depth
(``arch``, one of ``ARCHS``)."""

from .backbone import (
    BackboneError,
    check_backbone,
    key_differences,
    load_backbone,
    load_backbone_into,
    save_backbone,
)
from .pspnet import PSPNet
from .resnet import ARCHS, DEFAULT_ARCH, check_arch, logged_norms, norm_kwargs_for, resnet, resnet101

__all__ = [
    "PSPNet",
    "ARCHS",
    "DEFAULT_ARCH",
    "check_arch",
    "resnet",
    "resnet101",
    "norm_kwargs_for",
    "save_backbone",
    "load_backbone",
    "load_backbone_into",
    "check_backbone",
    "BackboneError",
    "key_differences",
    "logged_norms",
]
