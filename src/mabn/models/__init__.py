"""Networks built with a chosen norm: ResNet-101 (stage 1, or another ResNet depth of ``ARCHS``) and PSPNet-101
(stage 2, on any smp encoder: ``check_encoder``); stage 2 also on the other decoders of ``DECODERS``
(``build_segmentation_model``)."""

from .backbone import (
    BackboneError,
    check_backbone,
    key_differences,
    load_backbone,
    load_backbone_into,
    save_backbone,
)
from .decoders import DECODERS, DEFAULT_DECODER, Decoder, DecoderNet, build_segmentation_model, resolve_decoder
from .pspnet import PSPNet
from .resnet import ARCHS, DEFAULT_ARCH, check_arch, check_encoder, logged_norms, norm_kwargs_for, resnet, resnet101
from .undrawn import Undrawn

__all__ = [
    "PSPNet",
    "DecoderNet",
    "Decoder",
    "DECODERS",
    "DEFAULT_DECODER",
    "build_segmentation_model",
    "resolve_decoder",
    "ARCHS",
    "DEFAULT_ARCH",
    "check_arch",
    "check_encoder",
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
    "Undrawn",
]
