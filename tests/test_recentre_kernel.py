"""``keep_centred``'s re-centring on CUDA, one Triton launch over a table of conv weights
(``mabn.norm.cenconv_kernels``), against the per-filter means in float64; and the table rebuilt when a weight's
storage moves, so that the launch never writes where a weight used to be.

On the CPU the kernel runs through Triton's interpreter (tests/conftest.py), chosen for CPU weights here; with
MABN_TEST_DEVICE=cuda it runs compiled, chosen as in training.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mabn.norm.cenconv as cenconv
from mabn.norm.fused import load

pytestmark = pytest.mark.gpu


@pytest.fixture
def triton_path(monkeypatch):
    kernels = load("cenconv_kernels")
    assert kernels is not None, "Triton is not importable (or MABN_FUSED=0)"
    monkeypatch.setattr(cenconv, "_kernels", lambda w: kernels)


def _convs(dtype: torch.dtype, device) -> list[nn.Conv2d]:
    """Filters of 27 (40 of them: three blocks of 16, the last partial), 300 (two steps of 128 and a partial one), 9
    (depthwise) and 1600 weights, with means far from 0."""
    torch.manual_seed(0)
    shapes = [(3, 40, 3, 1), (300, 20, 1, 1), (24, 24, 3, 24), (64, 8, 5, 1)]
    convs = [nn.Conv2d(i, o, k, groups=g, bias=False) for i, o, k, g in shapes]
    for conv in convs:
        with torch.no_grad():
            conv.weight.mul_(3).add_(torch.randn(conv.weight.shape[0], 1, 1, 1))
    return [conv.to(device, dtype) for conv in convs]


def _expected(conv: nn.Conv2d) -> torch.Tensor:
    w = conv.weight.detach().double()
    return w - w.mean(dim=(1, 2, 3), keepdim=True)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_one_launch_centres_every_filter(dtype, device, triton_path):
    convs = _convs(dtype, device)
    expected = [_expected(conv) for conv in convs]
    cenconv.Recentring(convs)()
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    for conv, want in zip(convs, expected, strict=True):
        torch.testing.assert_close(conv.weight.detach().double(), want, rtol=tol, atol=tol)
        filter_means = conv.weight.detach().double().mean(dim=(1, 2, 3))
        assert filter_means.abs().max() < tol * 10


def test_a_moved_weight_is_centred_where_it_lives_now(device, triton_path):
    convs = _convs(torch.float64, device)
    recentring = cenconv.Recentring(convs)
    recentring()
    old = convs[1].weight.data
    kept = old.clone()
    with torch.no_grad():
        convs[1].weight.data = old.clone() + 5.0  # new storage, filter means 5
    expected = _expected(convs[1])
    recentring()
    torch.testing.assert_close(convs[1].weight.detach(), expected, rtol=1e-12, atol=1e-12)
    assert torch.equal(old, kept), "the launch wrote into the weight's old storage"
