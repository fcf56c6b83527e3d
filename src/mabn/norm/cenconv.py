"""Convolution with centred weights, the paper's "weight centralization" (MABN paper, section 4.2).

A CenConv2d centres its filters in every training forward (and projects the weight gradient back), which is
the definition and works with any optimizer. With SGD (any momentum, dampening, Nesterov and weight decay, no
gradient clipping) the same weights follow from keeping the stored weights centred instead: the centring P is a
linear projection, so P commutes with SGD's update, and re-centring in place after every optimizer step (one
launch on CUDA, a foreach call elsewhere, ``keep_centred``, which both stages use) gives exactly the weights the
forward would use, while the forward and backward run as a plain convolution: fewer passes over the weights per
step.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from types import ModuleType
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from ..compat import conv_forward, foreach_sub_
from .fused import kernels_for


def _filter_mean(w: Tensor) -> Tensor:
    return w.mean(dim=(1, 2, 3), keepdim=True)


def _centred(w: Tensor) -> Tensor:
    return w - _filter_mean(w)


def _centred_from(weight: Tensor, mean: Tensor, dtype: torch.dtype | None) -> Tensor:
    """weight minus its per-filter means ``mean``, in ``dtype`` (the autocast dtype) when given."""
    wc = weight - mean
    return wc if dtype is None else wc.to(dtype)


class _CentredConv2d(torch.autograd.Function):
    """conv2d(x, W - mean(W)) that saves the raw weight, not the centred copy.

    Left to autograd, the centred weight is a new tensor kept alive for the backward pass: one extra
    copy of every centred conv's weight during training (about 6% of a PSPNet-101 step's peak memory
    at batch 2). Here the backward recomputes it from the saved per-filter means (one value per filter;
    a subtraction, not another reduction: on a GPU each op is host time) and projects the weight
    gradient onto zero-mean filters, g - mean(g), which is exactly the centring's Jacobian.
    Under autocast the convolution runs in the autocast dtype, as ``nn.Conv2d`` would.
    """

    @staticmethod
    def forward(
        ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, conf: tuple, dtype: torch.dtype | None
    ) -> Tensor:
        stride, padding, dilation, groups = conf
        xc = x if dtype is None else x.to(dtype)
        mean = _filter_mean(weight)
        wc = _centred_from(weight, mean, dtype)
        bc = bias if bias is None or dtype is None else bias.to(dtype)
        ctx.save_for_backward(xc, weight, mean)
        ctx.conf, ctx.dtype, ctx.x_dtype, ctx.has_bias = conf, dtype, x.dtype, bias is not None
        return torch.ops.aten.convolution(xc, wc, bc, stride, padding, dilation, False, [0, 0], groups)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: Tensor) -> tuple:
        xc, weight, mean = ctx.saved_tensors
        stride, padding, dilation, groups = ctx.conf
        wc = _centred_from(weight, mean, ctx.dtype)  # the forward's, bit for bit
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_x, grad_w, grad_b = torch.ops.aten.convolution_backward(
            grad_out if grad_out.dtype == wc.dtype else grad_out.to(wc.dtype),
            xc,
            wc,
            [wc.shape[0]] if ctx.has_bias else None,
            stride,
            padding,
            dilation,
            False,
            [0, 0],
            groups,
            [need_x, need_w, need_b and ctx.has_bias],
        )
        del wc  # the recomputed weight goes before the projection allocates: the two are never alive together
        if grad_x is not None and grad_x.dtype != ctx.x_dtype:
            grad_x = grad_x.to(ctx.x_dtype)
        if grad_w is not None:
            grad_w = grad_w if grad_w.dtype == weight.dtype else grad_w.to(weight.dtype)
            grad_w.sub_(_filter_mean(grad_w))
        if grad_b is not None and grad_b.dtype != weight.dtype:
            grad_b = grad_b.to(weight.dtype)
        return grad_x, grad_w, grad_b, None, None


class CenConv2d(nn.Conv2d):
    """``nn.Conv2d`` whose filters are centred before use: W - mean(W) over (in_channels, kH, kW).

    MABN normalizes by the second moment only (no mean subtraction); centred filters keep the
    feature mean near zero instead. The raw weight's gradient is the filter gradient minus its mean,
    and weight decay still acts on the raw weight. In training the centred weight is recomputed in the
    backward pass rather than stored (see ``_CentredConv2d``), so between forward and backward the layer
    keeps only one float per filter more than ``nn.Conv2d``.

    ``centred_in_place`` (set by ``keep_centred``): the stored weight is kept centred by the optimizer
    side, and the forward is a plain convolution with it.
    """

    centred_in_place = False

    def centred_weight(self) -> Tensor:
        return _centred(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        if self.centred_in_place:
            return conv_forward(self, x, self.weight, self.bias)
        # The memory-saving path covers what the networks here use: zero padding given as numbers.
        # Anything else (padding="same", reflect padding, no gradient needed) takes autograd's path.
        if (
            torch.is_grad_enabled()
            and self.weight.requires_grad
            and self.padding_mode == "zeros"
            and not isinstance(self.padding, str)
        ):
            device = x.device.type
            dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
            conf = (list(self.stride), list(self.padding), list(self.dilation), self.groups)
            return _CentredConv2d.apply(x, self.weight, self.bias, conf, dtype)
        return conv_forward(self, x, self.centred_weight(), self.bias)

    @classmethod
    def from_conv(cls, conv: nn.Conv2d) -> CenConv2d:
        """A CenConv2d with the same configuration, sharing ``conv``'s weight and bias tensors."""
        new = conv_like(cls, conv, bias=conv.bias is not None, allocate=False)
        new.weight = conv.weight
        new.bias = conv.bias
        return new


def recentre_(convs: Iterable[nn.Conv2d]) -> None:
    """Centre every conv's stored weight in place, per filter: the per-filter means, then one foreach call."""
    weights = [conv.weight for conv in convs]
    if weights:
        with torch.no_grad():
            foreach_sub_(weights, [_filter_mean(w) for w in weights])


def _kernels(weight: Tensor) -> ModuleType | None:
    """The one-launch re-centring (``cenconv_kernels``) for a CUDA weight, or None: the foreach path."""
    return kernels_for(weight, "cenconv_kernels")


class Recentring:
    """``recentre_`` of a fixed list of convs, called after every optimizer step: on CUDA one Triton launch per
    device and dtype over a table of the weights' addresses. The plan (which weights each launch covers, its table)
    is made again whenever a weight's storage moves (``.to``, a new tensor assigned), so that a launch never writes
    where a weight used to be; a step only compares the addresses."""

    def __init__(self, convs: list[nn.Conv2d]) -> None:
        self.convs = convs
        self._addresses: tuple[int, ...] | None = None
        self._rest: list[nn.Conv2d] = []  # the foreach path's convs
        self._launches: list[tuple[ModuleType, Tensor, Tensor, int, int]] = []  # (kernels, table, like, convs, widest)

    def __call__(self) -> None:
        addresses = tuple(conv.weight.data_ptr() for conv in self.convs)
        if addresses != self._addresses:
            self._plan()
            self._addresses = addresses
        recentre_(self._rest)
        for kernels, table, like, convs, widest in self._launches:
            kernels.recentre(table, like, convs, widest)

    def _plan(self) -> None:
        groups: dict[tuple, list[Tensor]] = {}
        self._rest = []
        for conv in self.convs:
            w = conv.weight
            if _kernels(w) is not None and w.is_contiguous():
                groups.setdefault((w.device, w.dtype), []).append(w)
            else:
                self._rest.append(conv)
        self._launches = []
        for weights in groups.values():
            rows = [(w.data_ptr(), w.shape[0], w[0].numel()) for w in weights]
            table = torch.tensor(rows, dtype=torch.int64).to(weights[0].device)
            widest = max(w.shape[0] for w in weights)
            self._launches.append((_kernels(weights[0]), table, weights[0], len(weights), widest))


class SGDCentring:
    """The handle of ``keep_centred``: ``remove()`` returns the convs to centring in their forward."""

    def __init__(self, convs: list[CenConv2d], hook: Any) -> None:
        self.convs, self._hook = convs, hook

    def remove(self) -> None:
        self._hook.remove()
        for conv in self.convs:
            conv.centred_in_place = False


def keep_centred(model: nn.Module, optimizer: torch.optim.Optimizer) -> SGDCentring | None:
    """Make ``optimizer`` keep ``model``'s CenConv2d weights centred: re-centred in place after each of its steps
    (``Recentring``: one launch on CUDA), their forwards and backwards then plain convolutions. Training is the
    same as with the centring in every forward, at the cost of the plain network; returns the handle whose
    ``remove()`` undoes it.

    Exact for ``torch.optim.SGD`` with any momentum, dampening, Nesterov and weight decay. With P the centring (a
    linear projection), forward centring trains raw weights v on gradients P g; SGD's step (d = g + wd v, buffer
    b = mu b + (1 - dampening) d, direction b or, with Nesterov, d + mu b; v -= lr direction) is linear in (g, v, b),
    so P of it is the same step for (P v, P b) driven by P g: the stored weights w = P v kept here follow it exactly,
    whatever the raw means and the buffers' uncentred parts (which never reach P v). Any other optimizer's update is
    not linear in them (Adam divides by a per-element scale, which P does not commute with): the convs keep
    centring in their forward, one warning says so, and None is returned. None also, silently, when the optimizer
    updates no CenConv2d weight. Clipping gradients in between breaks the equality (the clip would see the
    unprojected gradient's norm); the stages call this only without gradient clipping.

    Centres the weights once now: call it after loading weights, so that a restored model is consistent at once.
    """
    updated = {id(p) for group in optimizer.param_groups for p in group["params"]}
    convs = [m for m in model.modules() if isinstance(m, CenConv2d) and id(m.weight) in updated]
    if not convs:
        return None
    if type(optimizer) is not torch.optim.SGD:
        warnings.warn(
            f"keep_centred: {type(optimizer).__name__} is not torch.optim.SGD, whose update alone commutes with the "
            f"centring; the {len(convs)} CenConv2d layer(s) keep centring their weights in every forward",
            stacklevel=2,
        )
        return None
    recentring = Recentring(convs)
    recentring()
    for conv in convs:
        conv.centred_in_place = True
    hook = optimizer.register_step_post_hook(lambda *_: recentring())
    return SGDCentring(convs, hook)


def conv_like(cls: type[nn.Conv2d], conv: nn.Conv2d, bias: bool, allocate: bool = True) -> nn.Conv2d:
    """A new ``cls`` with ``conv``'s configuration, dtype and device, its parameters not drawn: every caller sets
    them (a ResNet-101's conversion would otherwise draw its 42M weights a second time). ``allocate=False``: on the
    meta device, for a caller that gives it tensors of its own (nothing allocated, nothing moved)."""
    new = cls(
        conv.in_channels,
        conv.out_channels,
        conv.kernel_size,
        stride=conv.stride,
        padding=conv.padding,
        dilation=conv.dilation,
        groups=conv.groups,
        bias=bias,
        padding_mode=conv.padding_mode,
        device="meta",
        dtype=conv.weight.dtype,
    )
    return new.to_empty(device=conv.weight.device) if allocate else new
