"""The torch-op pieces that the batch-statistic norms' statistic steps share: the statistics' dtype, per-group
values spread over the samples of each ghost batch, PyTorch's native BN backward per sample, and the buffers' values
before a step updates them."""

from __future__ import annotations

import functools

import torch
from torch import Tensor

# torch.promote_types goes through the dispatcher, an operator call that an eager step would pay in every layer: the
# answers for the float dtypes are looked up instead.
_STAT_DTYPES = {
    dtype: torch.promote_types(dtype, torch.float32)
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64)
}


def stat_dtype(x: Tensor) -> torch.dtype:
    """Statistics are kept in float32 or better, whatever the activation dtype."""
    return _STAT_DTYPES.get(x.dtype) or torch.promote_types(x.dtype, torch.float32)


def per_sample(t: Tensor, group_size: int) -> Tensor:
    """Expand per-group (G, C) values to per-sample (N, C, 1, 1) for broadcasting over a batch."""
    g, c = t.shape
    return t.unsqueeze(1).expand(g, group_size, c).reshape(g * group_size, c, 1, 1)


def per_sample_bn_backward(
    grad_out: Tensor, x: Tensor, weight: Tensor, mean: Tensor, var: Tensor, eps: float, need_x: bool
) -> tuple[Tensor | None, Tensor, Tensor]:
    """PyTorch's fused BN backward in inference mode, on x (N, C, H, W) viewed as N*C channels of one sample,
    with a weight, mean and variance per (sample, channel) (each N*C): in one pass it gives
    dL/dout * weight / sqrt(var + eps) (when ``need_x``) and, per (sample, channel), the sums of
    dL/dout * (x - mean) / sqrt(var + eps) and of dL/dout."""
    n, c, h, w = x.shape
    if torch.compiler.is_compiling():
        # The same sums written out: the compiler fuses them into one reduction pass over x and dL/dout and the
        # pointwise pass after it, where its decomposition of the native kernel costs more on the CPU.
        per = (n, c, 1, 1)
        inv_std = (var + eps).rsqrt().view(per)
        xhat = (x.to(var.dtype) - mean.view(per)) * inv_std
        dout_xhat = torch.sum(grad_out * xhat, dim=(2, 3), dtype=weight.dtype).view(n * c)
        dout_sum = torch.sum(grad_out, dim=(2, 3), dtype=weight.dtype).view(n * c)
        g = (grad_out * (weight.view(per) * inv_std)).to(grad_out.dtype) if need_x else None
        return g, dout_xhat, dout_sum

    def flat(t: Tensor) -> Tensor:
        return t.contiguous().view(1, n * c, h, w)

    empty = _no_statistics(var.dtype, var.device)
    return torch.ops.aten.native_batch_norm_backward(
        flat(grad_out), flat(x), weight, mean, var, empty, empty, False, eps, [need_x, True, True]
    )


@functools.cache
def _no_statistics(dtype: torch.dtype, device: torch.device) -> Tensor:
    """The native backward's saved batch statistics, none: inference mode reads the running ones, but CUDA needs
    tensors. One per dtype and device, made once: an allocation is an operator call on the host at every backward."""
    return torch.empty(0, dtype=dtype, device=device)


@torch.library.custom_op("mabn::snapshot", mutates_args=())
def _snapshot(tensors: list[Tensor]) -> list[Tensor]:
    return [t.clone() for t in tensors]


@_snapshot.register_fake
def _(tensors: list[Tensor]) -> list[Tensor]:
    return [torch.empty_like(t) for t in tensors]


def values_before_update(*buffers: Tensor) -> tuple[Tensor, ...]:
    """The buffers' values for a statistic step that then updates them in place: the buffers themselves, and
    under ``torch.compile`` copies made by an op that the compiler does not recompute. Its partitioner may
    otherwise recompute what the backward needs (r, the active flags) from the buffers' inputs, which the forward
    has updated by then."""
    return tuple(_snapshot(list(buffers))) if torch.compiler.is_compiling() else buffers
