"""MABN2d's passes over the activations on CUDA (``mabn.norm.row_kernels``) against the formulas in float64: the
per-(sample, channel) sums of the backward and the two pointwise passes, on grids of several programs, rows longer
than one tile step and shorter than a vector, and each activation dtype.

On the CPU the kernels run through Triton's interpreter (tests/conftest.py); with MABN_TEST_DEVICE=cuda compiled.
The whole layer through these kernels is held to the reference in tests/test_mabn_kernels.py.
"""

from __future__ import annotations

import pytest
import torch

from mabn.norm import row_kernels

pytestmark = pytest.mark.gpu

# (N, C, H, W): rows of 2500 (the row sums: two steps of the 2048-element tile, one row a program, 15 programs; the
# pointwise passes: 3 blocks of 1024 columns a row, the last partial, loads of 4 float32 or bfloat16 and 2
# float64 elements); rows of 9 (the row sums: 128 rows a program, 3 programs, the last partial; the pointwise
# passes: 64 channels a program, 2 a sample, the last partial, single-element loads).
SHAPES = {"long-rows": (3, 5, 50, 50), "short-rows": (3, 70, 3, 3)}
# One unit in the last place of the output's dtype (Triton's interpreter casts to bfloat16 by truncation, a GPU
# rounds to nearest), float32 accumulation over a row of 2500 for the sums.
TOL = {torch.float64: 1e-12, torch.float32: 2e-6, torch.bfloat16: 2**-7}
DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}


def _inputs(shape, dtype, device):
    gen = torch.Generator().manual_seed(3)
    g, x = (torch.randn(shape, generator=gen, dtype=torch.float64) * 2 + 0.5 for _ in range(2))
    return g.to(dtype).to(device), x.to(dtype).to(device)


def _stat_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES)
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES)
def test_row_sums_equal_the_float64_sums(shape, dtype, device):
    g, x = _inputs(shape, dtype, device)
    dout_x, dout_sum = row_kernels.row_sums(g, x, _stat_dtype(dtype))
    g64, x64 = g.double(), x.double()  # the inputs' own values, exactly
    tol = TOL[_stat_dtype(dtype)] * 10
    torch.testing.assert_close(dout_x.double().cpu(), (g64 * x64).sum((2, 3)).flatten().cpu(), rtol=tol, atol=tol)
    torch.testing.assert_close(dout_sum.double().cpu(), g64.sum((2, 3)).flatten().cpu(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES)
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES)
def test_pointwise_passes_equal_the_float64_formulas(shape, dtype, device):
    n, c = shape[:2]
    g, x = _inputs(shape, dtype, device)
    gen = torch.Generator().manual_seed(5)
    stat = _stat_dtype(dtype)
    scale, coef = (torch.randn(n * c, generator=gen, dtype=torch.float64).to(stat).to(device) for _ in range(2))
    bias = torch.randn(c, generator=gen, dtype=torch.float64).to(stat).to(device)
    per_row = (n, c, 1, 1)
    x64, g64 = x.double(), g.double()
    out = row_kernels.scale_shift(x, scale, bias)
    expected = x64 * scale.double().view(per_row) + bias.double().view(1, c, 1, 1)
    grad = row_kernels.grad_input(g, x, scale, coef)
    expected_grad = g64 * scale.double().view(per_row) + x64 * coef.double().view(per_row)
    tol = TOL[dtype]
    for got, want in ((out, expected), (grad, expected_grad)):
        assert got.dtype == dtype and got.shape == shape
        torch.testing.assert_close(got.double().cpu(), want.cpu(), rtol=tol, atol=tol)


def test_a_non_contiguous_input_reads_as_its_values(device):
    """A channels-last input (or any other strides) gives the values of its NCHW reading."""
    g, x = _inputs((2, 6, 5, 7), torch.float32, device)
    g_cl, x_cl = (t.to(memory_format=torch.channels_last) for t in (g, x))
    for got, want in zip(row_kernels.row_sums(g_cl, x_cl, torch.float32), row_kernels.row_sums(g, x, torch.float32)):
        assert torch.equal(got, want)
    scale = torch.linspace(0.5, 2, 12, device=device)
    bias = torch.linspace(-1, 1, 6, device=device)
    assert torch.equal(row_kernels.scale_shift(x_cl, scale, bias), row_kernels.scale_shift(x, scale, bias))
