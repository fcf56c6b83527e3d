"""Host work per norm layer: the operators one training forward and backward issues, and their host time.

On a GPU at the small per-device batches MABN is made for, an eager training step is bound by the host issuing
kernels (docs/cost.md): a norm layer's eager cost there is the operators it issues and the Python around them, not
its arithmetic. These are counted on any machine:

- ATen operators: every call that reaches the dispatcher (seen by a ``TorchDispatchMode``), views and metadata calls
  such as ``promote_types`` included, in ``layer(x)`` and in ``out.backward(grad)`` with the parameters' gradients
  None, as after ``zero_grad()``, so no gradient accumulation is counted. Operators inside a Triton launch are left
  out: Triton's interpreter moves tensors there, and on a GPU a launch issues none.
- Triton launches: the calls of the norms' kernel launcher (``mabn.norm.launcher.Launcher``).
- Host time: the median of interleaved repeats of one forward and backward of a tiny input, where on the CPU the
  time is all overhead.

MABN2d runs on its Triton path (row ``mabn``), the one a CUDA tensor takes, and on its torch-op path (row ``mabn
torch ops``: the CPU's, the one for ``sync_stats`` and ``MABN_FUSED=0``, and the definition that torch.compile
fuses). For CPU tensors the Triton path is selected as for a CUDA tensor, and each launch is replaced by the host
work of the direct launch short of the launch itself (its key and arguments packed), so that nothing needs a GPU: the
counts are the CUDA path's, and the host time leaves out the launch calls.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator
from typing import NamedTuple
from unittest import mock

import torch
from torch import Tensor, nn

from ...compat import TorchDispatchMode
from ...norm import MABN2d
from ...norm import mabn as mabn_module
from ...norm.fused import load
from ...norm.launcher import Launcher, pack
from .measure import environment, median_times

SHAPE = (2, 64, 8, 8)  # a layer of PSPNet's batch of 2, small enough that the host time is all overhead


class OpCount(NamedTuple):
    """One training forward and backward of a layer."""

    forward: int  # ATen operators
    backward: int
    launches: int  # Triton launches, both directions
    ops: Counter  # operator name -> calls, both directions: what the totals are made of


class _Count(TorchDispatchMode):
    """Counts the ATen operators called inside it, and the Triton launches, leaving out the operators inside them."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()
        self.launches = 0
        self.in_launch = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.in_launch:
            self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def statistic_paths(
    triton_inputs: tuple[Tensor, ...], run_kernels: bool, counter: _Count | None = None
) -> Iterator[None]:
    """Inside it a MABN2d training forward takes the Triton path for an input in ``triton_inputs`` (on any device, as
    a CUDA tensor selects it) and the torch-op path for any other. Without ``run_kernels`` a launch only packs its
    arguments. ``counter`` counts the launches and leaves the operators inside them out."""
    kernels = load("mabn_kernels") if triton_inputs else None
    if triton_inputs and kernels is None:
        raise RuntimeError("Triton is not importable (or MABN_FUSED=0): MABN2d has no Triton path here")
    launch_kernel = Launcher.__call__

    def select(x: Tensor):
        return kernels if any(x is t for t in triton_inputs) else None

    def launch(launcher: Launcher, args: tuple, constexprs: dict) -> None:
        if counter is not None:
            counter.launches += 1
            counter.in_launch = True
        try:
            if run_kernels:
                launch_kernel(launcher, args, constexprs)
            else:
                pack(args, constexprs)  # the key and the arguments, as every launch packs them
        finally:
            if counter is not None:
                counter.in_launch = False

    with mock.patch.object(mabn_module, "_fused_kernels", select), mock.patch.object(Launcher, "__call__", launch):
        yield


def _training_step(layer: nn.Module, x: Tensor, grad: Tensor) -> Callable[[], Tensor]:
    """Forward of ``x``, gradients None first (as after ``zero_grad()``); returns the output for ``backward``."""

    def forward() -> Tensor:
        x.grad = None
        for p in layer.parameters():
            p.grad = None
        return layer(x)

    return forward


def count(layer: nn.Module, x: Tensor, grad: Tensor, triton: bool = False, run_kernels: bool = True) -> OpCount:
    """The operators and launches of one training forward and backward of ``layer`` on ``x`` (MABN2d: on its Triton
    path with ``triton``), after two uncounted steps (the first creates what later steps reuse)."""
    layer.train()
    x = x.detach().requires_grad_()
    forward = _training_step(layer, x, grad)
    counter = _Count()
    with statistic_paths((x,) if triton else (), run_kernels, counter):
        for _ in range(2):
            forward().backward(grad)
        counter.launches = 0
        with counter:
            out = forward()
            n_forward = counter.ops.total()
            out.backward(grad)
    return OpCount(n_forward, counter.ops.total() - n_forward, counter.launches, counter.ops)


def _layers(c: int) -> dict[str, tuple[nn.Module, bool]]:
    """Row name -> (layer, on MABN's Triton path). MABN in its steady state from the second step: moving averages and
    renormalization on (its counts are the same in every phase)."""
    rows: dict[str, tuple[nn.Module, bool]] = {"bn": (nn.BatchNorm2d(c), False)}
    if load("mabn_kernels") is not None:
        rows["mabn"] = (MABN2d(c, warmup_iters=1, renorm_warmup_iters=1), True)
    rows["mabn torch ops"] = (MABN2d(c, warmup_iters=1, renorm_warmup_iters=1), False)
    return rows


def run(device: torch.device, repeats: int = 1000, shape: tuple[int, int, int, int] = SHAPE) -> str:
    """Count and time every row on ``device`` and return a markdown table with its ratios to BatchNorm2d."""
    # On CUDA the kernels run; elsewhere a launch packs its arguments only (see the module's docstring).
    run_kernels = device.type == "cuda"
    gen = torch.Generator().manual_seed(0)
    grad = torch.randn(shape, generator=gen).to(device)
    rows = {name: (layer.to(device), triton) for name, (layer, triton) in _layers(shape[1]).items()}
    inputs = {name: torch.randn(shape, generator=gen).to(device).requires_grad_() for name in rows}
    counts = {name: count(layer, inputs[name], grad, triton, run_kernels) for name, (layer, triton) in rows.items()}

    steps = {name: _training_step(layer, inputs[name], grad) for name, (layer, _) in rows.items()}
    fns = {name: (lambda forward=forward: forward().backward(grad)) for name, forward in steps.items()}
    triton_inputs = tuple(inputs[name] for name, (_, triton) in rows.items() if triton)
    # A launch that only packs its arguments leaves its outputs unwritten: flushing denormals keeps whatever they
    # hold from slowing the arithmetic timed after it.
    flush = not run_kernels and torch.set_flush_denormal(True)
    try:
        with statistic_paths(triton_inputs, run_kernels):
            times = median_times(fns, device, repeats, warmup=20)
    finally:
        if flush:
            torch.set_flush_denormal(False)

    launches = "launches run" if run_kernels else "each launch replaced by its argument packing"
    lines = [
        f"Host work of one training forward + backward, {tuple(shape)}, {environment(device)}; ATen operators counted "
        f"by a TorchDispatchMode (views included, gradients None); host time: median of {repeats} interleaved "
        f"repeats ({launches})",
        "",
        "| layer | ops forward | ops backward | Triton launches | host µs per call | host time / BN |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, c in counts.items():
        lines.append(
            f"| {name} | {c.forward} | {c.backward} | {c.launches} | {times[name] * 1e6:.1f} "
            f"| {times[name] / times['bn']:.2f} |"
        )
    return "\n".join(lines)
