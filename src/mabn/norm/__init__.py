"""Normalization layers: MABN and the norms it is compared with, the norms by name, conversion and folding."""

from .batchrenorm import BatchRenorm2d, GhostBatchNorm2d
from .cenconv import CenConv2d
from .convert import convert_norm, fold_norms
from .factory import (
    NORM_PRESETS,
    NORMS,
    NormEntry,
    NormPreset,
    check_norm,
    create_norm,
    norm_entry,
    register_norm,
    unregister_norm,
)
from .frozen import FrozenBatchNorm2d
from .mabn import MABN2d

__all__ = [
    "MABN2d",
    "CenConv2d",
    "BatchRenorm2d",
    "GhostBatchNorm2d",
    "FrozenBatchNorm2d",
    "create_norm",
    "convert_norm",
    "fold_norms",
    "NORM_PRESETS",
    "NormPreset",
    "NORMS",
    "NormEntry",
    "check_norm",
    "norm_entry",
    "register_norm",
    "unregister_norm",
]
