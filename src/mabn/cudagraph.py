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
  place, and their non-finite checks are the callback's, before each optimizer step; the logged layers'
  statistics are the captured tensors, which every replay refreshes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from .norm import BatchRenorm2d, MABN2d
from .process import has_process_group, sync_group


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
    # Under DDP the communication threads keep working while this thread captures.
    options = {"capture_error_mode": "thread_local"} if has_process_group() else {}
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
    shape, dtype, device = sample.shape, sample.dtype, sample.device

    def forward(x: Tensor) -> object:
        if model.training and torch.is_grad_enabled() and x.shape == shape and x.dtype == dtype and x.device == device:
            return graphed(x)
        return eager(x)

    forward.graphed_input = (shape, dtype, device)  # marks the model as captured (``is_graphed``)
    model.forward = forward


def is_graphed(model: nn.Module) -> bool:
    """Whether ``graph_training_forward`` has captured ``model``."""
    return hasattr(model.forward, "graphed_input")


def training_call(model: nn.Module, x: Tensor, cuda_graph: bool) -> object:
    """``model(x)`` in a training step; with ``cuda_graph`` the first call captures the model's graphs for
    inputs like ``x``, and later calls replay them."""
    if cuda_graph and not is_graphed(model):
        graph_training_forward(model, x)
    return model(x)
