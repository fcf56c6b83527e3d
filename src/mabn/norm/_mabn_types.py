"""The records a MABN2d training step passes between its statistic maths, its autograd Function and its Triton
kernels (``mabn.py``, ``mabn_kernels.py``): named, so that no caller unpacks a tuple by position."""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor

STATS = ("batch", "sma", "ema")
EMA_STARTS = ("one", "first")


class StepConfig(NamedTuple):
    """A training step's settings besides its tensors (``MABN2d.step_config``)."""

    stats: str  # the statistic for the normalizer and psi: one of STATS
    momentum: float
    eps: float
    renorm: bool
    renorm_clip: float
    buffer_size: int
    ema_start: str  # one of EMA_STARTS: the EMA's value before the first statistic of a stream
    # The callback's (moving averages, renormalize) flags on the device, or None: the layer's own timeline below.
    policy: Tensor | None
    warmup_iters: int
    renorm_warmup_iters: int

    def first_steps(self) -> tuple[int, int]:
        """The layer's own timeline as ``phase``'s first steps (moving statistics, renormalization): the moving
        statistics from forward ``warmup_iters``, r = 1 for the first ``renorm_warmup_iters`` forwards."""
        return self.warmup_iters, self.renorm_warmup_iters + 1


class ForwardStats(NamedTuple):
    """A training forward's statistics, per normalization group (G) and channel (C), in the statistics' dtype."""

    chi2: Tensor  # (G, C) each group's own second moment
    var: Tensor  # (G, C) the second moment it is normalized by: its own, or the SMA / EMA of the stream
    r: Tensor  # (G, C) the renormalization factor, a constant in backward
    active: Tensor  # (G,) whether the group uses the moving statistic (bool, or 0/1 floats from the kernel)
    ema: Tensor  # (C,) the EMA after this forward (what inference divides by)
    ok: Tensor | None  # 0-d bool: every statistic finite; None where a kernel recorded it in the layer's flags


class NativeBackward(NamedTuple):
    """What the native BatchNorm backward kernel needs, per (sample, channel): it sees x as one sample of N * C
    channels, each normalized by its group's var with affine weight * r, and no mean."""

    weight: Tensor  # (N * C,) weight * r
    var: Tensor  # (N * C,)
    mean: Tensor  # (N * C,) zeros


class BackwardStats(NamedTuple):
    """A backward's statistics and the gradients they give."""

    coef: Tensor  # (N, C, 1, 1): dL/dx = g / sqrt(var + eps) + x * coef
    grad_weight: Tensor  # (C,)
    grad_bias: Tensor  # (C,)
    psi: Tensor  # (G, C) each group's own psi = mean(g * z)
    psi_bar: Tensor  # (G, C) the psi each group's gradient uses (its own, or the SMA / EMA of the stream)
    ok: Tensor | None  # as in ForwardStats
