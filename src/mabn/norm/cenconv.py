"""Weight-centralized convolution (MABN paper, section 4.2)."""

from __future__ import annotations

from torch import Tensor, nn


class CenConv2d(nn.Conv2d):
    """``nn.Conv2d`` whose filters are centred before use: W - mean(W) over (in_channels, kH, kW).

    MABN normalizes by the second moment only (no mean subtraction); centred filters keep the
    feature mean near zero instead. The centring is part of the graph, so the raw weight's gradient
    is the filter gradient minus its mean, and weight decay still acts on the raw weight.
    """

    def centered_weight(self) -> Tensor:
        w = self.weight
        return w - w.mean(dim=(1, 2, 3), keepdim=True)

    def forward(self, x: Tensor) -> Tensor:
        return self._conv_forward(x, self.centered_weight(), self.bias)

    @classmethod
    def from_conv(cls, conv: nn.Conv2d) -> CenConv2d:
        """A CenConv2d with the same configuration, sharing ``conv``'s weight and bias tensors."""
        new = cls(
            conv.in_channels,
            conv.out_channels,
            conv.kernel_size,
            stride=conv.stride,
            padding=conv.padding,
            dilation=conv.dilation,
            groups=conv.groups,
            bias=conv.bias is not None,
            padding_mode=conv.padding_mode,
            device=conv.weight.device,
            dtype=conv.weight.dtype,
        )
        new.weight = conv.weight
        new.bias = conv.bias
        return new
