"""MABN: Moving Average Batch Normalization for small-batch training (ICLR 2020), as a Lightning app.

``mabn.load(checkpoint)`` is a stage-2 checkpoint's predictor (``mabn.inference.predict.load``): imported on first
use, so that ``import mabn`` for the norms does not import Lightning, the models and the data pipeline.
"""

import os as _os

# albumentations asks the package index for a newer release on import: a training run reaches no network.
_os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")

from .norm import (
    NORM_PRESETS,
    BatchRenorm2d,
    CenConv2d,
    FrozenBatchNorm2d,
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
    "FrozenBatchNorm2d",
    "GhostBatchNorm2d",
    "create_norm",
    "convert_norm",
    "keep_centred",
    "fold_norms",
    "NORM_PRESETS",
    "load",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "load":
        from .inference.predict import load

        return load
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
