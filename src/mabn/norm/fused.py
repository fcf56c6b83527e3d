"""Triton on CUDA: which kernel modules serve a tensor, and a launcher with little host overhead.

The norms' Triton kernels replace chains of small torch ops whose launches, not their arithmetic, bound a
GPU training step. They serve CUDA tensors only; the torch-op code they replace stays the path for the CPU,
without Triton, and with the environment variable MABN_FUSED=0.
"""

from __future__ import annotations

import functools
import importlib
import os
from types import ModuleType

import torch
from torch import Tensor


@functools.cache
def load(name: str) -> ModuleType | None:
    """The kernel module ``mabn.norm.<name>``, or None without Triton or with MABN_FUSED=0."""
    if os.environ.get("MABN_FUSED", "1") == "0":
        return None
    try:
        return importlib.import_module(f"{__package__}.{name}")
    except ImportError:
        return None


def kernels_for(t: Tensor, name: str) -> ModuleType | None:
    """``load(name)`` where ``t`` lives on a CUDA device, else None."""
    return load(name) if t.is_cuda else None


GRID = (1, 1, 1)  # every launch is one program


class Launcher:
    """``kernel[GRID](*args, **constexprs)``: one program, as the norms' statistic steps run (their channels are
    few, and one program sees all of them before it commits anything). Later launches of a configuration seen
    before go straight to its compiled kernel: Triton's per-call argument binding and specialization cost tens of
    microseconds of host time, and a training step launches a few hundred of these kernels.

    ``key`` must determine all that Triton specializes on: the arguments' dtypes, the integer arguments'
    values, the pointers' 16-byte alignment, the constexprs (``key_of`` adds the device). The arguments are
    passed to the compiled kernel in signature order, constexprs last, as Triton's own launch does.
    MABN_TRITON_DIRECT=0 keeps Triton's path for every launch.
    """

    def __init__(self, kernel) -> None:
        import triton

        self.kernel = kernel
        self.knobs = triton.knobs.runtime
        self.compiled: dict[tuple, object] = {}
        self.direct = os.environ.get("MABN_TRITON_DIRECT", "1") != "0" and not self.knobs.interpret

    def __call__(self, key: tuple, args: tuple, constexprs: dict) -> None:
        compiled = self.compiled.get(key)
        if compiled is None:
            compiled = self.kernel[GRID](*args, **constexprs)
            if self.direct:
                self.compiled[key] = compiled
            return
        stream = torch.cuda.current_stream().cuda_stream
        # Pointers as plain integers: the launcher then skips its per-pointer data_ptr() call and driver query.
        args = (*(a.data_ptr() if isinstance(a, Tensor) else a for a in args), *constexprs.values())
        compiled.run(
            *GRID, stream, compiled.function, compiled.packed_metadata,
            compiled.launch_metadata(GRID, stream, *args),
            self.knobs.launch_enter_hook, self.knobs.launch_exit_hook, *args,
        )  # fmt: skip


def key_of(t: Tensor, *rest: object) -> tuple:
    """A ``Launcher`` key: the current device (where Triton loads the kernel) and ``rest``."""
    return (torch.cuda.current_device() if t.is_cuda else -1, *rest)


def aligned(t: Tensor) -> bool:
    """Whether Triton sees ``t``'s pointer as 16-byte aligned (a fresh allocation always is)."""
    return t.data_ptr() % 16 == 0
