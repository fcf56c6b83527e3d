"""The CPU stand-in for ``torch.cuda.make_graphed_callables`` (``GraphStandIn``), which the ``graph_stand_in``
fixture of tests/conftest.py installs."""

from __future__ import annotations

import inspect

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Operators whose result the host reads, or whose output's size depends on the values: on a GPU each waits for the
# device, which a stream under capture refuses ("operation not permitted when stream is capturing").
HOST_READS = {
    torch.ops.aten._local_scalar_dense,  # .item(), bool(), int() and float() of a tensor
    torch.ops.aten.equal,
    torch.ops.aten.nonzero,
    torch.ops.aten.masked_select,
    torch.ops.aten._unique2,
    torch.ops.aten.unique_consecutive,
    torch.ops.aten.unique_dim,
    torch.ops.aten.bincount,  # its length is the input's maximum, read by the host
}
_INDEXING = {torch.ops.aten.index, torch.ops.aten.index_put, torch.ops.aten._index_put_impl_}


def reads_the_host(func, args) -> bool:
    """Whether the operator ``func`` on ``args`` reads the device from the host on a GPU: one of ``HOST_READS``, or
    indexing by a boolean mask, whose output's size is the mask's count (a ``nonzero`` inside the operator)."""
    if func.overloadpacket in HOST_READS:
        return True
    if func.overloadpacket in _INDEXING:
        return any(isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8) for t in args[1])
    return False


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _held(model: torch.nn.Module) -> dict[int, torch.Tensor]:
    """Every tensor ``model``'s modules hold, by storage address: parameters, buffers and tensor attributes (a
    layer's loss scale, its flags); the tensors that a graph captured at their addresses may outlive."""
    held = {}
    for m in model.modules():
        for t in (*m._parameters.values(), *m._buffers.values(), *vars(m).values()):
            if isinstance(t, torch.Tensor):
                held[_storage(t)] = t
    return held


class _Trace(TorchDispatchMode):
    """What one direction of a capture or replay of ``model`` runs: its operators, in order, and the tensors of
    ``model``'s modules it reads (``read``, by storage address; kept, so that no later tensor takes the address of
    a captured one). With ``capturing``, a host read raises as on a GPU."""

    def __init__(self, model: torch.nn.Module, capturing: bool = False) -> None:
        super().__init__()
        self.ops: list[torch._ops.OpOverload] = []
        self.held = _held(model)
        self.read: dict[int, torch.Tensor] = {}
        self.capturing = capturing

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.capturing and reads_the_host(func, args):
            raise RuntimeError(
                f"{func} reads the device from the host during a CUDA-graph capture (on a GPU: operation not "
                "permitted when stream is capturing)"
            )
        self.ops.append(func)
        for t in torch.utils._pytree.tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and _storage(t) in self.held:
                self.read[_storage(t)] = self.held[_storage(t)]
        return func(*args, **(kwargs or {}))

    def check_against(self, capture: _Trace, what: str) -> None:
        """Raise unless this replay ran ``capture``'s operators on the tensors it read: a GPU would replay the
        captured kernels on the captured addresses, whatever the Python code does now."""
        if self.ops != capture.ops:
            at = next((i for i, (a, b) in enumerate(zip(self.ops, capture.ops)) if a != b), None)
            at = min(len(self.ops), len(capture.ops)) if at is None else at
            ran, captured = (ops[at] if at < len(ops) else "nothing" for ops in (self.ops, capture.ops))
            raise RuntimeError(
                f"the replay's {what} ran {ran} where the capture ran {captured} (operator {at}): a CUDA graph "
                "replays the captured kernels, not the Python code's other path"
            )
        if self.read.keys() != capture.read.keys():
            new = [t for key, t in self.read.items() if key not in capture.read]
            gone = [t for key, t in capture.read.items() if key not in self.read]
            kinds = "; ".join(
                f"{which} " + ", ".join(f"{tuple(t.shape)} {t.dtype}" for t in ts)
                for which, ts in (("new:", new), ("captured:", gone))
                if ts
            )
            raise RuntimeError(
                f"the replay's {what} read other tensors than the capture ({kinds}): a CUDA graph reads the tensors "
                "it captured, at their addresses; give it one tensor whose values change in place"
            )


class GraphStandIn:
    """``torch.cuda.make_graphed_callables`` as a CPU can act it out. torch runs the Python forward and backward
    once, at capture, and every replay runs the captured kernels on the captured addresses; the stand-in runs the
    Python code at every replay and holds it to what a GPU's replay would do:

    - torch's refusals: hooks on the module, buffers that require grad, autocast's weight cache (on the sample's
      device: the CPU stands for the GPU here);
    - ``num_warmup_iters`` real training forwards and backwards (gradients by autograd.grad, none accumulated)
      whose output gradients are NaN, as torch's ``torch.empty_like`` ones may read;
    - a capture: a forward and a backward (of NaN gradients, torch's uninitialised ones) in which a host read
      (``.item()``, ``bool()`` or ``float()`` of a tensor, ``torch.equal``, ``nonzero``) raises, as on a GPU; it
      records each direction's operators and the tensors it reads (``_Trace``); its outputs and gradients are the
      static output and gradient buffers, as in torch;
    - then the model's forward replaced by a "replay", an autograd Function over (*inputs, *parameters) as torch's
      ``Graphed``: its forward copies the inputs into the static ones, runs the eager forward and copies its
      outputs into the static ones, whose detached views it returns; its backward copies the incoming gradients
      into static buffers, and returns detached views of the static gradient buffers (of the inputs that require
      grad, a segment's after the image, and of the parameters), which autograd may adopt as ``.grad``;
    - a tuple of modules (``graph_segments: stages``) is warmed up whole before each is captured, as in torch,
      and each gets a replay of its own, with its own static buffers and saved tensors;
    - each replay runs the capture's operators on the tensors the capture read, or raises: another path through
      the Python code, or a tensor put in the place of a captured one (a new loss scale, buffer or flag), would
      not reach a GPU's graph;
    - the replays share one set of saved tensors: every backward runs through the latest forward's autograd
      graph, as a GPU's one backward graph reads the activations that the last forward replay wrote. A second
      forward before an earlier one's backward hands that backward the second one's activations;
    - each replay first fills the static gradient buffers with NaN: in torch the forward graph's temporaries may
      share their memory in the graphs' pool, and the backward graph rewrites them. A gradient kept in one across
      a replay is corrupted, as on a GPU;
    - the capture mode: a capture in torch's default global mode is refused, since a CUDA call of another thread
      during it (the loader's pin-memory thread, DDP's communication threads) fails it on a GPU. With
      ``takes_mode`` the stand-in is the ``make_graphed_callables`` of torch 2.12 on, which takes
      ``capture_error_mode`` (default "global"); without, that of torch 2.11 and before, which refuses the argument
      and captures through ``torch.cuda.graph`` with that class's default mode, read where the call finds it;
    - segments captured by one call share one memory pool: each replay fills the static gradient buffers of every
      segment of its call with NaN, so a gradient held in another segment's buffer across that replay is
      corrupted, as on a GPU.

    What it cannot see: Python state a forward changes at every replay (a GPU changes it once, at capture), and
    host reads that dispatch no operator (``.tolist()``, ``.numpy()``).

    Records the shapes it captured and replayed, over all models, and the modes it captured in."""

    def __init__(self, takes_mode: bool = True) -> None:
        self.captured: list[tuple[int, ...]] = []
        self.replayed: list[tuple[int, ...]] = []
        self.modes: list[str] = []
        self.takes_mode = takes_mode
        # What ``inspect.signature`` shows of this make_graphed_callables, as callers probe torch's.
        params = [
            inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default)
            for name, default in (
                ("callables", inspect.Parameter.empty),
                ("sample_args", inspect.Parameter.empty),
                ("num_warmup_iters", 3),
                ("allow_unused_input", False),
                ("pool", None),
                *((("capture_error_mode", "global"),) if takes_mode else ()),
            )
        ]
        self.__signature__ = inspect.Signature(params)

    def _mode(self, options: dict) -> str:
        """The capture mode of a call with ``options``, as the modelled torch decides it."""
        if self.takes_mode:
            return options.pop("capture_error_mode", "global")
        if "capture_error_mode" in options:
            raise TypeError("make_graphed_callables() got an unexpected keyword argument 'capture_error_mode'")
        return inspect.signature(torch.cuda.graph).parameters["capture_error_mode"].default

    @staticmethod
    def _refuse_as_torch(model, sample_args) -> None:
        """torch's own refusals before a capture, with its messages."""
        device = sample_args[0].device.type
        if torch.is_autocast_enabled(device) and torch.is_autocast_cache_enabled():
            raise RuntimeError(
                "make_graphed_callables does not support the autocast caching. Please set `cache_enabled=False`."
            )
        if model._backward_hooks or model._forward_hooks or model._forward_pre_hooks:
            raise AssertionError(
                "Modules must not have hooks registered at the time they are passed. However, registering hooks "
                "on modules after passing them through make_graphed_callables is allowed."
            )
        if any(b.requires_grad for b in model.buffers()):
            raise AssertionError(
                "In any :class:`~torch.nn.Module` passed to :func:`~make_graphed_callables`, only parameters may be "
                "trainable. All buffers must have ``requires_grad=False``."
            )

    def __call__(self, callables, sample_args, num_warmup_iters=3, allow_unused_input=False, **options):
        """One module and its sample arguments, or a tuple of modules and a tuple of their sample arguments (a
        segmented capture), as torch takes them: every module is warmed up before any is captured."""
        mode = self._mode(options)
        if mode != "thread_local":
            raise RuntimeError(
                f"CUDA-graph capture in {mode} mode: a CUDA call of another thread during it (the loader's pin-memory "
                "thread pinning a batch) fails the capture (operation not permitted when stream is capturing); "
                "capture in thread_local mode"
            )
        self.modes.append(mode)
        single = not isinstance(callables, tuple)
        models, samples = ((callables,), (sample_args,)) if single else (callables, sample_args)
        for model, args in zip(models, samples, strict=True):
            self._refuse_as_torch(model, args)
        for model, args in zip(models, samples):
            surface = [*(a for a in args if a.requires_grad), *(p for p in model.parameters() if p.requires_grad)]
            for _ in range(num_warmup_iters):
                outs = [o for o in torch.utils._pytree.tree_leaves(model(*args)) if o.requires_grad]
                nan = [torch.full_like(o, float("nan")) for o in outs]
                torch.autograd.grad(outs, surface, nan, allow_unused=allow_unused_input)
        pool: list[torch.Tensor] = []  # every static gradient buffer of the call
        for model, args in zip(models, samples):
            self._graph(model, tuple(args), pool)
        return callables

    def _graph(self, model, static_inputs: tuple[torch.Tensor, ...], pool: list[torch.Tensor]) -> None:
        """Capture ``model`` at ``static_inputs`` and replace its forward by the replay; its static gradient buffers
        join ``pool``, which each replay of the call overwrites."""
        leaves = torch.utils._pytree.tree_leaves
        self.captured.append(tuple(static_inputs[0].shape))
        eager, stand_in, params = model.forward, self, tuple(model.parameters())
        # What the backward differentiates: the inputs that require grad (a segment's, after the image), then the
        # trainable parameters; the gradient of each is returned from a static buffer.
        surface = (*static_inputs, *params)
        wanted = [t for t in surface if t.requires_grad]

        def backward_through(outs, capturing=False):
            """The gradients (by tensor) of the static output gradients through ``outs``, traced."""
            with _Trace(model, capturing) as trace:
                grads = torch.autograd.grad(
                    [o for o in outs if o.requires_grad],
                    wanted,
                    [g for g in static_grad_outputs if g is not None],
                    allow_unused=True,
                    retain_graph=True,  # a GPU's backward graph may replay again on the same activations
                )
            return dict(zip(map(id, wanted), grads)), trace

        with _Trace(model, capturing=True) as forward_capture:
            outs, spec = torch.utils._pytree.tree_flatten(eager(*static_inputs))
        static_outputs = [o.detach() for o in outs]
        static_grad_outputs = [torch.full_like(o, float("nan")) if o.requires_grad else None for o in outs]
        by_tensor, backward_capture = backward_through(outs, capturing=True)
        static_grads = [by_tensor.get(id(t)) for t in surface]
        pool.extend(buf for buf in static_grads if buf is not None)
        latest: list[torch.Tensor] = []  # the last replay's outputs, and through them its autograd graph

        class Replay(torch.autograd.Function):
            @staticmethod
            def forward(ctx, *inputs):
                for static, x in zip(static_inputs, inputs):
                    static.copy_(x)
                for buf in pool:
                    buf.fill_(float("nan"))
                with torch.enable_grad(), _Trace(model) as trace:
                    flat = leaves(eager(*static_inputs))
                trace.check_against(forward_capture, "forward")
                for buf, o in zip(static_outputs, flat):
                    buf.copy_(o.detach())
                latest[:] = flat
                return tuple(o.detach() for o in static_outputs)

            @staticmethod
            @torch.autograd.function.once_differentiable
            def backward(ctx, *grads):
                for buf, g in zip(static_grad_outputs, grads):
                    if buf is not None:
                        buf.copy_(g)
                by_tensor, trace = backward_through(latest)
                trace.check_against(backward_capture, "backward")
                for buf, t in zip(static_grads, surface):
                    if buf is not None:
                        grad = by_tensor[id(t)]
                        buf.copy_(grad) if grad is not None else buf.zero_()
                return tuple(None if buf is None else buf.detach() for buf in static_grads)

        def replay(*inputs):
            stand_in.replayed.append(tuple(inputs[0].shape))
            out = Replay.apply(*inputs, *params)
            return torch.utils._pytree.tree_unflatten(list(out), spec)

        model.forward = replay
