"""CUDA-graph capture of a model's training forward and backward.

At the small per-device batches MABN is made for, a GPU training step is bound by the host issuing kernels
rather than by the GPU running them, and MABN2d issues more of them than BN's one cuDNN call per direction.
Captured once, the whole forward and the whole backward each replay as one graph launch. The loss, DDP's
gradient all-reduce and the optimizer step stay eager.

Replays run exactly the captured kernels on the captured addresses, so the model must not read the device
from the host during its forward or backward, and its training inputs must keep one shape:

- other shapes, eval mode and no-grad forwards run the model eagerly, as before capture;
- layers that read the device from the host or communicate across devices are refused (``capture_blockers``);
- the capture's warm-up iterations leave every buffer as it was (MABN's streams, BN's running statistics),
  and the random state too;
- MABN2d and BatchRenorm2d follow MABNCallback's policy through a device tensor the callback updates in
  place, and MABNCallback reads their non-finite flags one optimizer step late, from a copy in pinned
  host memory; the logged layers' statistics are the captured tensors, which every replay refreshes;
- torch warms the callables up by backpropagating uninitialised gradients (``torch.empty_like``): the managed
  norms' non-finite flags, which such garbage may set, are cleared with the buffers after capture.

The gradients a graphed backward hands to autograd are detached views of the graphs' static buffers: a parameter
whose ``.grad`` is None adopts the buffer itself, and the next replay overwrites it (the forward graph's
temporaries may share its memory in the graphs' pool, and the backward graph writes it). A gradient still held
when the next replay starts (gradient accumulation, ``zero_grad(set_to_none=False)``) is therefore moved out of
the buffer first (``_GraphGradients``), so that accumulation sums the micro-batches exactly; NormTask drops the
held buffers after each optimizer step, which has used them, so the usual step copies nothing.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from ..distributed import has_process_group, sync_group
from ..norm import BatchRenorm2d, MABN2d
from ..norm.managed import managed_norms

# Whether make_graphed_callables takes capture_error_mode (a GPU machine may bring another torch than the pinned one).
_HAS_CAPTURE_MODE = "capture_error_mode" in inspect.signature(torch.cuda.make_graphed_callables).parameters


def _blocking_layers(model: nn.Module) -> list[tuple[str, str]]:
    """(name, why) of each layer of ``model`` that cannot run inside a CUDA graph."""
    blockers = []
    for name, m in model.named_modules():
        why = None
        if isinstance(m, nn.SyncBatchNorm) and sync_group():
            why = "SyncBatchNorm communicates across devices inside the forward"
        elif isinstance(m, (MABN2d, BatchRenorm2d)) and m.sync_stats and sync_group():
            why = f"{type(m).__name__}(sync_stats=True) communicates across devices inside the forward"
        elif isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training and m.momentum is None:
            why = "BatchNorm with momentum=None reads its batch count on the host"
        if why:
            blockers.append((name or type(m).__name__, why))
    return blockers


def capture_blockers(model: nn.Module) -> list[str]:
    """The layers of ``model`` that cannot run inside a CUDA graph, each as "name (why)"."""
    return [f"{name} ({why})" for name, why in _blocking_layers(model)]


def why_not_capturable(model: nn.Module, device: torch.device) -> str | None:
    """Why ``model`` on ``device`` cannot be trained through CUDA graphs, in a few words; None when it can.

    One short reason, for a log line: a ResNet with SyncBatchNorm has a hundred blocking layers, each the same
    story, so the first is named and the others counted (``check_capturable`` lists them all).
    """
    if device.type != "cuda":
        return f"the model is on {device.type}; CUDA graphs need a GPU"
    blockers = _blocking_layers(model)
    if not blockers:
        return None
    name, why = blockers[0]
    others = len(blockers) - 1
    return f"layer {name}: {why}" + (f"; and {others} more layer{'s' * (others > 1)}" if others else "")


def check_capturable(model: nn.Module, device: torch.device) -> None:
    """Raise ValueError, naming the cause, when ``model`` on ``device`` cannot be trained through CUDA graphs."""
    if device.type != "cuda":
        raise ValueError(f"CUDA-graph capture (cuda_graph: true) needs the model on a GPU, got device {device}")
    blockers = capture_blockers(model)
    if blockers:
        raise ValueError(
            "CUDA-graph capture (cuda_graph: true) is not possible with these layers: " + "; ".join(blockers)
        )


@contextlib.contextmanager
def _without_autocast_cache() -> Iterator[None]:
    """Autocast as it is, but without its weight-cast cache, which a capture must not use."""
    if not torch.is_autocast_enabled("cuda"):
        yield
        return
    with torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"), cache_enabled=False):
        yield


def graph_training_forward(model: nn.Module, sample: Tensor, warmup_iters: int = 3) -> None:
    """Capture ``model``'s training forward and backward for inputs like ``sample`` (shape, dtype, device).

    Afterwards ``model(x)`` replays the graphs for such inputs in training mode with gradients on, and runs
    the model eagerly otherwise. Call it with the model on its GPU, in training mode, with every buffer
    and parameter in place (the graphs hold their addresses): DDP may wrap it afterwards.
    """
    check_capturable(model, sample.device)
    if not model.training:
        raise ValueError("CUDA-graph capture of the training step needs the model in training mode")
    eager = model.forward
    # The warm-up iterations run the training forward and backward for real: keep what they change (the
    # buffers, and the random state that dropout draws from, so that the graphs continue the eager stream).
    buffers = {name: buf.clone() for name, buf in model.named_buffers()}
    rng_devices = [sample.device] if sample.is_cuda else []
    # Under DDP the communication threads keep working while this thread captures; torch before 2.12 has no such
    # option, and captures in its global mode.
    options = {"capture_error_mode": "thread_local"} if has_process_group() and _HAS_CAPTURE_MODE else {}
    # The graphs' input is a tensor of their own: each replay copies the batch into it. Parameters the
    # training forward does not use get no gradient, as in eager training.
    with _without_autocast_cache(), torch.random.fork_rng(rng_devices, device_type="cuda"):
        torch.cuda.make_graphed_callables(
            model, (sample.clone(),), num_warmup_iters=warmup_iters, allow_unused_input=True, **options
        )
    graphed = model.forward
    with torch.no_grad():
        for name, buf in model.named_buffers():
            buf.copy_(buffers[name])
        for layer in managed_norms(model).values():
            layer.nonfinite_flags(sample.device).zero_()
    shape, dtype, device = sample.shape, sample.dtype, sample.device
    gradients = _GraphGradients(tuple(model.parameters()))

    def forward(x: Tensor) -> object:
        if model.training and torch.is_grad_enabled() and x.shape == shape and x.dtype == dtype and x.device == device:
            gradients.release()
            return gradients.watch(graphed(x))
        return eager(x)

    forward.graphed_input = (shape, dtype, device)  # marks the model as captured (``is_graphed``)
    forward.gradients = gradients
    model.forward = forward


class _GraphGradients:
    """The parameters' gradients that a graphed backward returns: views of its static buffers, which the next
    replay overwrites. Their addresses are learnt from the first replay's backward (torch does not expose them);
    they never change afterwards."""

    def __init__(self, params: tuple[nn.Parameter, ...]) -> None:
        self.params = params
        self.static: list[int | None] | None = None  # per parameter: the data_ptr of its static gradient buffer

    def watch(self, out: object) -> object:
        """``out``, the replayed forward's output; until the static buffers are known, a hook on its backward
        node records the gradients that node returns."""
        if self.static is None:
            node = next(t.grad_fn for t in torch.utils._pytree.tree_leaves(out) if t.grad_fn is not None)
            handle = None

            def learn(grad_inputs: tuple[Tensor | None, ...], grad_outputs: tuple[Tensor | None, ...]) -> None:
                # The node's inputs are the graph's input followed by the model's parameters.
                grads = grad_inputs[len(grad_inputs) - len(self.params) :]
                self.static = [None if g is None else g.data_ptr() for g in grads]
                handle.remove()

            handle = node.register_hook(learn)
        return out

    def _held(self) -> list[tuple[nn.Parameter, Tensor]]:
        if self.static is None:
            return []
        return [
            (p, p.grad)
            for p, ptr in zip(self.params, self.static)
            if ptr is not None and p.grad is not None and p.grad.data_ptr() == ptr
        ]

    def release(self) -> None:
        """Before a replay: every gradient still held in a static buffer moves into memory of its own."""
        for p, grad in self._held():
            p.grad = grad.clone()

    def drop(self) -> None:
        """After an optimizer step has used them: the gradients held in static buffers are let go (set to None,
        as ``zero_grad()`` does), so that the next replay has nothing to move out."""
        for p, _ in self._held():
            p.grad = None


def drop_graph_gradients(model: nn.Module) -> None:
    """After an optimizer step of a graphed ``model``: its gradients held in the graphs' static buffers are set to
    None (see ``_GraphGradients``); nothing for a model that is not graphed."""
    gradients = getattr(model.forward, "gradients", None)
    if gradients is not None:
        gradients.drop()


def is_graphed(model: nn.Module) -> bool:
    """Whether ``graph_training_forward`` has captured ``model``."""
    return hasattr(model.forward, "graphed_input")


def training_call(model: nn.Module, x: Tensor, cuda_graph: bool) -> object:
    """``model(x)`` in a training step; with ``cuda_graph`` the first call captures the model's graphs for
    inputs like ``x``, and later calls replay them."""
    if cuda_graph and not is_graphed(model):
        graph_training_forward(model, x)
    return model(x)
