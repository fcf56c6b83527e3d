"""MABN2d's passes over the activations on CUDA: its training output, the backward's per-(sample, channel) sums and
dL/dx, each one Triton kernel over x seen as N * C rows of H * W.

A MABN2d layer normalizes each sample and channel by one factor (its group's statistic, the same for every
pixel), so its passes over x are rows times per-row scalars. Torch ops give them as a broadcasting ``addcmul`` (no
vectorized loads) and the native BN backward over N * C channels of one sample (one block per channel: a row of 49
pixels at ResNet's last stage leaves most of it idle) followed by a second pointwise pass for dL/dx. Each kernel
here reads and writes each element once, in the input's dtype, and computes in float32 (float64 for float64
inputs): what the torch ops compute, rounded once.
"""

# No "from __future__ import annotations": Triton reads annotations as objects.
import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from .launcher import Launcher


@triton.jit
def _up(v):
    """float64 stays float64; every other float computes in float32 (torch's opmath for half types)."""
    return v.to(tl.float64 if v.dtype == tl.float64 else tl.float32)


@triton.jit
def affine_kernel(
    a_ptr,
    s_ptr,
    b_ptr,
    t_ptr,
    out_ptr,
    C,
    LV,
    TWO: tl.constexpr,
    VEC: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """out = a * s[row] + (b * t[row] if TWO else t[c]) for the (N, C, L) inputs, row = n * C + c, L = LV * VEC: the
    forward's x * scale + bias, the backward's dL/dout * scale + x * coef. Program (n, i, j) takes sample n's
    channels from i * ROWS (ROWS rows) and their BLOCK columns from j * BLOCK: the grid gives each element's sample,
    channel and column, so no element's is found by a division, and a row's scalars are loaded once. L as a multiple
    of VEC tells the compiler that every row starts VEC-aligned, so that it loads VEC elements at a time."""
    chans = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    rows = tl.program_id(0) * C + chans
    cols = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    rmask = chans < C
    m = rmask[:, None] & (cols < LV * VEC)[None, :]
    offs = rows.to(tl.int64)[:, None] * (LV * VEC) + cols[None, :]
    a = _up(tl.load(a_ptr + offs, mask=m, other=0.0))
    out = a * tl.load(s_ptr + rows, mask=rmask, other=0.0).to(a.dtype)[:, None]
    if TWO:
        b = _up(tl.load(b_ptr + offs, mask=m, other=0.0))
        out += b * tl.load(t_ptr + rows, mask=rmask, other=0.0).to(a.dtype)[:, None]
    else:
        out += tl.load(t_ptr + chans, mask=rmask, other=0.0).to(a.dtype)[:, None]
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def row_sums_kernel(g_ptr, x_ptr, gx_ptr, gs_ptr, R, LV, VEC: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """Per row of the (R, L) inputs g and x, L = LV * VEC (VEC-aligned rows, as in ``affine_kernel``): sum(g * x) and
    sum(g), accumulated in the outputs' dtype."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rmask = rows < R
    dt = gx_ptr.dtype.element_ty
    L = LV * VEC
    base = rows.to(tl.int64)[:, None] * L
    acc_gx = tl.zeros((ROWS, BLOCK), dt)
    acc_g = tl.zeros((ROWS, BLOCK), dt)
    for l0 in range(0, L, BLOCK):
        cols = l0 + tl.arange(0, BLOCK)
        m = rmask[:, None] & (cols < L)[None, :]
        g = tl.load(g_ptr + base + cols[None, :], mask=m, other=0.0).to(dt)
        x = tl.load(x_ptr + base + cols[None, :], mask=m, other=0.0).to(dt)
        acc_gx += g * x
        acc_g += g
    tl.store(gx_ptr + rows, tl.sum(acc_gx, axis=1), mask=rmask)
    tl.store(gs_ptr + rows, tl.sum(acc_g, axis=1), mask=rmask)


# Elements per program of the pointwise kernel (4 warps: 8 per thread, two 16-byte loads of float32 each), and the
# row sums' tile: up to 2048 elements of a row per step; each several rows (channels) a program where rows are
# shorter.
AFFINE_TILE = 1024
TILE = 2048


@functools.cache
def _tile(length: int, tile: int = TILE) -> tuple[int, int]:
    """(ROWS, BLOCK) of a ``tile`` of rows of ``length``."""
    block = min(triton.next_power_of_2(length), tile)
    return tile // block, block


@functools.cache
def _vec(length: int, itemsize: int) -> int:
    """The elements of a 16-byte load that divide ``length`` (a power of 2, 1 for odd lengths): rows of ``length``
    then start at multiples of them, and the kernels load them as one vector."""
    vec = 16 // itemsize
    while length % vec:
        vec //= 2
    return vec


def _affine_grid(meta: dict) -> tuple[int, int, int]:
    samples = meta["a_ptr"].shape[0]
    return samples, triton.cdiv(meta["C"], meta["ROWS"]), triton.cdiv(meta["LV"] * meta["VEC"], meta["BLOCK"])


def _rows_grid(meta: dict) -> tuple[int]:
    return (triton.cdiv(meta["R"], meta["ROWS"]),)


_affine = Launcher(affine_kernel, _affine_grid, num_warps=4)
_row_sums = Launcher(row_sums_kernel, _rows_grid, num_warps=4)


def _launch_affine(a: Tensor, s: Tensor, b: Tensor | None, t: Tensor) -> Tensor:
    n, c, h, w = a.shape
    a = a.contiguous()
    out = torch.empty_like(a)
    two = b is not None
    b = b.contiguous() if two else a  # unread when not TWO
    length = h * w
    vec = _vec(length, a.itemsize)
    rows, block = _tile(length, AFFINE_TILE)
    _affine((a, s, b, t, out, c, length // vec), dict(TWO=two, VEC=vec, ROWS=rows, BLOCK=block))
    return out


def scale_shift(x: Tensor, scale: Tensor, bias: Tensor) -> Tensor:
    """x * scale + bias: x (N, C, H, W), scale per (sample, channel) (N * C), bias per channel (C), in x's dtype."""
    return _launch_affine(x, scale, None, bias)


def grad_input(grad_out: Tensor, x: Tensor, scale: Tensor, coef: Tensor) -> Tensor:
    """dL/dx = dL/dout * scale + x * coef, with scale and coef per (sample, channel) (N * C), in x's dtype."""
    return _launch_affine(grad_out, scale, x, coef)


def row_sums(grad_out: Tensor, x: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Per (sample, channel), in ``dtype``: the sums over H * W of dL/dout * x and of dL/dout (each N * C)."""
    n, c, h, w = x.shape
    grad_out, x = grad_out.contiguous(), x.contiguous()
    sums = torch.empty(2, n * c, dtype=dtype, device=x.device)
    length = h * w
    vec = _vec(length, x.itemsize)
    rows, block = _tile(length)
    dout_x, dout_sum = sums.unbind()
    _row_sums((grad_out, x, dout_x, dout_sum, n * c, length // vec), dict(VEC=vec, ROWS=rows, BLOCK=block))
    return dout_x, dout_sum
