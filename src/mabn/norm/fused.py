"""Triton on CUDA: which kernel modules serve a tensor, and a launcher with little host overhead.

The norms' Triton kernels replace chains of small torch ops whose launches, not their arithmetic, bound a
GPU training step. They serve CUDA tensors only; the torch-op code they replace stays the path for the CPU,
without Triton, and with the environment variable MABN_FUSED=0.
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable
from types import ModuleType

import torch
from torch import Tensor


def enabled() -> bool:
    """Whether the kernels may serve at all: not with MABN_FUSED=0."""
    return os.environ.get("MABN_FUSED", "1") != "0"


@functools.cache
def load(name: str) -> ModuleType | None:
    """The kernel module ``mabn.norm.<name>``, or None without Triton or with MABN_FUSED=0."""
    if not enabled():
        return None
    try:
        return importlib.import_module(f"{__package__}.{name}")
    except ImportError:
        return None


def kernels_for(t: Tensor, name: str) -> ModuleType | None:
    """``load(name)`` where ``t`` lives on a CUDA device, else None."""
    return load(name) if t.is_cuda else None


class Launcher:
    """``kernel[grid](*args, **constexprs)``, where ``grid(meta)`` gives the grid from the arguments by name (Triton's
    convention). Later launches of a configuration seen before go straight to its compiled kernel, at the grid of its
    first launch: Triton's per-call argument binding and specialization cost tens of microseconds of host time, and a
    training step launches a few hundred of these kernels.

    ``key`` must determine all that Triton specializes on and the grid: the arguments' dtypes, the integer
    arguments' values, the pointers' 16-byte alignment, the constexprs (``key_of`` adds the device). The arguments
    are passed to the compiled kernel in signature order, constexprs last, as Triton's own launch does; every
    launch runs ``num_warps`` warps per program. MABN_TRITON_DIRECT=0 keeps Triton's path for every launch.
    """

    def __init__(self, kernel, grid: Callable[[dict], tuple[int, ...]], num_warps: int) -> None:
        import triton

        self.kernel = kernel
        self.grid = grid
        self.num_warps = num_warps
        self.knobs = triton.knobs.runtime
        self.compiled: dict[tuple, tuple[object, tuple[int, int, int]]] = {}
        self.direct = os.environ.get("MABN_TRITON_DIRECT", "1") != "0" and not self.knobs.interpret

    def __call__(self, key: tuple, args: tuple, constexprs: dict) -> None:
        known = self.compiled.get(key)
        if known is None:
            grid = (*self.grid({**dict(zip(self.kernel.arg_names, args)), **constexprs}), 1, 1)[:3]
            compiled = self.kernel[grid](*args, **constexprs, num_warps=self.num_warps)
            if self.direct:
                self.compiled[key] = compiled, grid
            return
        compiled, grid = known
        stream = torch.cuda.current_stream().cuda_stream
        # Pointers as plain integers: the launcher then skips its per-pointer data_ptr() call and driver query.
        args = (*(a.data_ptr() if isinstance(a, Tensor) else a for a in args), *constexprs.values())
        compiled.run(
            *grid, stream, compiled.function, compiled.packed_metadata,
            compiled.launch_metadata(grid, stream, *args),
            self.knobs.launch_enter_hook, self.knobs.launch_exit_hook, *args,
        )  # fmt: skip


def key_of(t: Tensor, *rest: object) -> tuple:
    """A ``Launcher`` key: the current device (where Triton loads the kernel) and ``rest``."""
    return (torch.cuda.current_device() if t.is_cuda else -1, *rest)


def aligned(t: Tensor) -> bool:
    """Whether Triton sees ``t``'s pointer as 16-byte aligned (a fresh allocation always is)."""
    return t.data_ptr() % 16 == 0
