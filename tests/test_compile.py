"""torch.compile of training steps with MABN2d, BatchRenorm2d and CenConv2d: one graph, the eager numbers.

The layers read nothing from the host inside a traced region (their non-finite verdicts stay in device flags,
read here by ``raise_if_any_nonfinite``, and in a fit by MABNCallback one optimizer step late), so a training step
traces as one graph, and a compiled step computes what the eager one does: outputs, gradients and every buffer.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import CSVLogger
from torch import fx, nn
from torch._dynamo.backends.debugging import aot_eager, boxed_nop
from torch.utils.data import DataLoader, TensorDataset

import mabn.norm.mabn as mabn_module
from helpers.trainer import BARE
from mabn.norm import MABN2d, convert_norm, mabn_ops
from mabn.norm.managed import ManagedNorm, raise_if_any_nonfinite
from mabn.tasks.base import NormTask
from mabn.tools.ablation.model import SmallResNet

pytestmark = pytest.mark.gpu

# Short timelines, so that a few steps cross warm-up (batch statistics), the SMA and renormalization.
LAYER_KWARGS = {
    "mabn": {"warmup_iters": 2, "renorm_warmup_iters": 3, "buffer_size": 2, "norm_batch_size": 2},
    "brn": {"r_ramp": (1, 3), "d_ramp": (1, 3), "norm_batch_size": 2},
    "bn": {},
}
# The layer that follows a MABNCallback-style policy (switched during the run) instead of its own timeline.
POLICY_LAYER = "layer1.0.bn1"


def _model(norm: str) -> nn.Module:
    # 16 channels into the strided 1x1 downsample conv at least: the inductor gives it channels-last inputs, and
    # oneDNN's 1x1 weight-gradient kernels write past their workspace there below a channel block (8 input
    # channels on AVX2, 16 on AVX-512; uxlfoundation/oneDNN#6035), which corrupts the heap of a one-thread process
    # (torch 2.13 and 2.14 on an AVX2 CPU: the worker aborts in the compiled backward).
    model = SmallResNet(3, widths=(16, 32), blocks=(1, 1))
    return convert_norm(model, norm, **LAYER_KWARGS[norm]).train()


def _train_step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    out.square().mean().backward()
    return out


def _images(seed: int) -> torch.Tensor:
    return torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.slow  # an inductor compile of each norm's step
@pytest.mark.parametrize("norm", ["mabn", "brn", "bn"])
def test_training_step_is_one_graph(norm):
    """Forward, loss and backward of a training step (centred convs included for mabn) trace without a graph
    break; eval forwards too."""
    model = _model(norm)
    _train_step(model, _images(0))  # the eager first step: the layers' state as a compiled run meets it
    torch._dynamo.reset()
    explained = torch._dynamo.explain(_train_step)(model, _images(1))
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
    assert explained.graph_count == 1
    model.eval()
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(_images(2))
    assert (explained.graph_break_count, explained.graph_count) == (0, 1)


def _graphs(model: nn.Module, x: torch.Tensor) -> tuple[fx.GraphModule, fx.GraphModule]:
    """The forward and backward ATen graphs of a compiled training step of ``model`` (run eagerly)."""
    graphs = []

    def keep(graph: fx.GraphModule, inputs: list[torch.Tensor]) -> Callable:
        graphs.append(graph)
        return boxed_nop(graph, inputs)

    def backend(graph: fx.GraphModule, inputs: list[torch.Tensor]) -> Callable:
        return aot_eager(graph, inputs, fw_compiler=keep, bw_compiler=keep)

    torch._dynamo.reset()
    _train_step(torch.compile(model, fullgraph=True, backend=backend), x)
    return tuple(graphs)


def _calls(graph: fx.GraphModule) -> list[str]:
    """The operators a graph calls, a functionalized in-place operator by its own name."""
    calls = [node for node in graph.graph.nodes if node.op == "call_function"]
    return [str(n.args[0] if "auto_functionalized" in str(n.target) else n.target) for n in calls]


@pytest.mark.slow  # inductor compiles both directions
def test_compiled_statistic_steps_are_one_operator_per_direction(monkeypatch, device):
    """Inside a compiled step each MABN2d calls its Triton statistic step as one operator per direction (on the
    CPU through Triton's interpreter, as on CUDA), where the torch-op steps are dozens of operations that the
    compiler traces and fuses; either step computes what the eager step does: gradients and every buffer."""
    x = _images(1).to(device)
    counts = {}
    for path, compiled_kernels in (("torch ops", None), ("operators", mabn_ops)):
        monkeypatch.setattr(mabn_module, "_compiled_kernels", lambda x, k=compiled_kernels: k)
        model = _model("mabn").to(device)
        _train_step(model, _images(0).to(device))  # an eager step first, as a fit's state meets the compiled one
        model.zero_grad()
        eager = copy.deepcopy(model)
        _train_step(eager, x)
        forward, backward = _graphs(model, x)
        layers = sum(isinstance(m, MABN2d) for m in model.modules())
        calls = _calls(forward) + _calls(backward)
        statistic_ops = {t: calls.count(t) for t in ("mabn.forward_stats.default", "mabn.backward_stats.default")}
        assert statistic_ops == dict.fromkeys(statistic_ops, layers if compiled_kernels else 0), statistic_ops
        counts[path] = round(len(calls) / layers)
        for (name, p_e), p_c in zip(eager.named_parameters(), model.parameters()):
            _close(p_c.grad, p_e.grad, f"{path}: {name}.grad")
        for (name, b_e), b_c in zip(eager.named_buffers(), model.buffers()):
            _close(b_c, b_e, f"{path}: {name}")
    print(f"ATen operations in the compiled forward and backward graphs per MABN2d layer: {counts}")
    assert counts["operators"] < counts["torch ops"] / 2, counts


def _close(compiled: torch.Tensor, eager: torch.Tensor, what: str) -> None:
    """Equal to float32 rounding: the compiler reorders and fuses float32 arithmetic (relative to the tensor's
    largest entry, since small gradient entries carry the large ones' rounding); integers exactly."""
    if not eager.is_floating_point():
        assert torch.equal(compiled, eager), what
        return
    err = (compiled.double() - eager.double()).abs().max().item()
    assert err <= 1e-5 * eager.double().abs().max().item() + 1e-7, f"{what}: max |compiled - eager| = {err:.3g}"


def _phases(layer: MABN2d) -> tuple[bool, bool]:
    """(moving statistics used, renormalized) in ``layer``'s last tracked step."""
    stats = layer.last_stats
    return bool(stats["active"].any()), bool((stats["r"] != 1).any())


@pytest.fixture
def compiled_operators(monkeypatch):
    """MABN2d's compiled steps call its Triton launches as custom operators (``mabn_ops``), on the CPU through
    Triton's interpreter, as they do on CUDA; its eager steps keep their own path."""
    monkeypatch.setattr(mabn_module, "_compiled_kernels", lambda x: mabn_ops)


@pytest.mark.slow  # the inductor compiles C++ kernels: ~25 s on one core without its cache
@pytest.mark.parametrize("norm", ["mabn", "mabn-operators", "brn"])
def test_compiled_training_steps_match_eager(norm, device, request):
    """Six SGD steps (momentum, weight decay) through warm-up, SMA and renormalization, compiled with
    ``fullgraph=True`` against eager: outputs, every gradient and every buffer, step by step; one policy-driven
    layer switches phase in place without a recompile; a non-finite batch leaves the buffers unchanged and is
    reported by ``raise_if_any_nonfinite``. ``mabn-operators``: the compiled steps call the Triton launches as
    operators, as on CUDA, where (MABN_TEST_DEVICE=cuda) the eager steps run the kernels too."""
    if norm == "mabn-operators":
        request.getfixturevalue("compiled_operators")
        norm = "mabn"
    eager = _model(norm).to(device)
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, fullgraph=True)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    optimizers = [
        torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4) for m in (eager, compiled_model)
    ]
    policy = {0: (False, False), 2: (True, False), 4: (True, True)}
    tracked = eager.get_submodule("layer2.0.bn1")
    tracked.track_stats = True
    phases = set()
    for step in range(6):
        if step in policy:
            for model in (eager, compiled_model):
                model.get_submodule(POLICY_LAYER).policy = policy[step]
        x = _images(step).to(device)
        out_e, out_c = _train_step(eager, x), _train_step(compiled, x)
        _close(out_c, out_e, f"step {step} output")
        for (name, p_e), p_c in zip(eager.named_parameters(), compiled_model.parameters()):
            _close(p_c.grad, p_e.grad, f"step {step} {name}.grad")
        for (name, b_e), b_c in zip(eager.named_buffers(), compiled_model.buffers()):
            _close(b_c, b_e, f"step {step} {name}")
        if isinstance(tracked, MABN2d):
            phases.add(_phases(tracked))
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
    if norm == "mabn":
        assert phases == {(False, False), (True, False), (True, True)}
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1

    before = {name: b.clone() for name, b in compiled_model.named_buffers()}
    _train_step(compiled, torch.full((4, 3, 8, 8), float("nan"), device=device))
    for name, b in compiled_model.named_buffers():
        assert torch.equal(b, before[name]), name
    layers = [m for m in compiled_model.modules() if isinstance(m, ManagedNorm)]
    with pytest.raises(FloatingPointError, match="non-finite"):
        raise_if_any_nonfinite(layers)


class _Task(NormTask):
    """The smallest NormTask: the tiny ResNet with MABN, phases and statistics logging by MABNCallback."""

    RULE = {"prefixes": ["model.layer"], "moving_stats_first_step": 1, "renorm_first_step": 3}

    def __init__(
        self,
        compile: bool | str = False,
        cuda_graph: bool = False,
        norm_policy: dict | None = {"groups": {"blocks": RULE}, "log_every_n_steps": 2},  # noqa: B006 (read only)
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = _model("mabn")

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.training_forward(batch[0]).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _fit(task: _Task, tmp_path) -> pl.Trainer:
    trainer = pl.Trainer(max_steps=4, accelerator="cpu", **{**BARE, "logger": CSVLogger(tmp_path)})
    trainer.fit(task, DataLoader(TensorDataset(torch.randn(16, 3, 8, 8)), batch_size=4))
    return trainer


@pytest.mark.slow  # an inductor compile of a fit
def test_compile_option_trains_through_one_graph(monkeypatch, tmp_path):
    """``compile: true`` sends the training forward and backward through ``torch.compile(fullgraph=True)`` in the
    default mode: one graph for the whole fit while MABNCallback switches phases and logs statistics, and the first
    step's time is logged. (Compiled by Dynamo alone here: the inductor's numbers are the test above's.)"""
    calls = []
    real = torch.compile

    def dynamo_only(model: nn.Module, **options: object) -> nn.Module:
        calls.append(options)
        return real(model, backend="eager", fullgraph=options["fullgraph"])

    monkeypatch.setattr(torch, "compile", dynamo_only)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    task = _Task(compile=True)
    trainer = _fit(task, tmp_path)
    assert calls == [{"fullgraph": True, "mode": "default"}]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert trainer.global_step == 4 and int(task.model.get_submodule("layer1.0.bn1").iters) == 4
    assert trainer.logged_metrics["compile_first_step_s"] > 0


def test_compile_and_cuda_graph_are_exclusive(tmp_path):
    with pytest.raises(ValueError, match="set one"):
        _fit(_Task(compile="reduce-overhead", cuda_graph=True), tmp_path)
