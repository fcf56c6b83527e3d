"""State handling of the norms: exact resume from a state_dict, refusal of bad input, low precision."""

import copy

import pytest
import torch
from torch import nn

from mabn import BatchRenorm2d, MABN2d
from mabn.norm import managed

pytestmark = pytest.mark.gpu

# Short timelines so that 30 steps cross warm-up, SMA and renormalization.
MABN_KW = dict(buffer_size=4, warmup_iters=5, renorm_warmup_iters=10, renorm_clip=1.5, momentum=0.9)
BRN_KW = dict(r_ramp=(3, 12), d_ramp=(3, 8), momentum=0.9)
LAYERS = {
    "mabn": lambda: MABN2d(3, **MABN_KW),
    "mabn_ghost": lambda: MABN2d(3, norm_batch_size=2, **MABN_KW),
    "mabn_ema": lambda: MABN2d(3, stats="ema", norm_batch_size=2, **MABN_KW),
    "brn_ghost": lambda: BatchRenorm2d(3, norm_batch_size=2, **BRN_KW),
}


def _stream(steps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        scale = 0.5 + 2.5 * torch.rand((), generator=gen)
        yield scale * torch.randn(6, 3, 4, 5, generator=gen) + 0.3, torch.randn(6, 3, 4, 5, generator=gen)


def _train_step(layer, x, g):
    device = layer.weight.device
    x = x.to(device).requires_grad_()
    out = layer(x)
    out.backward(g.to(device))
    return out.detach(), x.grad, layer.weight.grad.clone(), layer.bias.grad.clone()


def _raise_if_nonfinite(layer):
    """Where MABN2d and BatchRenorm2d report late (CUDA), collect the verdict; on the CPU the step has raised."""
    layer.raise_if_nonfinite()
    assert layer.weight.device.type == "cuda", "the CPU must raise within the step"


def _zero_grads(layer):
    layer.weight.grad = None
    layer.bias.grad = None


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_state_dict_resume_is_bit_identical(name):
    steps, cut = 30, 12
    data = list(_stream(steps))
    layer = LAYERS[name]()
    with torch.no_grad():
        layer.weight.uniform_(0.5, 1.5)
        layer.bias.uniform_(-0.5, 0.5)
    saved, reference = None, []
    for t, (x, g) in enumerate(data):
        if t == cut:
            saved = copy.deepcopy(layer.state_dict())
        _zero_grads(layer)
        reference.append(_train_step(layer, x, g))

    resumed = LAYERS[name]()
    resumed.load_state_dict(saved)
    for t in range(cut, steps):
        _zero_grads(resumed)
        got = _train_step(resumed, *data[t])
        for a, b in zip(got, reference[t]):
            assert torch.equal(a, b), f"step {t} diverged after resuming"
    for key, value in layer.state_dict().items():
        assert torch.equal(resumed.state_dict()[key], value), key


def _bad_inputs():
    return {
        "3-D": (torch.randn(2, 3, 5), "4-D input"),
        "5-D": (torch.randn(2, 3, 2, 2, 2), "4-D input"),
        "channels": (torch.randn(2, 4, 3, 3), "built for 3 channels"),
        "empty batch": (torch.randn(0, 3, 3, 3), "empty batch"),
        "empty map": (torch.randn(2, 3, 0, 3), "empty batch"),
        "indivisible": (torch.randn(3, 3, 2, 2), "not divisible by norm_batch_size=2"),
        "nan": (torch.full((2, 3, 2, 2), float("nan")), "non-finite"),
        "inf": (torch.full((2, 3, 2, 2), float("inf")), "non-finite"),
        "overflow": (torch.full((2, 3, 2, 2), 3e38), "non-finite"),
    }


# Divisibility by norm_batch_size only applies to layers with ghost batches.
BAD_CASES = [(n, c) for n in sorted(LAYERS) for c in sorted(_bad_inputs()) if not (n == "mabn" and c == "indivisible")]


@pytest.mark.parametrize(("name", "case"), BAD_CASES)
def test_bad_input_raises_and_leaves_state(name, case, device):
    layer = LAYERS[name]().to(device)
    for x, g in _stream(7):  # some history in the buffers
        _train_step(layer, x, g)
    before = copy.deepcopy(layer.state_dict())
    x, message = _bad_inputs()[case]
    with pytest.raises((ValueError, FloatingPointError), match=message):
        layer(x.to(device))
        _raise_if_nonfinite(layer)
    for key, value in layer.state_dict().items():
        assert torch.equal(value, before[key]), f"{key} changed after a rejected batch ({case})"


@pytest.mark.parametrize("name", ["mabn", "mabn_ghost", "mabn_ema"])
def test_non_finite_gradient_raises_and_leaves_state(name, device):
    layer = LAYERS[name]().to(device)
    for x, g in _stream(7):
        _train_step(layer, x, g)
    before = copy.deepcopy(layer.state_dict())
    x = torch.randn(6, 3, 4, 5, device=device, requires_grad=True)
    out = layer(x)
    after_forward = copy.deepcopy(layer.state_dict())
    with pytest.raises(FloatingPointError, match="psi"):
        out.backward(torch.full_like(out, float("nan")))
        _raise_if_nonfinite(layer)
    for key in ("buffer_gz", "running_psi", "count_gz"):
        assert torch.equal(layer.state_dict()[key], after_forward[key]), key
        assert torch.equal(layer.state_dict()[key], before[key]), key


@pytest.mark.parametrize("name", ["mabn", "brn_ghost"])
def test_a_deferred_verdict_waits_in_the_flags_for_its_reader(name, device, monkeypatch):
    """Where the verdict is not read at once (CUDA; here the CPU acting as it), a training step reads nothing on the
    host: a non-finite batch raises nothing, neither does the next forward, and the flags keep the verdict until
    ``raise_if_nonfinite`` reports it, once."""
    monkeypatch.setattr(managed, "reads_at_once", lambda device: False)
    layer = LAYERS[name]().to(device)
    for x, g in _stream(3):
        _train_step(layer, x, g)
    before = copy.deepcopy(layer.state_dict())
    layer(torch.full((6, 3, 4, 5), float("nan"), device=device))
    assert layer.nonfinite_flags(torch.device(device)).tolist()[0]
    for key, value in layer.state_dict().items():
        assert torch.equal(value, before[key]), key
    _train_step(layer, *next(_stream(1, seed=2)))  # a good batch: the layer does not look at the flags
    with pytest.raises(FloatingPointError, match="non-finite"):
        layer.raise_if_nonfinite()
    layer.raise_if_nonfinite()  # reported: the flags are clear


def test_eval_accepts_any_batch_and_changes_nothing():
    layer = LAYERS["mabn_ghost"]()
    for x, g in _stream(7):
        _train_step(layer, x, g)
    before = copy.deepcopy(layer.state_dict())
    layer.eval()
    out = layer(torch.randn(1, 3, 7, 7))  # one sample: not a whole ghost batch, fine at inference
    assert out.shape == (1, 3, 7, 7)
    for key, value in layer.state_dict().items():
        assert torch.equal(value, before[key]), key


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_bfloat16_autocast_keeps_float32_finite_statistics(name):
    conv = nn.Conv2d(2, 3, 3, padding=1)
    layer = LAYERS[name]()
    for t in range(25):
        x = torch.randn(6, 2, 6, 6) * (50.0 if t % 2 else 1.0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = layer(conv(x))
        assert out.dtype == torch.bfloat16
        out.float().square().mean().backward()
    for key, value in layer.state_dict().items():
        if value.is_floating_point():
            assert value.dtype == torch.float32, key
            assert torch.isfinite(value).all(), key
    assert torch.isfinite(conv.weight.grad).all() and torch.isfinite(layer.weight.grad).all()


def test_float16_input_squares_do_not_overflow():
    """x^2 of |x| = 1000 overflows float16 (max 65504); statistics are taken in float32."""
    layer = MABN2d(3, **MABN_KW)
    x = (1000 * torch.randn(4, 3, 5, 5)).half().requires_grad_()
    out = layer(x)
    out.backward(torch.randn_like(out))
    assert out.dtype == torch.float16 and torch.isfinite(out).all()
    assert torch.isfinite(layer.buffer_x2).all() and torch.isfinite(layer.buffer_gz).all()
    chi2 = x.detach().double().square().mean(dim=(0, 2, 3))
    torch.testing.assert_close(layer.buffer_x2[-1].double(), chi2, rtol=1e-3, atol=0)


def test_brn_follows_a_policy_switched_in_place():
    """MABNCallback's renormalization switch reaches BatchRenorm2d through the device tensor that the policy
    setter updates in place (what a captured CUDA graph reads): off, r = 1 and d = 0 (plain BN); on, the
    ramped clipping applies."""
    layer = LAYERS["brn_ghost"]()
    layer.track_stats = True
    layer.policy = (True, False)
    steps = list(_stream(12))
    for x, g in steps[:8]:
        _train_step(layer, x, g)
        assert bool((layer.last_stats["r"] == 1).all() and (layer.last_stats["d"] == 0).all())
    flags = layer.policy_flags(torch.device("cpu"))
    layer.policy = (True, True)
    assert layer.policy_flags(torch.device("cpu")) is flags and flags.tolist() == [1, 1]
    for x, g in steps[8:]:
        _train_step(layer, x, g)
    assert bool((layer.last_stats["r"] != 1).any() or (layer.last_stats["d"] != 0).any())


def test_device_flags_move_with_the_layer_and_stay_put_otherwise():
    """The policy and non-finite flags a compiled or captured step holds: kept by a dtype change, made anew (the
    policy kept, no verdict) where the layer's tensors go, e.g. from the meta device by ``to_empty``."""
    layer = MABN2d(3)
    layer.policy = (True, False)
    flags, policy = layer._flags, layer._policy_flags
    layer.to(torch.float64)
    assert layer._flags is flags and layer._policy_flags is policy
    layer.to("meta")
    assert layer._flags.device.type == "meta" and layer._policy_flags.device.type == "meta"
    layer.to_empty(device="cpu")
    assert layer._flags.tolist() == [False, False] and layer._policy_flags.tolist() == [1, 0]
