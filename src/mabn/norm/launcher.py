"""A launcher of Triton kernels with little host overhead: after a configuration's first launch through Triton, its
compiled kernel straight away. The norms' kernel modules launch through it, and ``fused`` probes it before they
serve. Importable without Triton, which the first ``Launcher`` imports."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from torch import Tensor

from ..compat import launch


def direct() -> bool:
    """Whether ``Launcher`` launches compiled kernels straight away (its fast path): not with MABN_TRITON_DIRECT=0,
    nor under Triton's interpreter."""
    import triton

    return os.environ.get("MABN_TRITON_DIRECT", "1") != "0" and not triton.knobs.runtime.interpret


class Launcher:
    """``kernel[grid](*args, **constexprs)``, where ``grid(meta)`` gives the grid from the arguments by name (Triton's
    convention). Later launches of a configuration seen before go straight to its compiled kernel, at the grid of its
    first launch: Triton's per-call argument binding and specialization cost tens of microseconds of host time, and a
    training step launches a few hundred of these kernels.

    A configuration is what ``pack`` keys: every tensor's dtype and every pointer's 16-byte alignment, every other
    argument's value and the constexprs, with the current device (where Triton loads the kernel): all that Triton
    specializes on, and all that the grid depends on. The arguments are passed to the compiled kernel in signature
    order, constexprs last, as Triton's own launch does; every launch runs ``num_warps`` warps per program.
    MABN_TRITON_DIRECT=0 keeps Triton's path for every launch.
    """

    def __init__(self, kernel, grid: Callable[[dict], tuple[int, ...]], num_warps: int) -> None:
        import triton

        self.kernel = kernel
        self.grid = grid
        self.num_warps = num_warps
        self.knobs = triton.knobs.runtime
        self.compiled: dict[tuple[int | None, tuple], tuple[object, tuple[int, int, int]]] = {}
        self.direct = direct()

    def __call__(self, args: tuple, constexprs: dict) -> None:
        key, packed = pack(args, constexprs)
        key = (torch.cuda.current_device() if self.direct else None), key  # kept only on the direct path's device
        known = self.compiled.get(key)
        if known is None:
            grid = (*self.grid({**dict(zip(self.kernel.arg_names, args)), **constexprs}), 1, 1)[:3]
            compiled = self.kernel[grid](*args, **constexprs, num_warps=self.num_warps)
            if self.direct:
                self.compiled[key] = compiled, grid
            return
        compiled, grid = known
        stream = torch.cuda.current_stream().cuda_stream
        launch(compiled, grid, stream, packed, self.knobs)  # Triton's private launch: mabn.compat.launch


def pack(args: tuple, constexprs: dict) -> tuple[tuple, list]:
    """A launch's key (every tensor's dtype, every other argument's value, the constexprs; each pointer's 16-byte
    alignment) and its arguments as the compiled kernel takes them (pointers as plain integers: the launcher then
    skips its per-pointer data_ptr() call and driver query; the constexprs last). One pass over the arguments, since
    it runs at every launch: the alignments are spelt out in a second pass only where some pointer is not aligned
    (a fresh allocation always is; a part of a split allocation or a view may not be)."""
    key = []
    packed = []
    addresses = 0  # the pointers or-ed together: their low 4 bits are clear where every one is aligned
    for a in args:
        if isinstance(a, Tensor):
            pointer = a.data_ptr()
            addresses |= pointer
            key.append(a.dtype)
            packed.append(pointer)
        else:
            key.append(a)
            packed.append(a)
    if addresses % 16:
        key.append(tuple(a.data_ptr() % 16 == 0 for a in args if isinstance(a, Tensor)))
    values = constexprs.values()
    key.extend(values)
    packed.extend(values)
    return tuple(key), packed
