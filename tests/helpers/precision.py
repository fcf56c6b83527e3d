"""A loss scaler without autocast, for fits that compare exactly with unscaled ones."""

import contextlib

from pytorch_lightning.plugins.precision import MixedPrecision


class ScalingOnly(MixedPrecision):
    """``precision="16-mixed"`` with its real GradScaler but without autocast: float32 arithmetic, so that a run
    compares exactly with an unscaled one. Scaling by powers of two is exact in floating point."""

    def forward_context(self):
        return contextlib.nullcontext()
