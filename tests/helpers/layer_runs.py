"""The runs that hold MABN2d and BatchRenorm2d to the float64 references of ``helpers.reference``: inputs of
varying per-channel scale and mean, one training step of a layer, and the step-by-step comparison (the reference
tests, the Triton kernels and the loss-scale tests share them)."""

from __future__ import annotations

import torch

from helpers.reference import RefMABN, group_slices
from mabn.norm import MABN2d

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
