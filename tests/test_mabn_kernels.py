"""MABN2d's one-launch Triton statistic steps (the CUDA path) against the float64 reference and the torch-op steps,
on a grid of one program and of several (GRIDS).

On the CPU the kernels run through Triton's interpreter (tests/conftest.py), forced on by the ``fused`` fixture;
with MABN_TEST_DEVICE=cuda they run compiled, as in training.
"""

from __future__ import annotations

import copy

import pytest
import torch

from helpers.kernels import kernels, paths, programs_of, take
from helpers.layer_runs import BATCH_IDS, BATCHES, check_mabn_against_reference
from helpers.marks import default_suite_runs, where_interpreted
from mabn.norm import MABN2d

pytestmark = pytest.mark.gpu


@pytest.fixture
def fused(monkeypatch):
    take(monkeypatch, kernels())


# The grid: the layer's channels in one program, or in programs of 2 channels each (3 channels: 2 programs, 5: 3,
# the last one partial), as a layer of more channels than the kernels' MAX_BLOCK runs. The programs agree on the
# verdict before the layer's state is final, and every program derives the groups' active flags by itself.
GRIDS = {"one-program": None, "blocks-of-2": 2}


# Triton's interpreter on the CPU runs a kernel ~1000x slower than a GPU: there the whole-batch cases run at one
# batch size (N6-whole and N2-whole take the same kernel path, one group, with 6 or 2 samples in its loop), in the
# slow suite; on a GPU every batch shape runs.
FUSED_BATCHES = [
    pytest.param(
        *b, id=i, marks={"N6-whole": [pytest.mark.gpu(cuda_only=True)], "N2-whole": [pytest.mark.slow]}.get(i, [])
    )
    for b, i in zip(BATCHES, BATCH_IDS, strict=True)
]


# In Triton's interpreter a case takes ~4 s (~10 s on several programs): all run in the slow suite, where the
# default suite holds the kernels to the torch-op steps (test_fused_equals_torch_ops, the steps themselves held to
# the reference by test_norm_reference) and a recipe variant on several programs to the float64 reference
# (tests/test_recipe_kernels.py). On a GPU, MABN's own statistics (sma with renormalization) on programs of 2
# channels run in the kernel section. One program computes what each of several computes, less the agreement
# between them.
@pytest.mark.parametrize(
    "grid",
    [
        # In the interpreter the blocks of 2 run the one program's computation and more: one program runs on a GPU.
        pytest.param("one-program", marks=[pytest.mark.slow, *where_interpreted(pytest.mark.gpu(cuda_only=True))]),
        pytest.param("blocks-of-2", marks=where_interpreted(pytest.mark.slow)),
    ],
)
@pytest.mark.parametrize("n, norm_batch_size", FUSED_BATCHES)
@pytest.mark.parametrize(
    "stats, renorm",
    [
        pytest.param("sma", True, id="sma-True"),
        *(
            pytest.param(s, r, id=f"{s}-{r}", marks=pytest.mark.slow)
            for s, r in [("sma", False), ("ema", True), ("batch", True)]
        ),
    ],
)
def test_fused_matches_reference(stats, renorm, n, norm_batch_size, grid, device, fused, monkeypatch):
    """60 steps through warm-up, moving statistics and clipped renormalization, every output, gradient and
    buffer against the independent float64 reference (rtol 1e-9)."""
    programs_of(monkeypatch, GRIDS[grid])
    check_mabn_against_reference(stats, renorm, n, norm_batch_size, device)


# Beyond the reference run: a callback policy, more groups than buffer entries (the window reaches past the
# history), a buffer of one, batch statistics only.
CONFIGS = {
    "ghost2": dict(norm_batch_size=2),
    "ghost1-buffer2": dict(norm_batch_size=1, buffer_size=2),
    "buffer1": dict(buffer_size=1, norm_batch_size=3),
    "ema-ghost3": dict(norm_batch_size=3, stats="ema"),
    "policy": dict(norm_batch_size=2, policy=(True, True)),
    "policy-off": dict(norm_batch_size=2, policy=(True, False)),
    # As MABNCallback sets it: batch statistics, then moving statistics, then renormalization too.
    "policy-switch": dict(norm_batch_size=2, policy={0: (False, False), 4: (True, False), 8: (True, True)}),
}


def _run(
    layer: MABN2d, steps: int, dtype: torch.dtype, device: torch.device, policies: dict | None = None
) -> list[tuple[torch.Tensor, ...]]:
    """``steps`` training steps; ``policies`` sets the layer's policy before the steps it names."""
    gen = torch.Generator().manual_seed(7)
    results = []
    for t in range(steps):
        if policies and t in policies:
            layer.policy = policies[t]
        scale = 4.0 if t == 9 else 1.0 + 0.1 * t  # one outlier step: r reaches its clip bound
        shape = (6, layer.num_features, 3, 4)
        x = (scale * torch.randn(shape, generator=gen, dtype=dtype) + 0.3).to(device).requires_grad_()
        g = torch.randn(shape, generator=gen, dtype=dtype).to(device)
        layer.weight.grad = layer.bias.grad = None
        out = layer(x)
        out.backward(g)
        results.append((out.detach(), x.grad, layer.weight.grad.clone(), layer.bias.grad.clone()))
    return results


# Every configuration in float64 on one program (the default suite: EMA with ghost groups, and on a GPU ghost
# groups and a short buffer too; the slow suite the others); in float32 the default suite runs the timeline
# MABNCallback drives (on programs of 2 channels, test_fused_matches_reference and the non-finite test run in it).
@pytest.mark.parametrize(
    ("name", "dtype", "grid"),
    default_suite_runs(
        [(name, dtype, grid) for grid in GRIDS for dtype in (torch.float64, torch.float32) for name in sorted(CONFIGS)],
        keep=[
            ("ema-ghost3", torch.float64, "one-program"),
            ("policy-switch", torch.float32, "one-program"),
        ],
        keep_compiled=[(name, torch.float64, "one-program") for name in ("ghost2", "buffer1")],
        ids=[f"{name}-{kind}-{grid}" for grid in GRIDS for kind in ("float64", "float32") for name in sorted(CONFIGS)],
    ),
)
def test_fused_equals_torch_ops(name, dtype, grid, device, monkeypatch):
    programs_of(monkeypatch, GRIDS[grid])
    cfg = dict(CONFIGS[name])
    policy = cfg.pop("policy", None)
    _check_paths_agree(5, cfg, 14, dtype, device, monkeypatch, policy if isinstance(policy, dict) else {0: policy})


@pytest.mark.slow
def test_fused_wide_layer_equals_torch_ops(device, monkeypatch):
    """300 channels at the kernels' own bound of channels per program: a grid of several programs, the last one
    partial, through warm-up, the SMA and renormalization."""
    _check_paths_agree(300, CONFIGS["ghost2"], 8, torch.float64, device, monkeypatch)


def _check_paths_agree(
    channels: int, cfg: dict, steps: int, dtype: torch.dtype, device, monkeypatch, policies: dict | None = None
) -> None:
    """``steps`` training steps of a MABN2d built with ``cfg`` give the same outputs, gradients and buffers on the
    Triton path as on the torch-op path."""
    base = MABN2d(channels, warmup_iters=3, renorm_warmup_iters=5, momentum=0.9, renorm_clip=2.0, **cfg)
    base = base.to(dtype).to(device)
    with torch.no_grad():
        base.weight.uniform_(0.5, 1.5)
        base.bias.uniform_(-0.5, 0.5)
    layers = {}
    for path, chosen in paths():
        take(monkeypatch, chosen)
        layers[path] = copy.deepcopy(base)
        layers[path].results = _run(layers[path], steps, dtype, device, policies)
    rtol = 1e-12 if dtype == torch.float64 else 2e-5
    for t, (a, b) in enumerate(zip(layers["torch ops"].results, layers["fused"].results, strict=True)):
        for what, u, v in zip(("output", "grad x", "grad weight", "grad bias"), a, b, strict=True):
            torch.testing.assert_close(v, u, rtol=rtol, atol=rtol, msg=f"{what} at step {t}")
    expected = layers["torch ops"].state_dict()
    for key, value in layers["fused"].state_dict().items():
        if value.is_floating_point():
            torch.testing.assert_close(value, expected[key], rtol=rtol, atol=rtol, msg=key)
        else:
            assert torch.equal(value, expected[key]), key
    groups = 6 // (cfg.get("norm_batch_size") or 6)
    assert int(expected["iters"]) == steps and int(expected["count_x2"]) == steps * groups


# The statistics' dtype is the input's (float32); the buffers' is the layer's, float64 in the second case: a buffer
# must come back bit for bit also where it holds more bits than the statistics. In Triton's interpreter the default
# suite runs float64 buffers on one program, the slow suite on several too.
NON_FINITE = [(grid, dtype) for dtype in (torch.float32, torch.float64) for grid in GRIDS]


@pytest.mark.parametrize(
    ("grid", "layer_dtype"),
    default_suite_runs(
        NON_FINITE,
        keep=NON_FINITE[:3],
        keep_compiled=NON_FINITE[3:],
        ids=[f"{grid}-{'float32' if dtype == torch.float32 else 'float64-buffers'}" for grid, dtype in NON_FINITE],
    ),
)
def test_fused_non_finite_statistic_leaves_every_buffer(grid, layer_dtype, device, fused, monkeypatch):
    """A non-finite chi^2 (forward) or psi (backward) in one channel leaves every buffer of the layer bit for bit
    as it was and sets that direction's flag; under a loss scale psi's is left unset. On programs of 2 channels
    the bad channel is one program's: the others, all finite, must leave their channels' buffers too. The tickets
    are zero after every launch, where the next launch (or CUDA-graph replay) starts counting."""
    programs_of(monkeypatch, GRIDS[grid])
    layer = MABN2d(5, norm_batch_size=2, warmup_iters=2, renorm_warmup_iters=3, buffer_size=4)
    layer = layer.to(layer_dtype).to(device)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():  # a stream in its steady state: moving statistics and r on, every history row set
        for buf in (layer.buffer_x2, layer.buffer_gz, layer.running_var):
            buf.copy_(0.5 + torch.rand(buf.shape, generator=gen, dtype=torch.float64))
        layer.running_psi.copy_(torch.randn(5, generator=gen, dtype=torch.float64))
        layer.iters.fill_(6)
        layer.count_x2.fill_(18)
        layer.count_gz.fill_(18)
    tickets = layer.tickets(device)

    def left_as(before: dict, what: str) -> None:
        for key, value in layer.state_dict().items():
            assert torch.equal(value, before[key]), f"{key} changed by {what}"
        assert tickets.tolist() == [0, 0], what

    def inputs() -> torch.Tensor:
        return torch.randn(6, 5, 3, 4, generator=gen).to(device).requires_grad_()

    before = copy.deepcopy(layer.state_dict())
    x = inputs().detach()
    x[3, 2, 1, 1] = float("nan")  # channel 2: on programs of 2 channels, the second of three
    with pytest.raises(FloatingPointError, match="chi"):
        layer(x)
        layer.raise_if_nonfinite()
    left_as(before, "a non-finite input")

    out = layer(inputs())
    assert int(layer.iters) == 7 and tickets.tolist() == [0, 0]  # a finite forward commits
    after_forward = copy.deepcopy(layer.state_dict())
    grad = torch.randn(out.shape, generator=gen).to(device)
    grad[0, 4, 0, 0] = float("inf")  # channel 4: the last program, partial
    with pytest.raises(FloatingPointError, match="psi"):
        out.backward(grad)
        layer.raise_if_nonfinite()
    left_as(after_forward, "a non-finite gradient")

    layer.loss_scale = torch.full((), 1024.0, device=device)  # an overflow that the scaler skips: no error
    out = layer(inputs())
    after_forward = copy.deepcopy(layer.state_dict())
    out.backward(grad)
    layer.raise_if_nonfinite()
    left_as(after_forward, "an overflowing scaled gradient")
    out = layer(inputs())
    out.backward(torch.ones_like(out))
    assert int(layer.count_gz) == 21, "a finite backward commits"


def test_tickets_move_with_the_layer_and_stay_put_otherwise():
    """The kernels' tickets, which a captured CUDA graph holds by address: kept by a dtype change, made anew (zero)
    where the layer's tensors go, e.g. from the meta device by ``to_empty``."""
    layer = MABN2d(3)
    tickets = layer.tickets(torch.device("cpu"))
    layer.to(torch.float64)
    assert layer.tickets(torch.device("cpu")) is tickets
    layer.to("meta")
    assert layer._tickets.device.type == "meta"
    layer.to_empty(device="cpu")
    assert layer._tickets.tolist() == [0, 0] and layer._tickets.dtype == torch.int32


@pytest.mark.parametrize(
    "x_dtype",
    default_suite_runs(
        [torch.float16, torch.bfloat16],
        keep=[torch.float16],
        keep_compiled=[torch.bfloat16],
        ids=["float16", "bfloat16"],
    ),
)
def test_fused_low_precision_input_equals_torch_ops(x_dtype, device, monkeypatch):
    """Half-precision activations with float32 parameters and statistics (what autocast gives a norm layer):
    the kernels write the per-sample coefficients in the input's dtype and keep every statistic in float32."""
    base = MABN2d(5, norm_batch_size=2, warmup_iters=3, renorm_warmup_iters=5, momentum=0.9).to(device)
    results, states = {}, {}
    for path, chosen in paths():
        take(monkeypatch, chosen)
        layer = copy.deepcopy(base)
        gen = torch.Generator().manual_seed(11)
        results[path] = []
        for _ in range(8):
            x = (3 * torch.randn(6, 5, 3, 4, generator=gen) + 0.3).to(x_dtype).to(device).requires_grad_()
            out = layer(x)
            out.backward(torch.randn(6, 5, 3, 4, generator=gen).to(x_dtype).to(device))
            assert out.dtype == x.grad.dtype == x_dtype and layer.running_var.dtype == torch.float32
            results[path].append((out.detach().float(), x.grad.float()))
        states[path] = layer.state_dict()
    tol = 1e-3 if x_dtype == torch.float16 else 1e-2  # about one rounding in x's dtype (bfloat16: 2^-8)
    for (a_out, a_gx), (b_out, b_gx) in zip(results["torch ops"], results["fused"], strict=True):
        torch.testing.assert_close(b_out, a_out, rtol=tol, atol=tol)
        torch.testing.assert_close(b_gx, a_gx, rtol=tol, atol=tol)
    for key, value in states["fused"].items():
        torch.testing.assert_close(value, states["torch ops"][key], rtol=2e-5, atol=2e-5, msg=key)


def test_policy_changes_reach_the_kernel_in_place(device, fused):
    """A CUDA graph replays the kernel with the addresses it was captured with: a new policy must be written
    into the same device tensor the kernel reads, not into a new one (that the kernel follows it: the
    "policy-switch" case above)."""
    layer = MABN2d(5, norm_batch_size=2, warmup_iters=100, renorm_warmup_iters=100).to(device)
    layer.policy = (False, False)
    _run(layer, 3, torch.float32, device)
    flags = layer.policy_flags(torch.device(device))
    address = flags.data_ptr()
    layer.policy = (True, True)
    assert flags.data_ptr() == address and flags.tolist() == [1, 1]
    assert layer.policy_flags(torch.device(device)) is flags
    layer.policy = None
    layer.policy = (True, False)
    assert flags.tolist() == [1, 0]
