"""CUDA-graph capture of a model's training forward and backward.

At the small per-device batches MABN is made for, a GPU training step is bound by the host issuing kernels
rather than by the GPU running them, and MABN2d issues more of them than BN's one cuDNN call per direction.
Captured once, the whole forward and the whole backward each replay as one graph launch, or as one launch per
segment (``graph_segments: stages``: each ResNet stage and the heads), whose backward nodes let DDP all-reduce a
segment's gradients while the earlier segments' backward replays. The loss, DDP's gradient all-reduce and the
optimizer step stay eager.

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
  norms' non-finite flags, which such garbage may set, are cleared with the buffers after capture;
- the graphs hold one set of saved activations, which every forward replay overwrites: a second graphed forward
  while an earlier one's backward is still to come (two crops, an extra forward with gradients on) would hand
  that backward the second forward's activations, so it is refused (``SecondForwardError``);
- the graphs read every tensor they use at the address it had at capture, whatever the Python attributes name
  later: a fit hands the layers tensors of its own (MABNCallback's loss scale, or none), so a NormTask captures at
  each fit (``release_graphs``);
- the capture runs inside the first training batch, while the loader's pin-memory thread pins the next batches
  and, under DDP, the communication threads work: every capture is made in thread-local mode, where their CUDA
  calls run, not in torch's default global mode, where one of them fails the capture
  (``mabn.compat.make_graphed_callables_thread_local``, on every supported torch).

The gradients a graphed backward hands to autograd are detached views of the graphs' static buffers: a parameter
whose ``.grad`` is None adopts the buffer itself, and the next replay overwrites it (the forward graph's
temporaries may share its memory in the graphs' pool, and the backward graph writes it). A gradient still held
when the next replay starts (gradient accumulation, ``zero_grad(set_to_none=False)``) is therefore moved out of
the buffer first (``_GraphGradients``), so that accumulation sums the micro-batches exactly; NormTask drops the
held buffers after each optimizer step, which has used them, so the usual step copies nothing. Segments captured
together share one memory pool, so one segment's forward replay may write another's static gradient buffers: every
segment's held gradients move out before the first replay of a step, not each before its own.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import weakref
from collections.abc import Callable, Iterator

import torch
from torch import Tensor, nn

from ..compat import graphed_callables_take_capture_mode, make_graphed_callables_thread_local, tree_leaves
from ..distributed import sync_group
from ..errors import ConfigError
from ..norm import BatchRenorm2d, MABN2d
from ..norm.managed import managed_norms

_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)  # the lazy ones subclass these


def _blocking_layers(model: nn.Module) -> list[tuple[str, str]]:
    """(name, why) of each layer of ``model`` that cannot run inside a CUDA graph."""
    blockers = []
    for name, m in model.named_modules():
        why = None
        if isinstance(m, nn.SyncBatchNorm) and sync_group():
            why = "SyncBatchNorm communicates across devices inside the forward"
        elif isinstance(m, (MABN2d, BatchRenorm2d)) and m.sync_stats and sync_group():
            why = f"{type(m).__name__}(sync_stats=True) communicates across devices inside the forward"
        elif isinstance(m, _BATCH_NORMS) and m.training and m.momentum is None:
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


class SecondForwardError(ConfigError):
    """A graphed training forward while an earlier one's backward is still to come: the graphs hold one set of saved
    activations, so that backward would read this forward's."""


@contextlib.contextmanager
def _without_autocast_cache(device_type: str) -> Iterator[None]:
    """Autocast on ``device_type`` as it is, but without its weight-cast cache, which a capture must not use."""
    if not torch.is_autocast_enabled(device_type):
        yield
        return
    with torch.autocast(device_type, dtype=torch.get_autocast_dtype(device_type), cache_enabled=False):
        yield


GRAPH_SEGMENTS = ("whole", "stages")


def _resnet(model: nn.Module) -> nn.Module | None:
    """The ResNet whose stages split ``model``: stage 1's torchvision ResNet itself, or a PSPNet's ResNet encoder
    (smp's ResNet encoders are torchvision ResNets); None for any other model."""
    # Here, not at the top: the models import smp, and the GPU check's kernel tests import this module where only
    # torch, Triton and pytest are installed; only a segmented capture needs them.
    from torchvision.models import ResNet

    from ..models.pspnet import PSPNet

    if isinstance(model, PSPNet):
        return model.encoder if isinstance(model.encoder, ResNet) else None
    return model if isinstance(model, ResNet) else None


def check_segments(model: nn.Module, segments: str) -> None:
    """A ``ConfigError`` unless ``model``'s training forward can be captured as ``segments`` (``GRAPH_SEGMENTS``)."""
    if segments not in GRAPH_SEGMENTS:
        raise ConfigError(f"graph_segments={segments!r}: choose {' or '.join(GRAPH_SEGMENTS)}")
    if segments == "stages" and _resnet(model) is None:
        decoder, encoder = getattr(model, "decoder_name", None), getattr(model, "encoder", None)
        details = [f"decoder {decoder}"] * bool(decoder) + [f"encoder {type(encoder).__name__}"] * (encoder is not None)
        name = type(model).__name__ + (f" ({', '.join(details)})" if details else "")
        raise ConfigError(
            f"graph_segments=stages: the model {name} has no split into stages (stage 1's ResNet and PSPNet on a "
            "ResNet encoder have); set graph_segments: whole"
        )


def _split(model: nn.Module, size: torch.Size) -> tuple[tuple[nn.Module, ...], tuple[tuple[int, ...], ...]]:
    """``model``'s training forward for images of spatial ``size`` as segments, each a module of its own over the
    model's layers (their parameters are the segment's), and what each is called on: 0 names the image, k the
    output of segment k. The ResNet's stem with layer1, then each later stage, then the heads."""
    net = _resnet(model)
    stages = (
        nn.Sequential(net.conv1, net.bn1, net.relu, net.maxpool, net.layer1),
        *(nn.Sequential(layer) for layer in (net.layer2, net.layer3, net.layer4)),
    )  # new containers: capture replaces the forward of the modules it is given, which the eager path still calls
    if net is not model:  # a PSPNet on its ResNet encoder (``_resnet``)
        heads = _Heads(functools.partial(model.decode, size=size[-2:]), model.ppm, model.classifier, model.aux)
        return (*stages, heads), ((0,), (1,), (2,), (3,), (4, 3))  # the auxiliary head reads layer3's output
    return (*stages, nn.Sequential(net.avgpool, nn.Flatten(1), net.fc)), ((0,), (1,), (2,), (3,), (4,))


class _Heads(nn.Module):
    """``decode`` as a module over the layers whose parameters it uses."""

    def __init__(self, decode: Callable[..., object], *layers: nn.Module) -> None:
        super().__init__()
        self.decode = decode
        self.layers = nn.ModuleList(layers)

    def forward(self, *features: Tensor) -> object:
        return self.decode(*features)


def graph_training_forward(model: nn.Module, sample: Tensor, warmup_iters: int = 3, segments: str = "whole") -> None:
    """Capture ``model``'s training forward and backward for inputs like ``sample`` (shape, dtype, device).

    Afterwards ``model(x)`` replays the graphs for such inputs in training mode with gradients on, and runs
    the model eagerly otherwise. Call it with the model on its GPU, in training mode, with every buffer
    and parameter in place (the graphs hold their addresses): DDP may wrap it afterwards.

    ``segments`` ``whole`` captures the model as one graph per direction; ``stages`` as one per ResNet stage and
    one for the heads (``_split``), captured together by one ``make_graphed_callables`` call: each segment's
    backward is an autograd node of its own, so the gradient hooks of its parameters (DDP's) fire when it ends,
    while the earlier segments' backward is still to run.
    """
    check_capturable(model, sample.device)
    check_segments(model, segments)
    if not model.training:
        raise ValueError("CUDA-graph capture of the training step needs the model in training mode")
    eager = model.forward
    own_forward = model.__dict__.get("forward")  # an instance's own forward, put back by release_graphs
    # The warm-up iterations run the training forward and backward for real: keep what they change (the
    # buffers, and the random state that dropout draws from, so that the graphs continue the eager stream).
    buffers = {name: buf.clone() for name, buf in model.named_buffers()}
    rng_devices = [sample.device] if sample.is_cuda else []
    # Other threads keep working while this one captures: the loader's pin-memory thread, DDP's communication
    # threads. In thread-local mode their CUDA calls run; in torch's default global mode one fails the capture.
    # The graphs' input is a tensor of their own: each replay copies the batch into it. Parameters the
    # training forward does not use get no gradient, as in eager training.
    with _without_autocast_cache(sample.device.type), torch.random.fork_rng(rng_devices, device_type="cuda"):
        if segments == "whole":
            parts, inputs = (model,), ((0,),)
            make_graphed_callables_thread_local(
                model, (sample.clone(),), num_warmup_iters=warmup_iters, allow_unused_input=True
            )
        else:
            parts, inputs = _split(model, sample.shape)
            make_graphed_callables_thread_local(
                parts, _samples(parts, inputs, sample), num_warmup_iters=warmup_iters, allow_unused_input=True
            )
    replays = tuple(_Segment(part.forward, wanted, tuple(part.parameters())) for part, wanted in zip(parts, inputs))
    with torch.no_grad():
        for name, buf in model.named_buffers():
            buf.copy_(buffers[name])
        for layer in managed_norms(model).values():
            layer.nonfinite_flags(sample.device).zero_()
    shape, dtype, device = sample.shape, sample.dtype, sample.device

    def forward(x: Tensor) -> object:
        if model.training and torch.is_grad_enabled() and x.shape == shape and x.dtype == dtype and x.device == device:
            # Every segment's replay overwrites its activations: none may run while a backward is still to come.
            for replay in replays:
                replay.pending.check()
            for replay in replays:  # all before the first replay: the segments' buffers share one pool
                replay.gradients.release()
            values = [x]
            for replay in replays:
                values.append(replay(*(values[i] for i in replay.inputs)))
            return values[-1]
        return eager(x)

    forward.graphed_input = (shape, dtype, device)  # marks the model as captured (``is_graphed``)
    forward.segments = replays
    forward.own_forward = own_forward
    model.forward = forward


def _samples(
    parts: tuple[nn.Module, ...], inputs: tuple[tuple[int, ...], ...], sample: Tensor
) -> tuple[tuple[Tensor, ...], ...]:
    """The sample arguments of each segment: the image's clone, and the outputs of the segments before, as an
    eager forward computes them (the caller restores the buffers it changes), each requiring a gradient: every
    segment returns its input's gradient to the one before."""
    values = [sample.clone()]
    with torch.no_grad():
        for part, wanted in zip(parts[:-1], inputs):
            values.append(part(*(values[i] for i in wanted)))
    return tuple(
        # Clones: each segment's static inputs are memory of its own (layer3's output is two segments' input).
        tuple(values[i] if i == 0 else values[i].clone().requires_grad_() for i in wanted)
        for wanted in inputs
    )


class _Segment:
    """One captured graph pair of the step (the whole model, or one segment): ``call`` replays it on the values
    ``inputs`` names; its static gradient buffers (``_GraphGradients``) and its pending backward
    (``_PendingBackward``) are its own."""

    def __init__(self, call: Callable[..., object], inputs: tuple[int, ...], params: tuple[nn.Parameter, ...]) -> None:
        self.call, self.inputs = call, inputs
        self.gradients = _GraphGradients(params)
        self.pending = _PendingBackward()

    def __call__(self, *args: Tensor) -> object:
        out = self.call(*args)
        node = next((t.grad_fn for t in tree_leaves(out) if t.grad_fn is not None), None)
        if node is not None:  # no parameter trains: no backward to wait for
            self.gradients.watch(node)
            self.pending.watch(node)
        return out


class _Backward:
    """A replay's backward, as far as the next replay needs to know: ``runs`` is its backward node's pre-hook, and
    the node, which alone holds it, lets it go when nothing can backpropagate through that replay any more."""

    done = False

    def runs(self, grad_outputs: tuple[Tensor | None, ...]) -> None:
        self.done = True


class _PendingBackward:
    """Whether the last replay's backward is still to come, so that the next replay would overwrite the activations
    it reads. A replay whose output is let go without a backward (a skipped step, an exception) blocks nothing."""

    def __init__(self) -> None:
        self._last: weakref.ref[_Backward] | None = None

    def check(self) -> None:
        """Before a replay: refuse it while the last one's backward may still run."""
        last = self._last() if self._last is not None else None
        if last is not None and not last.done:
            raise SecondForwardError(
                "a second CUDA-graphed training forward before the first one's backward: the graphs hold one set of "
                "activations, which it would overwrite under the pending backward (two crops, an extra forward with "
                "gradients on); run such a forward under torch.no_grad(), or train eagerly with "
                "--model.init_args.cuda_graph false"
            )

    def watch(self, node: torch.autograd.graph.Node) -> None:
        """After a replay: follow the backward of its node."""
        backward = _Backward()
        node.register_prehook(backward.runs)
        self._last = weakref.ref(backward)


class _GraphGradients:
    """The parameters' gradients that a graphed backward returns: views of its static buffers, which the next
    replay overwrites. Their addresses are learnt from the first replay's backward (torch does not expose them);
    they never change afterwards."""

    def __init__(self, params: tuple[nn.Parameter, ...]) -> None:
        self.params = params
        self.static: list[int | None] | None = None  # per parameter: the data_ptr of its static gradient buffer

    def watch(self, node: torch.autograd.graph.Node) -> None:
        """After a replay: until the static buffers are known, a hook on its backward ``node`` records the gradients
        that node returns."""
        if self.static is None:
            handle = None

            def learn(grad_inputs: tuple[Tensor | None, ...], grad_outputs: tuple[Tensor | None, ...]) -> None:
                # The node's inputs are the graph's inputs followed by its module's parameters.
                grads = grad_inputs[len(grad_inputs) - len(self.params) :]
                self.static = [None if g is None else g.data_ptr() for g in grads]
                handle.remove()

            handle = node.register_hook(learn)

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
    for replay in getattr(model.forward, "segments", ()):
        replay.gradients.drop()


def is_graphed(model: nn.Module) -> bool:
    """Whether ``graph_training_forward`` has captured ``model``."""
    return hasattr(model.forward, "graphed_input")


def release_graphs(model: nn.Module) -> None:
    """Let go of ``model``'s graphs, if captured, and of the gradients held in their static buffers (set to None):
    it runs eagerly again, and the next ``training_call`` with ``cuda_graph`` captures anew. A fit starts so
    (NormTask): the graphs read each tensor at its address at capture, and a fit hands the layers tensors of its own
    (MABNCallback's loss scale, or none without a scaler)."""
    if not is_graphed(model):
        return
    # Gradients still held in the static buffers would keep the old graphs' pool alive during the next capture.
    drop_graph_gradients(model)
    own = model.forward.own_forward
    if own is None:
        del model.forward  # the class's forward again
    else:
        model.forward = own
    # The graphs and their memory pool sit in reference cycles (torch's Graphed class): collected now, before the
    # next capture allocates a pool beside them.
    gc.collect()


def capture_mode() -> str:
    """How this torch's captures are made, in words for a report: thread-local, through make_graphed_callables' own
    ``capture_error_mode`` or through ``torch.cuda.graph``'s (``mabn.compat.make_graphed_callables_thread_local``)."""
    via = "make_graphed_callables" if graphed_callables_take_capture_mode() else "torch.cuda.graph"
    return f"thread-local (capture_error_mode of {via})"


def training_call(model: nn.Module, x: Tensor, cuda_graph: bool, segments: str = "whole") -> object:
    """``model(x)`` in a training step; with ``cuda_graph`` the first call captures the model's graphs for
    inputs like ``x`` (as ``segments``, see ``graph_training_forward``), and later calls replay them."""
    if cuda_graph and not is_graphed(model):
        graph_training_forward(model, x, segments=segments)
    return model(x)
