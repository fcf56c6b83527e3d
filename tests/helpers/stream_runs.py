"""MABN2d layers of any width held to the float64 reference step by step, the histories included: the kernel tests
of the history shift and of the launches' keys share them."""

from __future__ import annotations

import torch

from helpers.reference import RefMABN
from mabn.norm import MABN2d

H, W = 3, 5
FLOAT64 = dict(rtol=1e-9, atol=1e-10)


def pair(channels: int, cfg: dict, device: torch.device, seed: int = 5) -> tuple[MABN2d, RefMABN]:
    """A float64 MABN2d built with ``cfg`` on ``device`` and the reference with the same random affine."""
    gen = torch.Generator().manual_seed(seed)
    weight = 0.5 + torch.rand(channels, generator=gen, dtype=torch.float64)
    bias = torch.randn(channels, generator=gen, dtype=torch.float64)
    layer = MABN2d(channels, **cfg).double().to(device)
    with torch.no_grad():
        layer.weight.copy_(weight)
        layer.bias.copy_(bias)
    return layer, RefMABN(weight, bias, **cfg)


def inputs(gen: torch.Generator, n: int, channels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An input of per-channel scale in [0.5, 3] and mean 0.3, and an output gradient, in float64."""
    scale = 0.5 + 2.5 * torch.rand(1, channels, 1, 1, generator=gen, dtype=torch.float64)
    x = scale * torch.randn(n, channels, H, W, generator=gen, dtype=torch.float64) + 0.3
    return x, torch.randn(n, channels, H, W, generator=gen, dtype=torch.float64)


def history(stream: list[torch.Tensor], m: int) -> torch.Tensor:
    """The last m statistics of a stream, oldest first, zero rows where it holds fewer: a layer's history buffer."""
    rows = [torch.zeros_like(stream[0])] * m + stream
    return torch.stack(rows[-m:])


def check_step(
    layer: MABN2d, ref: RefMABN, x: torch.Tensor, grad: torch.Tensor, what: str, tol: dict = FLOAT64
) -> None:
    """One training step of ``layer`` on ``x`` (in its own dtype, on the layer's device) and of ``ref`` on the same
    values: the output, the gradients and the chi^2 and psi histories within ``tol`` of the reference's."""
    device = layer.weight.device
    xd = x.to(device, copy=True).requires_grad_()  # a leaf of its own: x may feed other layers' steps
    layer.weight.grad = layer.bias.grad = None
    out = layer(xd)
    out.backward(grad.to(device))
    expected = (ref.forward(x.double()), *ref.backward(grad.double()))
    actual = (out, xd.grad, layer.weight.grad, layer.bias.grad)
    for name, a, e in zip(("output", "grad x", "grad weight", "grad bias"), actual, expected, strict=True):
        torch.testing.assert_close(a.detach().cpu().double(), e, **tol, msg=f"{name}, {what}")
    m = layer.buffer_size
    for name, buffer, stream in (("chi^2", layer.buffer_x2, ref.chi2_stream), ("psi", layer.buffer_gz, ref.psi_stream)):
        torch.testing.assert_close(buffer.cpu().double(), history(stream, m), **tol, msg=f"{name} history, {what}")
