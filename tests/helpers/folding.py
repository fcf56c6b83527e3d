"""What the folding tests share: norms given the affine parameters a trained network has."""

from __future__ import annotations

import torch
from torch import nn


def randomize_affine(model: nn.Module, norm_types: tuple[type[nn.Module], ...], gen: torch.Generator) -> None:
    """gamma in [0.5, 1.5) and beta ~ N(0, 0.2^2) for every norm of ``norm_types`` in ``model``, drawn from ``gen``:
    a fresh model's gamma = 1 and beta = 0 would leave folding nothing to fold."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, norm_types):
                m.weight.copy_(0.5 + torch.rand(m.weight.shape, generator=gen))
                m.bias.copy_(0.2 * torch.randn(m.bias.shape, generator=gen))
