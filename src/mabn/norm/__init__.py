"""Normalization layers: MABN and the norms it is compared with, conversion and folding."""

from .batchrenorm import BatchRenorm2d
from .cenconv import CenConv2d
from .convert import NORM_PRESETS, NormPreset, convert_norm, fold_norms
from .mabn import MABN2d

__all__ = ["MABN2d", "CenConv2d", "BatchRenorm2d", "convert_norm", "fold_norms", "NORM_PRESETS", "NormPreset"]
