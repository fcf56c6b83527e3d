"""CenConv2d's hand-written backward against autograd through an explicit centring, and its memory."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mabn.norm import CenConv2d
from mabn.tools.bench.measure import peak_memory

pytestmark = pytest.mark.gpu


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


@pytest.mark.parametrize(
    "sgd",
    [
        {"momentum": 0.9, "weight_decay": 1e-2},
        {"momentum": 0.9, "nesterov": True, "weight_decay": 1e-2},
        {"momentum": 0.5, "dampening": 0.3, "foreach": False},
    ],
)
def test_centring_after_sgd_steps_follows_the_forward_centring(sgd):
    """With SGD, weights re-centred in place after each step (forwards then plain convs) are, at every step, the
    centred weights of today's forward centring, and the network computes the same outputs (float64, a small
    ResNet with MABN through its warm-up, SMA and renormalization)."""
    import copy

    from mabn.norm import convert_norm
    from mabn.norm.cenconv import keep_centred
    from mabn.tools.ablation.model import SmallResNet

    torch.manual_seed(0)
    options = {"warmup_iters": 2, "renorm_warmup_iters": 3, "buffer_size": 2, "norm_batch_size": 2}
    reference = convert_norm(SmallResNet(3, widths=(4, 8), blocks=(1, 1)), "mabn", **options).double().train()
    model = copy.deepcopy(reference)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.2, **sgd) for m in (reference, model)]
    handle = keep_centred(model, optimizers[1])
    convs = [m for m in model.modules() if isinstance(m, CenConv2d)]
    ref_convs = [m for m in reference.modules() if isinstance(m, CenConv2d)]
    assert handle is not None and len(convs) == 6 and all(c.centred_in_place for c in convs)
    for step in range(8):
        x = torch.randn(4, 3, 8, 8, dtype=torch.float64)
        outs = []
        for net, opt in zip((reference, model), optimizers):
            out = net(x)
            out.tanh().sum().backward()
            opt.step()
            opt.zero_grad()
            outs.append(out)
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-9, atol=1e-11, msg=f"step {step}")
        for ref, conv in zip(ref_convs, convs):
            torch.testing.assert_close(conv.weight, ref.centred_weight(), rtol=1e-9, atol=1e-11)
    handle.remove()
    assert not any(c.centred_in_place for c in convs)
    assert keep_centred(model, torch.optim.Adam(model.parameters())) is None
    assert not any(c.centred_in_place for c in convs)
