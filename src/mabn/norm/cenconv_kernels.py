"""CenConv2d weights re-centred in place in one Triton launch (CUDA), for ``keep_centred``.

After every SGD step each centred conv's filters lose their means again: with torch ops that is a mean and a
subtraction per conv, two launches each for ResNet-101's 104 convs, at a few microseconds apiece, where the step's
whole optimizer update is one foreach call. Here one launch covers every conv of a device and dtype: a table holds
each conv's address, filter count and filter size, and each program centres a block of one conv's filters.
"""

# No "from __future__ import annotations": Triton reads annotations as objects.
import triton
import triton.language as tl
from torch import Tensor

from .launcher import Launcher


@triton.jit
def recentre_kernel(table_ptr, like_ptr, CONVS, MAX_FILTERS, FILTERS: tl.constexpr, BLOCK: tl.constexpr):
    """Program (i, j) centres filters j * FILTERS .. of conv i, whose row in the table is (address, filters, filter
    size); ``like_ptr``: any pointer of the weights' dtype; CONVS and MAX_FILTERS give the grid. Sums in float32
    or better, as torch's mean does."""
    row = table_ptr + tl.program_id(0) * 3
    weights = tl.load(row).to(like_ptr.dtype, bitcast=True)
    count = tl.load(row + 1)
    size = tl.load(row + 2)
    filters = tl.program_id(1) * FILTERS + tl.arange(0, FILTERS)
    fmask = filters < count
    base = weights + filters.to(tl.int64)[:, None] * size
    dt = tl.float64 if like_ptr.dtype.element_ty == tl.float64 else tl.float32
    acc = tl.zeros((FILTERS, BLOCK), dt)
    for k0 in range(0, size, BLOCK):
        cols = k0 + tl.arange(0, BLOCK)
        m = fmask[:, None] & (cols < size)[None, :]
        acc += tl.load(base + cols[None, :], mask=m, other=0.0).to(dt)
    mean = tl.sum(acc, axis=1) / size.to(dt)
    for k0 in range(0, size, BLOCK):
        cols = k0 + tl.arange(0, BLOCK)
        m = fmask[:, None] & (cols < size)[None, :]
        w = tl.load(base + cols[None, :], mask=m, other=0.0)
        tl.store(base + cols[None, :], (w.to(dt) - mean[:, None]).to(w.dtype), mask=m)


# Filters per program and elements per step: a ResNet-101's convs (up to 2048 filters of up to 4608 weights) in a
# few thousand programs, each a 16 x 128 tile.
FILTERS = 16
BLOCK = 128


def _grid(meta: dict) -> tuple[int, int]:
    return meta["CONVS"], triton.cdiv(meta["MAX_FILTERS"], meta["FILTERS"])


_recentre = Launcher(recentre_kernel, _grid, num_warps=4)


def recentre(table: Tensor, like: Tensor, convs: int, max_filters: int) -> None:
    """Centre the filters of the ``convs`` weights that ``table`` (convs x 3 int64: address, filters, filter size)
    lists, all of ``like``'s dtype and device, in place."""
    _recentre((table, like, convs, max_filters), dict(FILTERS=FILTERS, BLOCK=BLOCK))
