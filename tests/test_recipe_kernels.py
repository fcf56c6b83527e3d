"""MABN2d's Triton kernels at the shapes the recipes run them, held to the float64 reference: the first section of
``make gpu-check`` (``mabn.tools.bench.devicetests.KERNELS``), so that what the check measures afterwards is MABN.

A statistic kernel is compiled for its G ghost batches of B samples, its history of M statistics and its BLOCK
channels per program. The recipes fix them: stage 1 (configs/pretrain.yaml) normalizes 32 images per device in ghost
batches of 2 (G=16, B=2, M=16), its EMA started at the first statistic; stage 2 (configs/cityscapes.yaml) one ghost
batch of 2 per device on the recipe's 8 GPUs (G=1, B=2, M=16). ResNet-101's norms have 64 to 2048 channels: grids of
2 to 64 programs of 32 channels. Each variant runs in float32 and in bfloat16 (float32 parameters and statistics, as
under autocast), NCHW and channels_last, 20 training steps through its recipe's phases (moved to the first 20 steps):
batch statistics, the moving averages, renormalization with r at both clip bounds; every output, gradient, history
and EMA after every step against the reference. Then a non-finite value in one program of 32 (the programs' common
verdict: the last program restores every program's channels), and on CUDA the direct launch against Triton's own and
CUDA-graph replays with two accumulated micro-batches against eager steps.

On the CPU the kernels run through Triton's interpreter, one program after another at 0.05 s (G=1) to 0.2 s (G=16)
per program and direction: the default suite runs stage 2 at 64 channels in float32, the slow suite the other
64-channel variants and the non-finite cases, and the wider grids (minutes a case there) run on a GPU only. With
MABN_TEST_DEVICE=cuda no case is slow. The module needs torch, Triton, PyYAML and pytest alone: the GPU check runs
it where the training's other libraries may be missing (tests/test_gpu_check.py hides them).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
import yaml
from torch import nn

import mabn.tasks.cudagraph as cudagraph
from helpers.kernels import kernels, take
from helpers.marks import where_interpreted
from helpers.reference import RefMABN
from helpers.stream_runs import H, W, history, inputs
from mabn.norm import CenConv2d, MABN2d, mabn_kernels, row_kernels
from mabn.norm.phase import phase
from mabn.recipes import CONFIGS

pytestmark = pytest.mark.gpu

# Stage 2's per-device batch: the recipe's global batch over the 8 GPUs it is written for (docs/scaling.md).
RECIPE_GPUS = 8
STEPS = 20


@dataclass(frozen=True)
class Recipe:
    """A stage's MABN2d as its recipe builds it: the per-device batch, the ghost batch, the layer's options and its
    module groups' phases (the first step of the moving averages, of renormalization)."""

    batch: int
    norm_batch_size: int
    options: dict
    first_steps: tuple[int, int]

    @property
    def groups(self) -> int:
        return self.batch // self.norm_batch_size

    def timeline(self) -> tuple[int, int]:
        """The phases moved into the first STEPS steps, in their order: the moving averages from step 3 at the latest
        (stage 1's recipe: 2), renormalization from step 8; stage 2's history of 16 single groups then fills at
        step 16, so its moving averages start at step 17 under renormalization."""
        moving, renorm = self.first_steps
        return min(moving, 3), min(renorm, 8)

    def layer(self, channels: int) -> MABN2d:
        return MABN2d(channels, norm_batch_size=self.norm_batch_size, **self.options)


def _recipe(config: str) -> Recipe:
    recipe = yaml.safe_load((CONFIGS / config).read_text())
    model, data = recipe["model"]["init_args"], recipe["data"]["init_args"]
    batch = data.get("batch_size") or data["global_batch_size"] // RECIPE_GPUS
    # Every module group of a recipe on one timeline.
    (first_steps,) = {
        (g["moving_stats_first_step"], g["renorm_first_step"]) for g in model["norm_policy"]["groups"].values()
    }
    return Recipe(batch, model["norm_batch_size"], dict(model["norm_options"]["mabn"]), first_steps)


RECIPES = {1: _recipe("pretrain.yaml"), 2: _recipe("cityscapes.yaml")}
CHANNELS = (64, 128, 256, 512, 1024, 2048)  # ResNet-101's norms: grids of 2 to 64 programs
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
LAYOUTS = {"nchw": torch.contiguous_format, "channels-last": torch.channels_last}
DEFAULT_SUITE = (2, 64, "float32", "nchw")  # a few seconds in Triton's interpreter
# Input scale jumps in the renormalization phase: r = sqrt(var / EMA) leaves [1/5, 5] both ways.
JUMPS = {10: 10.0, 14: 0.05, 15: 0.05}

# The statistics (float32): a step's chi^2 and psi rounded to float32, carried by the moving averages through 20
# steps. The outputs and dL/dx in bfloat16: one rounding of a float32 value (2^-8 to nearest on a GPU, 2^-7 by
# truncation in Triton's interpreter).
STATISTICS = dict(rtol=1e-4, atol=1e-5)
ACTIVATIONS = {torch.float32: STATISTICS, torch.bfloat16: dict(rtol=2**-7, atol=1e-4)}


def _marks(stage: int, channels: int, dtype: str, layout: str) -> list:
    if (stage, channels, dtype, layout) == DEFAULT_SUITE:
        return []
    if channels == CHANNELS[0]:
        return where_interpreted(pytest.mark.slow)
    return where_interpreted(pytest.mark.gpu(cuda_only=True))


VARIANTS = [
    pytest.param(s, c, d, lay, id=f"stage{s}-{c}ch-{d}-{lay}", marks=_marks(s, c, d, lay))
    for s in RECIPES
    for c in CHANNELS
    for d in DTYPES
    for lay in LAYOUTS
]


def test_the_recipes_kernel_variants():
    """The shapes the statistic kernels are compiled for at each recipe, and the grids of ResNet-101's widths."""
    shapes = {}
    for stage, recipe in RECIPES.items():
        layer = recipe.layer(64)
        shapes[stage] = (recipe.groups, recipe.norm_batch_size, layer.buffer_size, layer.stats, layer.ema_start)
        moving, renorm = recipe.timeline()
        assert layer.renorm and moving < renorm < STEPS and recipe.first_steps[0] < recipe.first_steps[1]
    assert shapes == {1: (16, 2, 16, "sma", "first"), 2: (1, 2, 16, "sma", "one")}
    assert mabn_kernels.MAX_BLOCK == 32
    assert [-(-c // mabn_kernels.MAX_BLOCK) for c in CHANNELS] == [2, 4, 8, 16, 32, 64]


def _pair(stage: int, channels: int, device: torch.device) -> tuple[MABN2d, RefMABN]:
    """The recipe's float32 layer on ``device`` with a random affine, and the reference on its timeline."""
    recipe = RECIPES[stage]
    moving, renorm = recipe.timeline()
    layer = recipe.layer(channels).to(device)
    gen = torch.Generator().manual_seed(channels + stage)
    with torch.no_grad():
        layer.weight.copy_(
            torch.where(torch.rand(channels, generator=gen) < 0.3, -1.0, 1.0)
            * (0.5 + torch.rand(channels, generator=gen))
        )
        layer.bias.copy_(torch.randn(channels, generator=gen))
    ref = RefMABN(
        layer.weight.detach().cpu().double(), layer.bias.detach().cpu().double(), buffer_size=layer.buffer_size,
        momentum=layer.momentum, eps=layer.eps, renorm_clip=layer.renorm_clip, norm_batch_size=layer.norm_batch_size,
        warmup_iters=moving, renorm_warmup_iters=renorm - 1, ema_start=layer.ema_start,
    )  # fmt: skip
    return layer, ref


def _steps(
    layer: MABN2d, stage: int, steps: range, dtype: torch.dtype, layout: torch.memory_format, gen: torch.Generator
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]]:
    """Training steps ``steps`` of ``layer`` on its recipe's timeline, as MABNCallback sets the policy: each step's
    number, its input and output gradient (float64, of ``dtype``'s values) and (output, dL/dx, dL/dweight,
    dL/dbias)."""
    device = layer.weight.device
    for t in steps:
        layer.policy = phase(t, *RECIPES[stage].timeline())
        x, grad = inputs(gen, RECIPES[stage].batch, layer.num_features)
        x, grad = (v.to(dtype).to(memory_format=layout) for v in (x * JUMPS.get(t, 1.0), grad))
        xd = x.to(device).requires_grad_()
        layer.weight.grad = layer.bias.grad = None
        out = layer(xd)
        out.backward(grad.to(device))
        yield t, x.double(), grad.double(), (out.detach(), xd.grad, layer.weight.grad.clone(), layer.bias.grad.clone())


def _check_step(layer: MABN2d, ref: RefMABN, t: int, x, grad, results, dtype: torch.dtype) -> None:
    """One step of ``layer`` (``results``) against the reference's on the same values: outputs, gradients, both
    histories and the EMA."""
    expected = (ref.forward(x), *ref.backward(grad))
    tolerances = (ACTIVATIONS[dtype], ACTIVATIONS[dtype], STATISTICS, STATISTICS)
    for name, a, e, tol in zip(
        ("output", "dL/dx", "dL/dweight", "dL/dbias"), results, expected, tolerances, strict=True
    ):
        assert a.dtype == (dtype if name in ("output", "dL/dx") else torch.float32), name
        torch.testing.assert_close(a.cpu().double(), e, **tol, msg=lambda m, name=name: f"step {t}: {name}\n{m}")
    m = layer.buffer_size
    for name, a, e in (
        ("chi^2 history", layer.buffer_x2, history(ref.chi2_stream, m)),
        ("psi history", layer.buffer_gz, history(ref.psi_stream, m)),
        ("EMA", layer.running_var, ref.ema),
    ):
        torch.testing.assert_close(
            a.cpu().double(), e, **STATISTICS, msg=lambda msg, name=name: f"step {t}: {name}\n{msg}"
        )


def _crossed_every_phase(ref: RefMABN) -> None:
    """The run met batch statistics, the moving averages and renormalization with r at both clip bounds and inside."""
    active = [a for record in ref.log for a in record["active"]]
    assert any(active) and not all(active), "both batch statistics and moving averages"
    r = torch.stack([r for record in ref.log if record["renorm_on"] for r in record["r"]])
    clip = ref.renorm_clip
    assert (r == clip).any() and (r == 1 / clip).any(), "r at both clip bounds"
    assert ((r > 1 / clip) & (r < clip) & (r != 1)).any(), "r inside the clip range"


@pytest.mark.parametrize("stage, channels, dtype, layout", VARIANTS)
def test_recipe_variant_matches_reference(stage, channels, dtype, layout, device, monkeypatch):
    take(monkeypatch, kernels())
    layer, ref = _pair(stage, channels, device)
    gen = torch.Generator().manual_seed(stage)
    for t, x, grad, results in _steps(layer, stage, range(1, STEPS + 1), DTYPES[dtype], LAYOUTS[layout], gen):
        _check_step(layer, ref, t, x, grad, results, DTYPES[dtype])
    _crossed_every_phase(ref)
    groups = RECIPES[stage].groups
    assert (int(layer.iters), int(layer.count_x2), int(layer.count_gz)) == (STEPS, STEPS * groups, STEPS * groups)


PROGRAMS = 32
BAD_CHANNEL = 17 * mabn_kernels.MAX_BLOCK + 5  # in program 17 of 32: neither the first program nor the last


# Triton's interpreter computes with numpy, which warns of the NaN it is given.
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize(
    "stage", [pytest.param(s, id=f"stage{s}", marks=where_interpreted(pytest.mark.slow)) for s in RECIPES]
)
def test_non_finite_value_in_one_program_of_32(stage, device, monkeypatch):
    """A NaN in one channel's input, then an infinite gradient in one channel, each in program 17 of 32: the last
    program, which finds that another met it, restores every program's history and EMA from the undo log (the
    steps' counters stay), and the layer reports the direction; the tickets are zero again. The next finite steps go
    on as the reference, which never saw the bad ones."""
    take(monkeypatch, kernels())
    channels = PROGRAMS * mabn_kernels.MAX_BLOCK
    layer, ref = _pair(stage, channels, device)
    gen = torch.Generator().manual_seed(11)
    # A stream in the recipe's steady state (moving averages, renormalization), the reference's alike.
    m, groups, t = layer.buffer_size, RECIPES[stage].groups, STEPS
    with torch.no_grad():
        layer.buffer_x2.copy_(0.5 + 2 * torch.rand(m, channels, generator=gen))
        layer.buffer_gz.copy_(0.1 * torch.randn(m, channels, generator=gen))
        layer.running_var.copy_(0.5 + 2 * torch.rand(channels, generator=gen))
        for counter, value in ((layer.iters, t), (layer.count_x2, t * groups), (layer.count_gz, t * groups)):
            counter.fill_(value)
    ref.chi2_stream = list(layer.buffer_x2.cpu().double())
    ref.psi_stream = list(layer.buffer_gz.cpu().double())
    ref.ema, ref.t = layer.running_var.cpu().double(), t
    tickets = layer.tickets(device)

    def left_as(before: dict, what: str) -> None:
        for key, value in layer.state_dict().items():
            assert torch.equal(value, before[key]), f"{key} changed by {what}"
        assert tickets.tolist() == [0, 0], what

    def finite_step(t: int) -> None:
        (step,) = _steps(layer, stage, range(t, t + 1), torch.float32, torch.contiguous_format, gen)
        _check_step(layer, ref, *step, torch.float32)

    before = copy.deepcopy(layer.state_dict())
    x, _ = inputs(gen, RECIPES[stage].batch, channels)
    x[1, BAD_CHANNEL, 1, 2] = float("nan")
    with pytest.raises(FloatingPointError, match="chi"):
        layer(x.float().to(device))
        layer.raise_if_nonfinite()
    left_as(before, "a NaN in program 17's input")
    finite_step(t + 1)

    x, grad = inputs(gen, RECIPES[stage].batch, channels)
    xd = x.float().to(device).requires_grad_()
    out = layer(xd)
    torch.testing.assert_close(out.cpu().double(), ref.forward(x.float().double()), **STATISTICS)
    after_forward = copy.deepcopy(layer.state_dict())
    grad[0, BAD_CHANNEL, 0, 0] = float("inf")
    with pytest.raises(FloatingPointError, match="psi"):
        out.backward(grad.float().to(device))
        layer.raise_if_nonfinite()
    left_as(after_forward, "an infinite gradient in program 17")
    finite_step(t + 3)
    # Three forwards and two backwards went into the streams, the bad ones did not.
    counts = (int(layer.iters), int(layer.count_x2), int(layer.count_gz))
    assert counts == (t + 3, (t + 3) * groups, (t + 2) * groups)


# Every launcher of MABN2d's kernels: the statistic steps and the passes over the activations.
LAUNCHERS = (mabn_kernels._forward, mabn_kernels._backward, row_kernels._affine, row_kernels._row_sums)


@pytest.mark.gpu(cuda_only=True)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("stage", RECIPES)
def test_fast_launch_equals_tritons_own(stage, dtype, device, monkeypatch):
    """The launcher's direct path (a configuration's compiled kernel called straight away after its first launch,
    through Triton's private launch API) gives every output, gradient and buffer bit for bit as Triton's own launch
    of every kernel, over the 20 steps at 2048 channels (64 programs)."""
    take(monkeypatch, kernels())
    assert all(launcher.direct for launcher in LAUNCHERS), "the direct launch is off (MABN_TRITON_DIRECT=0?)"
    runs = {}
    for path, direct in (("direct", True), ("Triton's", False)):
        for launcher in LAUNCHERS:
            monkeypatch.setattr(launcher, "direct", direct)
            monkeypatch.setattr(launcher, "compiled", {})
        layer, _ = _pair(stage, CHANNELS[-1], device)
        gen = torch.Generator().manual_seed(stage)
        steps = _steps(layer, stage, range(1, STEPS + 1), DTYPES[dtype], torch.contiguous_format, gen)
        runs[path] = [results for *_, results in steps], layer.state_dict()
        kept = [len(launcher.compiled) for launcher in LAUNCHERS]
        assert all(kept) if direct else not any(kept), f"{path} path: compiled kernels kept {kept}"
    (direct, direct_state), (own, own_state) = runs.values()
    for t, (a, b) in enumerate(zip(direct, own, strict=True), 1):
        for name, u, v in zip(("output", "dL/dx", "dL/dweight", "dL/dbias"), a, b, strict=True):
            assert torch.equal(u, v), f"step {t}: {name}"
    for key, value in direct_state.items():
        assert torch.equal(value, own_state[key]), key


def _net(stage: int) -> nn.Sequential:
    """A centred conv and the recipe's MABN2d at 64 channels, a conv to 2048 channels and the recipe's MABN2d there,
    a classifier."""
    recipe = RECIPES[stage]
    return nn.Sequential(
        CenConv2d(3, 64, 3, padding=1, bias=False), recipe.layer(64), nn.ReLU(),
        nn.Conv2d(64, 2048, 1, bias=False), recipe.layer(2048), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2048, 10),
    )  # fmt: skip


MICRO_BATCHES = 2


@pytest.mark.gpu(cuda_only=True)
@pytest.mark.parametrize("stage", RECIPES)
def test_graphed_steps_with_accumulated_micro_batches_equal_eager(stage, device, monkeypatch):
    """Real CUDA graphs (``mabn.tasks.cudagraph``) replay the recipe's kernels: 20 forwards, two micro-batches
    accumulated per SGD step, through the phases of the recipe's timeline (the policy read from the device at each
    replay), give the eager loop's losses, weights and every buffer."""
    take(monkeypatch, kernels())
    torch.manual_seed(0)
    eager = _net(stage).to(device)
    graphed = copy.deepcopy(eager)
    gen = torch.Generator().manual_seed(5)
    batch = RECIPES[stage].batch
    batches = [
        (
            (2 * torch.randn(batch, 3, H, W, generator=gen) + 0.3).to(device),
            torch.randint(0, 10, (batch,), generator=gen).to(device),
        )
        for _ in range(STEPS)
    ]
    cudagraph.graph_training_forward(graphed, batches[0][0])
    losses = {}
    for name, net in (("eager", eager), ("graphed", graphed)):
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        losses[name] = []
        for t, (x, y) in enumerate(batches, 1):
            for layer in (net[1], net[4]):
                layer.policy = phase(t, *RECIPES[stage].timeline())
            loss = F.cross_entropy(net(x), y) / MICRO_BATCHES
            loss.backward()
            losses[name].append(loss.detach())
            if t % MICRO_BATCHES == 0:
                opt.step()
                opt.zero_grad(set_to_none=True)
    assert cudagraph.is_graphed(graphed) and not cudagraph.is_graphed(eager)
    torch.testing.assert_close(torch.stack(losses["graphed"]), torch.stack(losses["eager"]), rtol=1e-5, atol=1e-6)
    expected = eager.state_dict()
    for key, value in graphed.state_dict().items():
        torch.testing.assert_close(value, expected[key], rtol=1e-4, atol=1e-6, msg=key)
    assert int(graphed[4].iters) == STEPS
