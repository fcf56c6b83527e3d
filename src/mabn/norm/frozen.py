"""Frozen BatchNorm: BN's statistics and affine fixed, the field's answer to BN weights and small batches
(detectron2's ``FrozenBatchNorm2d``, mmsegmentation's ``norm_eval=True``)."""

from __future__ import annotations

import torch
from torch import Tensor, nn


class FrozenBatchNorm2d(nn.Module):
    """out = weight * (x - running_mean) / sqrt(running_var + eps) + bias, in training and eval alike.

    The four per-channel tensors are buffers under BatchNorm2d's names, so a BN network's state dict loads into it
    (without ``num_batches_tracked``); no statistic of the batch is taken, so the layer is the same for a batch of
    one or of many, and it folds into the conv before it. ``train_affine=True`` makes ``weight`` and ``bias``
    parameters that train, the statistics staying fixed.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, train_affine: bool = False) -> None:
        super().__init__()
        self.num_features, self.eps, self.train_affine = num_features, eps, train_affine
        weight, bias = torch.ones(num_features), torch.zeros(num_features)
        if train_affine:
            self.weight, self.bias = nn.Parameter(weight), nn.Parameter(bias)
        else:
            self.register_buffer("weight", weight)
            self.register_buffer("bias", bias)
        self.register_buffer("running_mean", torch.zeros(num_features))
        self.register_buffer("running_var", torch.ones(num_features))

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() != 4 or x.shape[1] != self.num_features:
            raise ValueError(f"FrozenBatchNorm2d({self.num_features}) takes (N, {self.num_features}, H, W), got "
                             f"{tuple(x.shape)}")  # fmt: skip
        scale = self.weight * (self.running_var + self.eps).rsqrt()
        shift = self.bias - self.running_mean * scale
        c = self.num_features
        return torch.addcmul(shift.to(x.dtype).view(1, c, 1, 1), x, scale.to(x.dtype).view(1, c, 1, 1))

    def extra_repr(self) -> str:
        return f"{self.num_features}, eps={self.eps}, train_affine={self.train_affine}"
