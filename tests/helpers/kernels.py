"""MABN2d's two paths, the torch-op steps and the one-launch Triton kernels (on the CPU through Triton's
interpreter), chosen for every forward of a test, and the kernels' grid."""

from __future__ import annotations

import mabn.norm.mabn as mabn_module
from mabn.norm.fused import load


def kernels():
    kernels = load("mabn_kernels")
    assert kernels is not None, "Triton is not importable (or MABN_FUSED=0): the CUDA fast path cannot run"
    return kernels


def take(monkeypatch, kernels) -> None:
    """Every MABN2d forward from here on takes ``kernels`` (None: the torch-op steps), whatever the device."""
    monkeypatch.setattr(mabn_module, "_fused_kernels", lambda x: kernels)


def paths():
    """Both paths, as (name, kernels for _take)."""
    return (("torch ops", None), ("fused", kernels()))


def programs_of(monkeypatch, max_block: int | None) -> None:
    """Every launch from here on gives each program at most ``max_block`` channels (None: the kernels' own bound),
    so that a layer of a few channels runs on a grid of several programs, as a wide layer does."""
    if max_block is not None:
        monkeypatch.setattr(kernels(), "MAX_BLOCK", max_block)
