"""The training step captured in segments (``graph_segments: stages``): one graph pair per ResNet stage and one for
the heads, whose backward nodes let DDP's gradient hooks fire segment by segment. On the CPU through the
stand-in of ``torch.cuda.make_graphed_callables`` (``GraphStandIn``), which takes one module (``whole``) or a tuple
of them."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torchvision.models.resnet import BasicBlock, ResNet

from mabn.errors import ConfigError
from mabn.models.decoders import build_segmentation_model
from mabn.models.pspnet import PSPNet
from mabn.norm import convert_norm
from mabn.tasks.base import NormTask
from mabn.tasks.cudagraph import (
    SecondForwardError,
    capture_mode,
    drop_graph_gradients,
    graph_training_forward,
    release_graphs,
)
from mabn.tasks.segmentation import SegmentationTask


def tiny_resnet() -> nn.Module:
    """Stage 1's network, one block per stage (float64)."""
    return ResNet(BasicBlock, [1, 1, 1, 1], num_classes=5).double()


def tiny_mabn_resnet() -> nn.Module:
    """The same with stage 1's norm, MABN (ghost batches of 2, a short buffer)."""
    return convert_norm(
        ResNet(BasicBlock, [1, 1, 1, 1], num_classes=5), "mabn", norm_batch_size=2, buffer_size=3
    ).double()


def tiny_pspnet() -> nn.Module:
    """Stage 2's network on ResNet-18 cut to one block per stage, two pyramid bins and no dropout (float64)."""
    net = PSPNet(num_classes=3, norm="bn", arch="resnet18", bins=(1, 2), dropout=0.0).double()
    for name in ("layer1", "layer2", "layer3", "layer4"):
        setattr(net.encoder, name, getattr(net.encoder, name)[:1])
    return net


def _outputs(out) -> tuple[torch.Tensor, ...]:
    """A training forward's outputs: PSPNet's (main, auxiliary) logits, or the one tensor."""
    return out if isinstance(out, tuple) else (out,)


@pytest.mark.parametrize(
    "graph_stand_in", [True, False], indirect=True, ids=["make_graphed_callables takes the mode", "torch 2.11"]
)
@pytest.mark.parametrize("segments", ["whole", "stages"])
def test_every_capture_is_thread_local_on_a_single_device(graph_stand_in, segments):
    """Without a process group too, the loader's pin-memory thread works during the capture: the capture is made in
    thread-local mode, given to a make_graphed_callables that takes it, or through ``torch.cuda.graph``'s own mode
    where it does not (torch 2.11); that class is torch's own again afterwards."""
    graph = torch.cuda.graph
    model = tiny_resnet().train()
    graph_training_forward(model, torch.randn(2, 3, 32, 32, dtype=torch.float64), warmup_iters=1, segments=segments)
    assert graph_stand_in.modes == ["thread_local"]
    assert torch.cuda.graph is graph
    via = "make_graphed_callables" if graph_stand_in.takes_mode else "torch.cuda.graph"
    assert capture_mode() == f"thread-local (capture_error_mode of {via})"  # as the GPU check's report says


def test_release_graphs_drops_the_gradients_held_in_the_static_buffers(graph_stand_in):
    """A re-fit releases the graphs before it captures its own: gradients still held in the old graphs' buffers
    (a backward without an optimizer step) are let go with them, not kept alive through the new capture."""
    model = tiny_resnet().train()
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    graph_training_forward(model, x, warmup_iters=1, segments="stages")
    model(x).sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    release_graphs(model)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize(
    "build, size",
    [pytest.param(b, s, marks=pytest.mark.slow) for b, s in ((tiny_resnet, 32), (tiny_mabn_resnet, 32))]
    + [(tiny_pspnet, 16)],
)
def test_segmented_step_equals_whole_capture_and_eager(graph_stand_in, build, size):
    """Two accumulated micro-batches: the loss, every parameter's gradient and every buffer are eager training's,
    captured whole or in stages (the second replay moves the first's gradients out of the static buffers)."""
    gen = torch.Generator().manual_seed(1)
    images = [torch.randn(2, 3, size, size, generator=gen, dtype=torch.float64) for _ in range(3)]
    eager = build().train()
    whole, stages = copy.deepcopy(eager), copy.deepcopy(eager)
    graph_training_forward(whole, images[2], warmup_iters=1)
    graph_training_forward(stages, images[2], warmup_iters=1, segments="stages")
    assert len(stages.forward.segments) == 5
    weights = None  # per output, a weight for every element: a gradient that differs everywhere
    losses = {}
    for model in (eager, whole, stages):
        losses[model] = []
        for x in images[:2]:
            outs = _outputs(model(x))
            weights = weights or [torch.randn(o.shape, generator=gen, dtype=torch.float64) for o in outs]
            loss = sum((o * w).sum() for o, w in zip(outs, weights))
            loss.backward()
            losses[model].append(loss.detach())
    for model in (whole, stages):
        torch.testing.assert_close(losses[model], losses[eager], rtol=1e-12, atol=0)
        for (name, p), q in zip(model.named_parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=name)
        for (name, b), c in zip(model.named_buffers(), eager.buffers()):
            torch.testing.assert_close(b, c, rtol=1e-12, atol=0, msg=name)


def test_drop_lets_go_of_every_segments_gradients(graph_stand_in):
    model = tiny_resnet().train()
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    graph_training_forward(model, x, warmup_iters=1, segments="stages")
    model(x).sum().backward()
    drop_graph_gradients(model)
    assert all(p.grad is None for p in model.parameters())


def test_second_forward_before_the_backward_is_refused(graph_stand_in):
    model = tiny_resnet().train()
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    graph_training_forward(model, x, warmup_iters=1, segments="stages")
    out = model(x)
    with pytest.raises(SecondForwardError, match="second CUDA-graphed training forward"):
        model(x)
    out.sum().backward()
    model(x).sum().backward()  # after the backward: allowed
    with torch.no_grad():
        model(x)  # no backward to come: eager, allowed


def test_release_graphs_runs_the_model_eagerly_again(graph_stand_in):
    model = tiny_resnet().train()
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    graph_training_forward(model, x, warmup_iters=1, segments="stages")
    release_graphs(model)
    assert not hasattr(model.forward, "segments")
    out = model(x)
    model(x)  # eager: a second forward before the backward is fine
    out.sum().backward()


@pytest.mark.parametrize(
    "model, name",
    [
        (lambda: build_segmentation_model("unet", 3, "bn", arch="resnet18"), r"DecoderNet \(decoder unet, encoder "),
        (lambda: PSPNet(num_classes=3, norm="bn", arch="efficientnet-b0"), r"PSPNet \(encoder EfficientNetEncoder\)"),
    ],
)
def test_stages_of_a_model_without_a_split_are_refused(graph_stand_in, model, name):
    with pytest.raises(ConfigError, match=rf"graph_segments=stages: the model {name}.*set graph_segments: whole$"):
        graph_training_forward(model().train(), torch.randn(2, 3, 32, 32), warmup_iters=1, segments="stages")


@pytest.mark.parametrize("segments", ["whole", "stages"])
def test_heads_gradient_hooks_fire_before_layer1s_backward_only_in_stages(graph_stand_in, segments):
    """DDP all-reduces a bucket once the hooks of its parameters' gradient accumulators fired: captured in stages,
    those of the heads (fc) fire before layer1's backward has run; captured whole, all fire after the whole
    backward, layer1's included."""
    model = tiny_resnet().train()
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    graph_training_forward(model, x, warmup_iters=1, segments=segments)
    events: list[str] = []
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: events.append(name))

    def mark_layer1s_backward(module: nn.Module, args: tuple[torch.Tensor]) -> None:
        # layer1's input's gradient is computed once layer1's backward has run (the stand-ins run the Python forward).
        args[0].register_hook(lambda grad: events.append("layer1"))

    model.layer1.register_forward_pre_hook(mark_layer1s_backward)
    model(x).sum().backward()
    heads = [events.index(name) for name in ("fc.weight", "fc.bias")]
    if segments == "stages":
        assert max(heads) < events.index("layer1") < events.index("layer1.0.conv1.weight")
    else:
        assert min(heads) > events.index("layer1")


@pytest.mark.parametrize("value", ["blocks", "Stages", True, None])
def test_graph_segments_refuses_anything_but_whole_or_stages(value):
    for ok in ("whole", "stages"):
        NormTask.check_hparams({"norm": "bn", "graph_segments": ok})
    with pytest.raises(ConfigError) as err:
        NormTask.check_hparams({"norm": "bn", "graph_segments": value})
    assert str(err.value) == f"graph_segments={value!r}: choose whole or stages"


def test_fit_of_stages_on_a_model_without_a_split_stops_at_its_start():
    """On any device, whether or not the fit captures: the setting is wrong for the model, not for the machine."""
    task = SegmentationTask(num_classes=3, decoder="unet", norm="bn", arch="resnet18", graph_segments="stages")
    with pytest.raises(ConfigError, match=r"^graph_segments=stages: the model DecoderNet \(decoder unet"):
        task.on_fit_start()
    SegmentationTask(num_classes=3, norm="bn", arch="resnet18", graph_segments="stages").on_fit_start()
