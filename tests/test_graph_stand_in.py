"""The CPU stand-in for ``torch.cuda.make_graphed_callables`` (``helpers.graphs.GraphStandIn``) fails what a GPU's
graphs would get wrong: each case is a usage that runs eagerly on the CPU, and that the stand-in must refuse or
corrupt as torch's capture and replays do."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mabn import MABN2d


def mlp() -> nn.Sequential:
    """A float64 net whose first operator keeps its output for the backward, not its input (the static input)."""
    return nn.Sequential(nn.Tanh(), nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).double()


def test_replays_share_one_set_of_saved_activations(graph_stand_in):
    """A forward before an earlier forward's backward: that backward reads the later forward's activations, as the
    one captured backward graph reads what the last forward replay wrote."""
    net = mlp()
    gen = torch.Generator().manual_seed(0)
    x1, x2, x0 = (torch.randn(2, 5, generator=gen, dtype=torch.float64) for _ in range(3))
    grad = torch.randn(2, 3, generator=gen, dtype=torch.float64)
    expected = torch.autograd.grad(net(x2), list(net.parameters()), grad)  # eagerly, before the capture
    graph_stand_in(net, (x0,), num_warmup_iters=1, allow_unused_input=True, capture_error_mode="thread_local")
    out = net(x1)
    net(x2)
    out.backward(grad)
    for p, g in zip(net.parameters(), expected):
        assert torch.equal(p.grad, g)


class ReadsTheHost(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(5, 3)

    def forward(self, x):
        out = self.linear(x)
        return out * 2 if out.mean() > 0 else out  # bool() of a tensor: waits for the device


def test_capture_refuses_a_host_read(graph_stand_in):
    with pytest.raises(RuntimeError, match=r"_local_scalar_dense.* reads the device from the host during a CUDA-graph"):
        graph_stand_in(
            ReadsTheHost(),
            (torch.randn(2, 5),),
            num_warmup_iters=1,
            allow_unused_input=True,
            capture_error_mode="thread_local",
        )


def _hook(net: nn.Module) -> None:
    net.register_forward_hook(lambda module, args, out: None)


def _buffer_with_grad(net: nn.Module) -> None:
    net.register_buffer("scale", torch.ones(3, requires_grad=True))


@pytest.mark.parametrize(
    "wrong, error",
    [
        (_hook, "Modules must not have hooks registered"),
        (_buffer_with_grad, "All buffers must have ``requires_grad=False``"),
        (None, "does not support the autocast caching"),
    ],
    ids=["module hook", "buffer with grad", "autocast cache"],
)
def test_capture_refuses_what_torch_refuses(graph_stand_in, wrong, error):
    net = mlp().float()
    if wrong is not None:
        wrong(net)
    with pytest.raises((AssertionError, RuntimeError), match=error):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=wrong is None):
            graph_stand_in(
                net,
                (torch.randn(2, 5),),
                num_warmup_iters=1,
                allow_unused_input=True,
                capture_error_mode="thread_local",
            )


def _scaled_layer() -> nn.Sequential:
    net = nn.Sequential(nn.Conv2d(3, 4, 1), MABN2d(4, norm_batch_size=2, buffer_size=2, warmup_iters=1))
    net[1].loss_scale = torch.full((), 4.0)
    return net


def test_replay_refuses_a_tensor_swapped_after_the_capture(graph_stand_in):
    """A new loss-scale tensor after the capture: a GPU's backward graph reads the captured one still."""
    net = _scaled_layer()
    x = torch.randn(4, 3, 2, 2)
    graph_stand_in(net, (x,), num_warmup_iters=1, allow_unused_input=True, capture_error_mode="thread_local")
    net[1].loss_scale.fill_(8.0)  # in place: what the graph reads
    net(x).sum().backward()
    net[1].loss_scale = torch.full((), 8.0)
    out = net(x)
    with pytest.raises(RuntimeError, match=r"backward read other tensors than the capture \(new: \(\) torch.float32"):
        out.sum().backward()


def test_replay_refuses_another_path_through_the_python_code(graph_stand_in):
    """Statistics tracking turned on after the capture: on a GPU the replays run the captured kernels, and the
    layer's Python forward, which would record them, never runs again."""
    net = _scaled_layer()
    x = torch.randn(4, 3, 2, 2)
    graph_stand_in(net, (x,), num_warmup_iters=1, allow_unused_input=True, capture_error_mode="thread_local")
    net[1].track_stats = True
    with pytest.raises(RuntimeError, match=r"the replay's forward ran aten\.\S+ where the capture ran aten\."):
        net(x)


@pytest.mark.parametrize(
    "graph_stand_in", [True, False], indirect=True, ids=["make_graphed_callables takes the mode", "torch 2.11"]
)
def test_capture_refuses_the_global_mode(graph_stand_in):
    """A capture in torch's default global mode fails on a GPU when another thread (the loader's pin-memory thread)
    makes a CUDA call during it: refused, for a make_graphed_callables that takes the mode and for one that captures
    through ``torch.cuda.graph``'s default (torch 2.11)."""
    with pytest.raises(RuntimeError, match="CUDA-graph capture in global mode"):
        graph_stand_in(mlp(), (torch.randn(2, 5, dtype=torch.float64),), num_warmup_iters=1, allow_unused_input=True)
    if not graph_stand_in.takes_mode:
        with pytest.raises(TypeError, match="unexpected keyword argument 'capture_error_mode'"):
            graph_stand_in(mlp(), (torch.randn(2, 5, dtype=torch.float64),), capture_error_mode="thread_local")
    assert graph_stand_in.modes == []


def test_segments_of_one_capture_share_their_gradient_buffers_pool(graph_stand_in):
    """Two segments captured by one call: a gradient held in the second segment's static buffer is corrupted by the
    first segment's next forward replay, as a GPU's graphs in one pool may write it; moved out first, it is kept."""
    first, second = mlp(), nn.Sequential(nn.Tanh(), nn.Linear(3, 2)).double()
    x = torch.randn(2, 5, dtype=torch.float64)
    samples = ((x,), (first(x).detach().requires_grad_(),))
    graph_stand_in(
        (first, second), samples, num_warmup_iters=1, allow_unused_input=True, capture_error_mode="thread_local"
    )
    for move_out in (False, True):
        second(first(x)).sum().backward()
        held = second[1].weight.grad
        kept = held.clone()
        if move_out:
            second[1].weight.grad = held = held.clone()
        first(x)  # the next step's first replay, before the second segment's
        assert torch.equal(held, kept) == move_out
        first.zero_grad(set_to_none=True)
        second.zero_grad(set_to_none=True)
