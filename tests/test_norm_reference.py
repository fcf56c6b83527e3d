"""MABN2d and BatchRenorm2d against the independent float64 references in tests/helpers/reference.py.

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

from helpers.layer_runs import (
    BATCH_IDS,
    BATCHES,
    BRN_CFG,
    MABN_CFG,
    C,
    H,
    W,
    check_mabn_against_reference,
    close,
    compare_run,
    random_affine,
    random_input,
    set_affine,
    train_step,
)  # fmt: skip
from helpers.marks import default_suite_runs
from helpers.reference import RefBRN, RefMABN, RefOfficialImageNetMABN, group_slices
from mabn.callbacks.policy import PhaseRule
from mabn.norm import BatchRenorm2d, MABN2d

pytestmark = pytest.mark.gpu


# ------------------------------------------------------------------------------------------------- MABN2d
@pytest.mark.parametrize("n, norm_batch_size", BATCHES, ids=BATCH_IDS)
@pytest.mark.parametrize("renorm", [True, False], ids=["renorm", "no-renorm"])
@pytest.mark.parametrize("stats", ["batch", "sma", "ema"])
def test_mabn_matches_reference(stats, renorm, n, norm_batch_size, device):
    """MABN2d equals RefMABN step by step through warm-up, moving statistics and clipped renormalization."""
    check_mabn_against_reference(stats, renorm, n, norm_batch_size, device)


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


# The fused path's case takes 4 s in Triton's interpreter: the default suite runs it on a GPU, the slow suite
# everywhere.
@pytest.mark.parametrize(
    "path", default_suite_runs(["torch ops", "fused"], keep=["torch ops"], keep_compiled=["fused"])
)
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
