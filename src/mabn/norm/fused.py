"""Triton on CUDA: which kernel modules serve a tensor, and whether they can serve in this process.

The norms' Triton kernels replace chains of small torch ops whose launches, not their arithmetic, bound a
GPU training step. They serve CUDA tensors only; the torch-op code they replace stays the path for the CPU,
without Triton, with the environment variable MABN_FUSED=0, and in a process where Triton cannot launch them.
"""

from __future__ import annotations

import functools
import importlib
import os
import warnings
from types import ModuleType

import torch
from torch import Tensor


def enabled() -> bool:
    """Whether the kernels may serve at all: not with MABN_FUSED=0."""
    return os.environ.get("MABN_FUSED", "1") != "0"


@functools.cache
def load(name: str) -> ModuleType | None:
    """The kernel module ``mabn.norm.<name>``, or None: with MABN_FUSED=0, or where the module does not import or
    Triton's launches fail here (``_launch_failure``; one warning per process names the reason). Any exception
    counts, not only ImportError: a Triton other than the one these modules are written for fails by an
    AttributeError or a TypeError as often, and a layer must then train on its torch-op path rather than stop."""
    if not enabled():
        return None
    try:
        module = importlib.import_module(f"{__package__}.{name}")
    except Exception as error:
        _fall_back(error)
        return None
    failure = _launch_failure()
    if failure is not None:
        _fall_back(failure)
        return None
    return module


@functools.cache
def _launch_failure() -> Exception | None:
    """What a probe raised in this process, or None where it matched torch: ``row_kernels``' output kernel on a few
    elements, launched twice, so that the first launch goes through Triton's own path (compiling the kernel) and the
    second through ``launcher.Launcher``'s direct one (Triton's private launch API) where that is on. It runs where
    a launch can run: on the current CUDA device, or on the CPU under Triton's interpreter; elsewhere nothing selects
    the kernels (they serve CUDA tensors), so nothing is probed. Each layer's launches then use the same toolchain
    and the same launch path; a kernel that this Triton rejects is an error of its own (tests/test_kernels_compile.py
    compiles every configuration for the pinned Triton)."""
    try:
        import triton

        from . import row_kernels

        if triton.knobs.runtime.interpret:
            device = torch.device("cpu")
        elif torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
        else:
            return None
        # Small integers and halves: every product and sum is exact in float32, with or without a fused multiply-add.
        x = torch.arange(24, dtype=torch.float32, device=device).view(2, 3, 2, 2)
        scale = torch.arange(1, 7, dtype=torch.float32, device=device)
        bias = torch.tensor([0.5, -1.0, 2.0], device=device)
        expected = x * scale.view(2, 3, 1, 1) + bias.view(1, 3, 1, 1)
        for launch in ("first", "second"):
            if not torch.equal(row_kernels.scale_shift(x, scale, bias), expected):
                raise RuntimeError(f"the probe kernel's {launch} launch gave wrong values")
    except Exception as error:
        return error
    return None


_fell_back: str | None = None  # why the kernels are off in this process, once it has said so


def _fall_back(error: Exception) -> None:
    """One warning line per process: why the Triton kernels are off, and what serves instead."""
    global _fell_back
    if _fell_back:
        return
    lines = str(error).strip().splitlines()
    reason = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
    _fell_back = reason
    warnings.warn(
        f"MABN's Triton kernels are off in this process ({reason}); the norms take their torch-op path "
        "(MABN_FUSED=0 chooses it without this warning)",
        RuntimeWarning,
        stacklevel=2,
    )


def kernels_for(t: Tensor, name: str) -> ModuleType | None:
    """``load(name)`` where ``t`` lives on a CUDA device, else None."""
    return load(name) if t.is_cuda else None


def path() -> str:
    """Which path MABN's steps on CUDA take in this process, in words for a report: "Triton, fast launch" (the
    compiled kernels launched straight away, ``launcher.Launcher``), "Triton" (each launch through Triton's own path,
    MABN_TRITON_DIRECT=0), or "torch ops" and why (MABN_FUSED=0, or what the kernels' import or probe raised)."""
    if not enabled():
        return "torch ops (MABN_FUSED=0)"
    if load("mabn_kernels") is None:
        return f"torch ops ({_fell_back})"
    from .launcher import direct

    return "Triton, fast launch" if direct() else "Triton"
