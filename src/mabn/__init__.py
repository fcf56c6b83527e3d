"""MABN: Moving Average Batch Normalization for small-batch training (ICLR 2020), as a Lightning app."""

import os as _os

# albumentations asks the package index for a newer release on import: a training run reaches no network.
_os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")

from .norm import (
    NORM_PRESETS,
    BatchRenorm2d,
    CenConv2d,
    GhostBatchNorm2d,
    MABN2d,
    convert_norm,
    create_norm,
    fold_norms,
)
from .norm.cenconv import keep_centred

__all__ = [
    "MABN2d",
    "CenConv2d",
    "BatchRenorm2d",
    "GhostBatchNorm2d",
    "create_norm",
    "convert_norm",
    "keep_centred",
    "fold_norms",
    "NORM_PRESETS",
]
__version__ = "0.1.0"
