"""MABN2d and BatchRenorm2d against the independent float64 references in tests/reference.py.

Each run trains for 60 steps with a fresh input of varying per-channel scale and mean and a fresh upstream
gradient, crossing every phase of the schedule (warm-up with batch statistics, moving statistics,
renormalization with clipped r; for BRN the exact-BN phase and the r_max / d_max ramps). After every step the
output, the three gradients, the running buffers and the eval output on a fixed probe are compared. Gradchecks
cover the phases in which the layers are exact derivatives.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from torch.func import functional_call

from mabn.callbacks.policy import PhaseRule
from mabn.norm import BatchRenorm2d, MABN2d
from reference import RefBRN, RefMABN, RefOfficialImageNetMABN, group_slices

RTOL = 1e-9
ATOL = 1e-10
STEPS = 60
C, H, W = 3, 5, 3  # non-square spatial size on purpose

MABN_CFG = dict(buffer_size=4, momentum=0.9, eps=1e-5, warmup_iters=5, renorm_warmup_iters=20, renorm_clip=1.5)
BRN_CFG = dict(eps=1e-5, momentum=0.9, r_max=3.0, d_max=5.0, r_ramp=(5, 30), d_ramp=(5, 20))

# (N, norm_batch_size): three ghost groups of two, one group of six, one group of two.
# Outlier steps (after the renorm warm-up): step -> extra factor on the input scale.
SCALE_JUMPS = {27: 5.0, 41: 0.15, 50: 5.0}

BATCHES = [(6, 2), (6, None), (2, None)]
BATCH_IDS = ["N6-ghost2", "N6-whole", "N2-whole"]


# ------------------------------------------------------------------------------------------------ helpers
def random_affine(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-trivial weight (|w| in [0.5, 2], mixed signs) and bias."""
    magnitude = 0.5 + 1.5 * torch.rand(C, generator=gen, dtype=torch.float64)
    sign = torch.where(torch.rand(C, generator=gen, dtype=torch.float64) < 0.3, -1.0, 1.0).to(torch.float64)
    weight = magnitude * sign
    bias = torch.randn(C, generator=gen, dtype=torch.float64)
    return weight, bias


def random_input(gen: torch.Generator, n: int, step: int = 0) -> torch.Tensor:
    """x = a_t * randn + b_t with per-step, per-channel scale a_t in [0.5, 3] and mean b_t in [-1.5, 1.5].

    On the outlier steps (SCALE_JUMPS) the scale is multiplied further, so that r leaves the clip range even
    when the normalizer is the slow EMA (for stats="ema", r^2 >= momentum, and exceeding renorm_clip needs
    a second moment over ten times the running one).
    """
    scale = 0.5 + 2.5 * torch.rand(1, C, 1, 1, generator=gen, dtype=torch.float64)
    scale = scale * SCALE_JUMPS.get(step, 1.0)
    shift = -1.5 + 3.0 * torch.rand(1, C, 1, 1, generator=gen, dtype=torch.float64)
    return scale * torch.randn(n, C, H, W, generator=gen, dtype=torch.float64) + shift


def set_affine(layer: torch.nn.Module, weight: torch.Tensor, bias: torch.Tensor) -> None:
    with torch.no_grad():
        layer.weight.copy_(weight)
        layer.bias.copy_(bias)


def close(actual: torch.Tensor, expected: torch.Tensor, what: str, step: int) -> None:
    torch.testing.assert_close(
        actual.detach(),
        expected,
        rtol=RTOL,
        atol=ATOL,
        msg=lambda m: f"step {step}: {what} differs from the reference\n{m}",
    )


def train_step(layer: torch.nn.Module, x: torch.Tensor, grad_out: torch.Tensor):
    """One training forward + backward of the library layer; returns (out, grad_x, grad_w, grad_b)."""
    layer.weight.grad = None
    layer.bias.grad = None
    device = layer.weight.device
    x = x.to(device).requires_grad_(True)
    out = layer(x)
    out.backward(grad_out.to(device))
    return tuple(t.detach().cpu().clone() for t in (out, x.grad, layer.weight.grad, layer.bias.grad))


def eval_probe(layer: torch.nn.Module, probe: torch.Tensor) -> torch.Tensor:
    """Eval-mode forward on the probe; asserts no buffer changed, then returns the layer to training mode."""
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    layer.eval()
    with torch.no_grad():
        out = layer(probe.to(layer.weight.device)).cpu()
    layer.train()
    after = layer.state_dict()
    assert before.keys() == after.keys()
    for key in before:
        assert torch.equal(before[key], after[key]), f"eval forward changed state {key!r}"
    return out


def compare_run(layer, ref, gen, n, buffers):
    """Run STEPS training steps on both sides and compare everything after each step.

    `buffers` maps a layer buffer name to a function of the reference giving its expected value.
    """
    probe = random_input(gen, n)
    for step in range(1, STEPS + 1):
        x = random_input(gen, n, step)
        grad_out = torch.randn(n, C, H, W, generator=gen, dtype=torch.float64)

        out, gx, gw, gb = train_step(layer, x, grad_out)
        ref_out = ref.forward(x)
        ref_gx, ref_gw, ref_gb = ref.backward(grad_out)
        close(out, ref_out, "output", step)
        close(gx, ref_gx, "grad wrt input", step)
        close(gw, ref_gw, "grad wrt weight", step)
        close(gb, ref_gb, "grad wrt bias", step)
        for name, expected in buffers.items():
            close(getattr(layer, name).cpu(), expected(ref), f"buffer {name}", step)
        close(eval_probe(layer, probe), ref.eval(probe), "eval output on the probe", step)


# ------------------------------------------------------------------------------------------------- MABN2d
@pytest.mark.parametrize("n, norm_batch_size", BATCHES, ids=BATCH_IDS)
@pytest.mark.parametrize("renorm", [True, False], ids=["renorm", "no-renorm"])
@pytest.mark.parametrize("stats", ["batch", "sma", "ema"])
def test_mabn_matches_reference(stats, renorm, n, norm_batch_size, device):
    """MABN2d equals RefMABN step by step through warm-up, moving statistics and clipped renormalization."""
    check_mabn_against_reference(stats, renorm, n, norm_batch_size, device)


def check_mabn_against_reference(stats, renorm, n, norm_batch_size, device):
    gen = torch.Generator().manual_seed(1234)
    weight, bias = random_affine(gen)
    layer = MABN2d(C, norm_batch_size=norm_batch_size, stats=stats, renorm=renorm, **MABN_CFG).double().to(device)
    set_affine(layer, weight, bias)
    layer.train()
    ref = RefMABN(weight, bias, norm_batch_size=norm_batch_size, stats=stats, renorm=renorm, **MABN_CFG)

    compare_run(layer, ref, gen, n, {"running_var": lambda r: r.ema})

    # The run must really have crossed the phases it is meant to test.
    n_groups = len(group_slices(n, norm_batch_size))
    assert all(len(rec["active"]) == n_groups for rec in ref.log)
    active = [a for rec in ref.log for a in rec["active"]]
    if stats == "batch":
        assert not any(active)
    else:
        assert any(active) and not all(active), "both warm-up and moving-statistics groups must occur"
        first_active_step = next(rec["t"] for rec in ref.log if any(rec["active"]))
        assert first_active_step == MABN_CFG["warmup_iters"]
    clip = MABN_CFG["renorm_clip"]
    applied_r = torch.stack([r for rec in ref.log for r in rec["r"]])
    if renorm:
        renorm_r = [
            (raw, r) for rec in ref.log if rec["renorm_on"] for raw, r in zip(rec["r_raw"], rec["r"], strict=True)
        ]
        assert len(renorm_r) > 0
        raw = torch.stack([p[0] for p in renorm_r])
        applied = torch.stack([p[1] for p in renorm_r])
        assert ((raw > clip) | (raw < 1 / clip)).any(), "r was never clipped at a bound"
        assert ((applied == clip) | (applied == 1 / clip)).any()
        inside = (applied > 1 / clip) & (applied < clip) & (applied != 1)
        assert inside.any(), "no r strictly inside the clip range"
    else:
        assert torch.all(applied_r == 1)


@pytest.mark.parametrize("stats", ["batch", "sma", "ema"])
@pytest.mark.parametrize("norm_batch_size", [None, 2], ids=["whole", "ghost2"])
def test_mabn_gradcheck_warmup(norm_batch_size, stats):
    """In warm-up (batch statistics, r = 1) MABN2d is the exact derivative of w * x / sqrt(chi2 + eps) + b."""
    gen = torch.Generator().manual_seed(7)
    layer = MABN2d(
        2,
        buffer_size=4,
        warmup_iters=10**6,
        renorm_warmup_iters=10,
        norm_batch_size=norm_batch_size,
        stats=stats,
    ).double()
    layer.train()
    x = (1.5 * torch.randn(4, 2, 3, 2, generator=gen, dtype=torch.float64) + 0.5).requires_grad_(True)
    weight, bias = random_affine(gen)
    weight = weight[:2].clone().requires_grad_(True)
    bias = bias[:2].clone().requires_grad_(True)

    def fn(x, w, b):
        return functional_call(layer, {"weight": w, "bias": b}, (x,))

    assert torch.autograd.gradcheck(fn, (x, weight, bias), eps=1e-6, atol=1e-7, rtol=1e-5)


# ---------------------------------------------------------------------------------------------------- BRN
@pytest.mark.parametrize("n, norm_batch_size", BATCHES, ids=BATCH_IDS)
def test_brn_matches_reference(n, norm_batch_size, device):
    """BatchRenorm2d equals RefBRN step by step through the exact-BN phase and the r_max / d_max ramps."""
    gen = torch.Generator().manual_seed(4321)
    weight, bias = random_affine(gen)
    layer = BatchRenorm2d(C, norm_batch_size=norm_batch_size, **BRN_CFG).double().to(device)
    set_affine(layer, weight, bias)
    layer.train()
    ref = RefBRN(weight, bias, norm_batch_size=norm_batch_size, **BRN_CFG)

    compare_run(layer, ref, gen, n, {"running_mean": lambda r: r.running_mean, "running_std": lambda r: r.running_std})

    # Phases: exact BN first (r = 1, d = 0), then r and d both clipped at a bound and both free at times.
    exact = [rec for rec in ref.log if rec["rmax"] == 1.0 and rec["dmax"] == 0.0]
    assert exact and all(torch.all(r == 1) for rec in exact for r in rec["r"])
    ramped = [rec for rec in ref.log if rec["rmax"] > 1.0]
    r_clipped = any(((raw > rec["rmax"]) | (raw < 1 / rec["rmax"])).any() for rec in ramped for raw in rec["r_raw"])
    d_clipped = any((raw.abs() > rec["dmax"]).any() for rec in ramped for raw in rec["d_raw"])
    r_free = any(((r != 1) & (r < rec["rmax"]) & (r > 1 / rec["rmax"])).any() for rec in ramped for r in rec["r"])
    d_free = any(((d != 0) & (d.abs() < rec["dmax"])).any() for rec in ramped for d in rec["d"])
    assert r_clipped and d_clipped and r_free and d_free


@pytest.mark.parametrize("norm_batch_size", [None, 2], ids=["whole", "ghost2"])
def test_brn_gradcheck_exact_bn_phase(norm_batch_size):
    """Before r_ramp[0] (r = 1, d = 0) BatchRenorm2d is exact BN: autograd matches finite differences."""
    gen = torch.Generator().manual_seed(11)
    layer = BatchRenorm2d(2, norm_batch_size=norm_batch_size).double()
    layer.train()
    x = (1.5 * torch.randn(4, 2, 3, 2, generator=gen, dtype=torch.float64) + 0.5).requires_grad_(True)
    weight, bias = random_affine(gen)
    weight = weight[:2].clone().requires_grad_(True)
    bias = bias[:2].clone().requires_grad_(True)

    def fn(x, w, b):
        return functional_call(layer, {"weight": w, "bias": b}, (x,))

    assert torch.autograd.gradcheck(fn, (x, weight, bias), eps=1e-6, atol=1e-7, rtol=1e-5)


# ----------------------------------------------------------------------- checks of the references themselves
@pytest.mark.parametrize("norm_batch_size", [None, 2], ids=["whole", "ghost2"])
def test_ref_mabn_batch_stats_backward_is_exact(norm_batch_size):
    """RefMABN's hand-written backward equals autograd of w * r * x / sqrt(chi2 + eps) + b whenever it uses
    batch statistics, including steps where the renorm r is not 1 (r is a constant)."""
    gen = torch.Generator().manual_seed(3)
    weight, bias = random_affine(gen)
    cfg = dict(MABN_CFG, warmup_iters=1, renorm_warmup_iters=3)
    ref = RefMABN(weight, bias, norm_batch_size=norm_batch_size, stats="batch", **cfg)
    saw_r = False
    for _ in range(8):
        x = random_input(gen, 6).requires_grad_(True)
        grad_out = torch.randn(6, C, H, W, generator=gen, dtype=torch.float64)
        out_ref = ref.forward(x)
        gx, gw, gb = ref.backward(grad_out)
        assert not any(ref.log[-1]["active"])
        w = weight.clone().requires_grad_(True)
        b = bias.clone().requires_grad_(True)
        outs = []
        for sl, r in zip(group_slices(6, norm_batch_size), ref.log[-1]["r"], strict=True):
            xg = x[sl]
            chi2 = (xg * xg).mean(dim=(0, 2, 3))
            outs.append(
                w.view(1, -1, 1, 1) * r.view(1, -1, 1, 1) * xg / torch.sqrt(chi2 + cfg["eps"]).view(1, -1, 1, 1)
                + b.view(1, -1, 1, 1)
            )
            saw_r = saw_r or bool((r != 1).any())
        out = torch.cat(outs)
        ax, aw, ab = torch.autograd.grad(out, (x, w, b), grad_out)
        torch.testing.assert_close(out_ref, out.detach(), rtol=1e-12, atol=1e-12)
        for got, want in ((gx, ax), (gw, aw), (gb, ab)):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert saw_r


@pytest.mark.parametrize("norm_batch_size", [None, 2], ids=["whole", "ghost2"])
def test_ref_brn_backward_is_exact_with_constant_r_d(norm_batch_size):
    """RefBRN's hand-written backward equals autograd of w * (xhat * r + d) + b with r, d held constant,
    in every phase."""
    gen = torch.Generator().manual_seed(5)
    weight, bias = random_affine(gen)
    ref = RefBRN(weight, bias, norm_batch_size=norm_batch_size, **BRN_CFG)
    for _ in range(25):
        x = random_input(gen, 6).requires_grad_(True)
        grad_out = torch.randn(6, C, H, W, generator=gen, dtype=torch.float64)
        out_ref = ref.forward(x)
        gx, gw, gb = ref.backward(grad_out)
        w = weight.clone().requires_grad_(True)
        b = bias.clone().requires_grad_(True)
        rec = ref.log[-1]
        outs = []
        for sl, r, d in zip(group_slices(6, norm_batch_size), rec["r"], rec["d"], strict=True):
            xg = x[sl]
            mu = xg.mean(dim=(0, 2, 3), keepdim=True)
            var = ((xg - mu) ** 2).mean(dim=(0, 2, 3), keepdim=True)
            xhat = (xg - mu) / torch.sqrt(var + BRN_CFG["eps"])
            outs.append(w.view(1, -1, 1, 1) * (xhat * r.view(1, -1, 1, 1) + d.view(1, -1, 1, 1)) + b.view(1, -1, 1, 1))
        out = torch.cat(outs)
        ax, aw, ab = torch.autograd.grad(out, (x, w, b), grad_out)
        torch.testing.assert_close(out_ref, out.detach(), rtol=1e-12, atol=1e-12)
        for got, want in ((gx, ax), (gw, aw), (gb, ab)):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_mabn_without_input_gradient_matches(device):
    """A first layer's input needs no gradient; the backward then takes another native kernel path (on CUDA
    one that demands saved statistics), and must still give the same parameter gradients and buffers."""
    gen = torch.Generator().manual_seed(99)
    layers = [MABN2d(C, norm_batch_size=2, **MABN_CFG).double().to(device) for _ in range(2)]
    for step in range(1, 26):  # crosses warm-up, moving statistics and renormalization
        x = random_input(gen, 4, step).to(device)
        grad_out = torch.randn(4, C, H, W, generator=gen, dtype=torch.float64).to(device)
        for layer, needs in zip(layers, (True, False)):
            layer.zero_grad(set_to_none=True)
            layer(x.clone().requires_grad_(needs)).backward(grad_out)
        for a, b in zip(layers[0].parameters(), layers[1].parameters()):
            close(b.grad.cpu(), a.grad.cpu(), "parameter gradient", step)
        # Equal up to rounding: without dL/dx the native kernel reduces in another order (on CUDA).
        for (name, a), b in zip(layers[0].named_buffers(), layers[1].buffers()):
            close(b.cpu(), a.cpu().to(b.dtype), f"buffer {name}", step)


# ------------------------------------------------------------------------- the official ImageNet timeline
def stage1_mabn_layer(channels: int) -> tuple[MABN2d, PhaseRule, int]:
    """A MABN2d as stage 1 builds it from configs/pretrain.yaml (norm_options, norm_batch_size), the phase rule of
    its module group, and the per-device batch."""
    config = yaml.safe_load((Path(__file__).resolve().parents[1] / "configs" / "pretrain.yaml").read_text())
    model = config["model"]["init_args"]
    options = dict(model["norm_options"]["mabn"])
    (rule,) = model["norm_policy"]["groups"].values()
    layer = MABN2d(channels, norm_batch_size=model["norm_batch_size"], **options)
    return layer, PhaseRule(**rule), config["data"]["init_args"]["batch_size"]


@pytest.mark.parametrize("path", ["torch ops", "fused"])
def test_stage1_mabn_follows_the_official_imagenet_code(path, monkeypatch, device):
    """Stage 1's MABN layer, driven by its phase rule step by step as MABNCallback drives it, equals the official
    ImageNet layer (RefOfficialImageNetMABN) forward by forward: batch statistics at the first forward only, SMA
    from the second, r clipped from the 100th, the EMA started at the first forward's statistic. Triton's
    interpreter runs the fused kernels through the start of the timeline only (0.7 s a step); on a GPU they run
    all of it."""
    import mabn.norm.mabn as mabn_module
    from mabn.norm.fused import load

    kernels = load("mabn_kernels") if path == "fused" else None
    if path == "fused":
        assert kernels is not None, "Triton (or its interpreter) is not importable"
    monkeypatch.setattr(mabn_module, "_fused_kernels", lambda x: kernels)
    gen = torch.Generator().manual_seed(7)
    layer, rule, n = stage1_mabn_layer(C)
    layer = layer.double().to(device)
    weight, bias = random_affine(gen)
    set_affine(layer, weight, bias)
    ref = RefOfficialImageNetMABN(weight, bias, buffer_size=layer.buffer_size, momentum=layer.momentum, eps=layer.eps)
    jumps = {101: 10.0, 104: 0.05}  # far outside the EMA: r must meet both clip bounds
    steps = 5 if path == "fused" and device.type == "cpu" else 106
    for step in range(steps):
        layer.policy = rule.phase(step)
        x = random_input(gen, n, step) * jumps.get(step + 1, 1.0)
        grad_out = torch.randn(n, C, H, W, generator=gen, dtype=torch.float64)
        out, gx, gw, gb = train_step(layer, x, grad_out)
        t = step + 1
        close(out, ref.forward(x), "output", t)
        for what, mine, theirs in zip(("grad wrt input", "grad wrt weight", "grad wrt bias"), (gx, gw, gb),
                                      ref.backward(grad_out), strict=True):  # fmt: skip
            close(mine, theirs, what, t)
        close(layer.running_var.cpu(), ref.running_var, "running_var (EMA)", t)
    if steps > 99:  # the run crossed what it is meant to test: r = 1 for 99 forwards, then clipped at both bounds
        r = torch.stack([rec["r"] for rec in ref.log])
        assert torch.all(r[:99] == 1) and (r[100:] == 5.0).any() and (r[100:] == 0.2).any()
