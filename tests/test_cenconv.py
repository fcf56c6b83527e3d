"""CenConv2d's hand-written backward against autograd through an explicit centring, and its memory."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mabn.bench.measure import peak_memory
from mabn.norm import CenConv2d


def _reference(conv: CenConv2d, x: torch.Tensor) -> torch.Tensor:
    """The definition, left to autograd: conv with W - mean(W) over each filter."""
    w = conv.weight
    return conv._conv_forward(x, w - w.mean(dim=(1, 2, 3), keepdim=True), conv.bias)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"kernel_size": 3, "padding": 1},
        {"kernel_size": 3, "stride": 2, "padding": 2, "dilation": 2, "bias": False},
        {"kernel_size": (1, 3), "groups": 2, "padding": (0, 1)},
    ],
)
def test_gradients_match_autograd_through_the_centring(kwargs, device):
    torch.manual_seed(0)
    conv = CenConv2d(4, 6, **kwargs).double().to(device)
    x = torch.randn(2, 4, 7, 9, dtype=torch.float64, device=device, requires_grad=True)
    out = conv(x)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, [x, *conv.parameters()], g)
    expected_out = _reference(conv, x)
    expected = torch.autograd.grad(expected_out, [x, *conv.parameters()], g)
    torch.testing.assert_close(out, expected_out, rtol=1e-12, atol=1e-12)
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert torch.autograd.gradcheck(lambda x, w: CenConv2d.forward(conv, x), (x, conv.weight))


def test_fallback_paths_and_eval_agree_with_the_definition():
    torch.manual_seed(0)
    x = torch.randn(1, 3, 8, 8, dtype=torch.float64)
    for conv in (CenConv2d(3, 4, 3, padding="same"), CenConv2d(3, 4, 3, padding=1, padding_mode="reflect")):
        conv = conv.double()
        torch.testing.assert_close(conv(x), _reference(conv, x))
    conv = CenConv2d(3, 4, 3, padding=1).double()
    with torch.no_grad():
        torch.testing.assert_close(conv(x), _reference(conv, x))


def test_autocast_runs_the_convolution_in_low_precision_like_conv2d(device):
    torch.manual_seed(0)
    conv = CenConv2d(8, 8, 3, padding=1).to(device)
    x = torch.randn(2, 8, 10, 10, device=device, requires_grad=True)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        out = conv(x)
        expected_out = _reference(conv, x)
    assert out.dtype == expected_out.dtype == torch.bfloat16
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, [x, *conv.parameters()], g)
    expected = torch.autograd.grad(expected_out, [x, *conv.parameters()], g)
    torch.testing.assert_close(out, expected_out)
    for got, want in zip(grads, expected, strict=True):
        assert got.dtype == want.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def test_training_peak_memory_is_that_of_conv2d():
    """Autograd would keep each centred weight alive for backward: one extra weight per layer. CenConv2d
    keeps one float per filter (its mean) and, during a backward, one recomputed weight."""
    torch.manual_seed(0)
    layers = 6
    x = torch.randn(1, 64, 8, 8)

    def step(model: nn.Module) -> None:
        model(x).square().sum().backward()
        model.zero_grad(set_to_none=True)

    plain = nn.Sequential(*[nn.Conv2d(64, 64, 3, padding=1, bias=False) for _ in range(layers)])
    centred = nn.Sequential(*[CenConv2d.from_conv(c) for c in plain])
    weight_bytes = plain[0].weight.numel() * 4
    mean_bytes = layers * 64 * 4
    for model in (plain, centred):  # first calls allocate one-time state
        step(model)
    conv_peak = peak_memory(lambda: step(plain), torch.device("cpu"))
    cen_peak = peak_memory(lambda: step(centred), torch.device("cpu"))
    assert cen_peak <= conv_peak + weight_bytes + mean_bytes, (cen_peak, conv_peak, weight_bytes)
