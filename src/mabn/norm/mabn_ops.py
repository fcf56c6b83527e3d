"""MABN2d's statistic steps under ``torch.compile`` (CUDA): ``mabn_kernels``' two launches as custom operators.

Traced as torch ops, a layer's statistic steps are ~40 small operations per direction on (G, C) tensors, which the
compiler fuses into several kernels per layer and compiles for every layer shape: on PSPNet-101 MABN's first
compiled step took 3.7x BN's and its step 1.12x (docs/bench-compiled-cuda.md). Here each direction is one operator
that the compiler does not trace into: its implementation is the kernel's one launch, and what the compiler sees
is the shape of its outputs and the buffers it updates in place. The passes over the activations stay torch ops
(``row_kernels``' formulas, computed in float32, or float64 for float64, and rounded once), which the compiler
fuses with the operations around them.

The interface is ``mabn_kernels``': ``MABN2d`` calls either module alike.
"""

# No "from __future__ import annotations": torch.library reads the operators' annotations as objects.
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from . import mabn_kernels as kernels
from ._mabn_types import BackwardStats, ForwardStats, StepConfig

__all__ = ["backward_stats", "forward_stats", "grad_input", "row_sums", "scale_shift"]


@torch.library.custom_op("mabn::forward_stats", mutates_args=("streams", "agreement"))
def _forward(
    norm: Tensor,
    weight: Tensor,
    streams: list[Tensor],
    agreement: list[Tensor],
    policy: Tensor,
    groups: int,
    buffer_size: int,
    hw: int,
    stats: str,
    momentum: float,
    eps: float,
    renorm: bool,
    renorm_clip: float,
    ema_start: str,
    has_policy: bool,
    warmup_iters: int,
    renorm_warmup_iters: int,
) -> Tensor:
    """``mabn_kernels.forward_launch`` on the chi^2 stream (history, EMA, step and statistic counters) and the
    (non-finite flags, tickets): its outputs' one allocation (``forward_sizes``)."""
    cfg = StepConfig(
        stats, momentum, eps, renorm, renorm_clip, buffer_size, ema_start, policy if has_policy else None,
        warmup_iters, renorm_warmup_iters,
    )  # fmt: skip
    packed = _forward_allocation(norm, streams, groups, buffer_size)
    parts = packed.split(_forward_sizes(norm, streams, groups, buffer_size))
    kernels.forward_launch(parts, norm, hw, groups, weight, tuple(streams), (*agreement, policy), cfg)
    return packed


@_forward.register_fake
def _(norm: Tensor, weight: Tensor, streams: list[Tensor], agreement, policy, groups: int, buffer_size: int, *_):
    return _forward_allocation(norm, streams, groups, buffer_size)


# The sizes' functions uncached (``__wrapped__``): Dynamo traces these helpers in a compiled step, and it ignores a
# functools cache with a warning.
def _forward_sizes(norm: Tensor, streams: Sequence[Tensor], groups: int, buffer_size: int) -> tuple[int, ...]:
    return kernels.forward_sizes.__wrapped__(*norm.shape, groups, buffer_size, streams[0].dtype, norm.dtype)


def _forward_allocation(norm: Tensor, streams: Sequence[Tensor], groups: int, buffer_size: int) -> Tensor:
    return norm.new_empty(sum(_forward_sizes(norm, streams, groups, buffer_size)))


@torch.library.custom_op("mabn::backward_stats", mutates_args=("streams", "agreement"))
def _backward(
    dout_x: Tensor,
    dout_sum: Tensor,
    r: Tensor,
    var: Tensor,
    active: Tensor,
    weight: Tensor,
    streams: list[Tensor],
    agreement: list[Tensor],
    loss_scale: Tensor | None,
    groups: int,
    buffer_size: int,
    psi_count: int,
    stats: str,
    momentum: float,
    eps: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """``mabn_kernels.backward_launch`` on the psi stream (history, EMA, counter) and the (non-finite flags,
    tickets): its outputs' one allocation (``backward_sizes``) and the weight's and bias's gradients."""
    # The backward reads the stream's settings alone; the forward's phase settings are unused here.
    cfg = StepConfig(stats, momentum, eps, False, 1.0, buffer_size, "one", None, 0, 0)
    packed, grads = _backward_allocation(dout_x, var, weight, streams, groups, buffer_size)
    parts = packed.split(_backward_sizes(dout_x, weight, streams, groups, buffer_size, var.dtype))
    args = (dout_x, psi_count, dout_sum, r, var, active, weight, groups, tuple(streams), tuple(agreement), cfg)
    kernels.backward_launch(parts, grads, *args, loss_scale)
    return packed, *grads


@_backward.register_fake
def _(
    dout_x: Tensor, dout_sum, r, var: Tensor, active, weight: Tensor, streams, agreement, loss_scale, groups, size, *_
):
    packed, grads = _backward_allocation(dout_x, var, weight, streams, groups, size)
    return packed, *grads


def _backward_allocation(
    dout_x: Tensor, var: Tensor, weight: Tensor, streams: Sequence[Tensor], groups: int, buffer_size: int
) -> tuple[Tensor, tuple[Tensor, Tensor]]:
    """The outputs' allocation and the gradients apart: an operator's outputs may not be views of one another."""
    c = weight.numel()
    sizes = _backward_sizes(dout_x, weight, streams, groups, buffer_size, var.dtype)
    return var.new_empty(sum(sizes)), (weight.new_empty(c), weight.new_empty(c))


def _backward_sizes(
    dout_x: Tensor, weight: Tensor, streams: Sequence[Tensor], groups: int, buffer_size: int, stat: torch.dtype
) -> tuple[int, ...]:
    c = weight.numel()
    return kernels.backward_sizes.__wrapped__(dout_x.numel() // c, c, groups, buffer_size, streams[0].dtype, stat, True)


def forward_stats(
    norm: Tensor, hw: int, groups: int, weight: Tensor, layer: nn.Module, cfg: StepConfig
) -> tuple[Tensor, ForwardStats]:
    """``mabn_kernels.forward_stats`` through the operator."""
    streams, (flags, tickets, policy) = kernels.forward_state(layer, norm.device)
    packed = _forward(
        norm, weight, list(streams), [flags, tickets], policy,
        groups, cfg.buffer_size, hw, cfg.stats, cfg.momentum, cfg.eps, cfg.renorm, cfg.renorm_clip, cfg.ema_start,
        cfg.policy is not None, cfg.warmup_iters, cfg.renorm_warmup_iters,
    )  # fmt: skip
    return kernels.forward_record(packed.split(_forward_sizes(norm, streams, groups, cfg.buffer_size)))


def backward_stats(
    dout_x: Tensor,
    psi_count: int,
    dout_sum: Tensor,
    r: Tensor,
    var: Tensor,
    active: Tensor,
    weight: Tensor,
    groups: int,
    layer: nn.Module,
    cfg: StepConfig,
    loss_scale: Tensor | None = None,
) -> BackwardStats:
    """``mabn_kernels.backward_stats`` through the operator."""
    streams, agreement = kernels.backward_state(layer, var.device)
    packed, *grads = _backward(
        dout_x, dout_sum, r, var, active, weight, list(streams), list(agreement), loss_scale,
        groups, cfg.buffer_size, psi_count, cfg.stats, cfg.momentum, cfg.eps,
    )  # fmt: skip
    sizes = _backward_sizes(dout_x, weight, streams, groups, cfg.buffer_size, var.dtype)
    return kernels.backward_record(packed.split(sizes), tuple(grads))


# -- the passes over x: row_kernels' formulas as torch ops ----------------------------------------------------


def _opmath(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _rows(t: Tensor, x: Tensor, dtype: torch.dtype) -> Tensor:
    """Per-(sample, channel) values (N * C) as (N, C, 1, 1) in ``dtype``, to broadcast over x's pixels."""
    return t.view(*x.shape[:2], 1, 1).to(dtype)


def scale_shift(x: Tensor, scale: Tensor, bias: Tensor) -> Tensor:
    """``row_kernels.scale_shift``: x * scale + bias, scale per (sample, channel), bias per channel."""
    up = _opmath(x.dtype)
    return (x.to(up) * _rows(scale, x, up) + bias.view(1, -1, 1, 1).to(up)).to(x.dtype)


def grad_input(grad_out: Tensor, x: Tensor, scale: Tensor, coef: Tensor) -> Tensor:
    """``row_kernels.grad_input``: dL/dx = dL/dout * scale + x * coef, each per (sample, channel)."""
    up = _opmath(x.dtype)
    return (grad_out.to(up) * _rows(scale, x, up) + x.to(up) * _rows(coef, x, up)).to(x.dtype)


def row_sums(grad_out: Tensor, x: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``row_kernels.row_sums``: per (sample, channel), the sums over H * W of dL/dout * x and of dL/dout."""
    up = _opmath(x.dtype)
    dout_x = torch.sum(grad_out.to(up) * x.to(up), dim=(2, 3), dtype=dtype).flatten()
    return dout_x, torch.sum(grad_out, dim=(2, 3), dtype=dtype).flatten()
