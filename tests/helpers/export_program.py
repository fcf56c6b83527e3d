"""Whether the installed torch exports a ResNet's programs for every input size."""

from __future__ import annotations

import functools

import torch
from torch import nn


@functools.cache
def programs_take_any_size() -> bool:
    """True where torch.export's program of a ResNet stem's max pooling (3x3, stride 2, padding 1) runs at both
    parities of the input: torch 2.11's shape function rounds the output size with a branch on the remainder and
    keeps it as a guard on the input's parity, so ``export`` writes no ``.pt2`` for a ResNet there (docs/export.md);
    later torch releases keep no such guard."""
    dims = dict.fromkeys((0, 2, 3), torch.export.Dim.DYNAMIC)
    program = torch.export.export(nn.MaxPool2d(3, 2, 1), (torch.randn(2, 3, 64, 64),), dynamic_shapes=(dims,))
    try:
        program.module()(torch.randn(1, 3, 67, 70))
    except AssertionError:  # "Guard failed: ..."
        return False
    return True
