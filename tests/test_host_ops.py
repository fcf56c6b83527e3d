"""MABN2d's eager training step on its CUDA (Triton) path stays host-light: the ATen operators that one layer's
training forward and backward issue, counted as ``python -m mabn bench ops`` counts them (``mabn.tools.bench.ops``),
stay
within the bounds measured (docs/cost.md, "Host work per layer"). On a GPU at 2 images per device each operator is
host time that the eager step waits for, so an added allocation, view or check fails here rather than as a slower
GPU step. Counts, not timings: deterministic on any machine.

On the CPU the Triton path is selected as for a CUDA tensor and its kernels run through Triton's interpreter
(tests/conftest.py); with MABN_TEST_DEVICE=cuda they run compiled.
"""

from __future__ import annotations

import math

import pytest
import torch

from mabn.norm import MABN2d
from mabn.tools.bench import ops

pytestmark = pytest.mark.gpu

# Measured: the forward is the one pass over x for its per-sample norms, one allocation for the statistics (and its
# split) and the output's; the backward is one allocation for the per-(sample, channel) sums (and its unbind), one for
# psi, dL/dx's coefficients and the parameters' gradients (and its split), dL/dx's, and the 3 detach with which
# autograd takes each new gradient (x, weight, bias). The forward launches two Triton kernels (statistics, output),
# the backward three (sums, statistics, dL/dx).
FORWARD_OPS = 4
BACKWARD_OPS = 10
LAUNCHES = 5
# Parameters in another dtype than the statistics (a float16 layer): their gradients need their own allocations.
SEPARATE_GRADIENTS = 2

CASES = {  # (parameters' dtype, input's dtype, norm_batch_size, extra forward operators, extra backward operators)
    "whole-batch": (torch.float32, torch.float32, None, 0, 0),
    "ghost-1": (torch.float32, torch.float32, 1, 0, 0),
    "float64": (torch.float64, torch.float64, None, 0, 0),
    "bfloat16-input": (torch.float32, torch.bfloat16, None, 0, 0),
    "float16-layer": (torch.float16, torch.float16, None, 0, SEPARATE_GRADIENTS),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_triton_path_operator_count_stays_within_bound(case, device):
    dtype, x_dtype, norm_batch_size, extra_forward, extra_backward = CASES[case]
    layer = MABN2d(8, buffer_size=2, warmup_iters=1, renorm_warmup_iters=1, norm_batch_size=norm_batch_size)
    layer = layer.to(device, dtype)
    x = torch.randn(2, 8, 4, 4, device=device, dtype=x_dtype)
    grad = torch.randn_like(x)
    count = ops.count(layer, x, grad, triton=True)
    breakdown = dict(count.ops)
    assert count.forward <= FORWARD_OPS + extra_forward, f"forward: {count.forward} ATen operators, {breakdown}"
    assert count.backward <= BACKWARD_OPS + extra_backward, f"backward: {count.backward} ATen operators, {breakdown}"
    assert count.launches == LAUNCHES, breakdown


def test_counts_do_not_depend_on_running_the_kernels(device):
    """``python -m mabn bench ops`` on a machine without a GPU replaces each launch by its argument packing: the
    operators around the launches are the same as when the kernels run."""
    x, grad = torch.randn(2, 8, 4, 4, device=device), torch.randn(2, 8, 4, 4, device=device)
    run, packed = (
        ops.count(MABN2d(8, buffer_size=2, warmup_iters=1).to(device), x, grad, triton=True, run_kernels=run_kernels)
        for run_kernels in (True, False)
    )
    assert run == packed


def test_ops_bench_table():
    table = ops.run(torch.device("cpu"), repeats=3, shape=(2, 8, 4, 4))
    rows = {
        cells[0]: cells[1:]
        for line in table.splitlines()
        if line.startswith("| ") and not line.startswith("| layer")
        for cells in [[c.strip() for c in line.strip("|").split("|")]]
    }
    assert set(rows) == {"bn", "mabn", "mabn torch ops"}
    forward, backward, launches = (int(v) for v in rows["mabn"][:3])
    assert forward <= FORWARD_OPS and backward <= BACKWARD_OPS and launches == LAUNCHES, rows["mabn"]
    assert int(rows["mabn torch ops"][0]) > FORWARD_OPS and rows["mabn torch ops"][2] == "0"
    assert all(math.isfinite(float(r[4])) and float(r[4]) > 0 for r in rows.values())
