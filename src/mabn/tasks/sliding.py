"""Sliding-window (and optional flip / multi-scale) inference, following hszhao/semseg's ``tool/test.py``."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["sliding_window_logits", "window_starts"]


def window_starts(size: int, crop_size: int, stride: int) -> list[int]:
    """Start offsets of windows covering ``0..size-1``; the last window ends exactly at the border.

    ``size`` must be at least ``crop_size``. As in hszhao/semseg: ``ceil((size - crop) / stride) + 1``
    windows at multiples of ``stride``, each clamped so it stays inside the image.
    """
    count = math.ceil((size - crop_size) / stride) + 1
    return [min(i * stride, size - crop_size) for i in range(count)]


def _window_probs(model_fn: Callable[[Tensor], Tensor], window: Tensor, num_classes: int, flip: bool) -> Tensor:
    """Softmax of one window batch, averaged with that of its horizontal mirror when ``flip``."""
    n = window.shape[0]
    batch = torch.cat([window, window.flip(-1)]) if flip else window
    logits = model_fn(batch)
    expected = (batch.shape[0], num_classes, *batch.shape[-2:])
    if tuple(logits.shape) != expected:
        raise ValueError(f"model_fn returned logits of shape {tuple(logits.shape)}, expected {expected}")
    # float() so that half-precision logits are still averaged in float32.
    probs = logits.float().softmax(dim=1)
    return (probs[:n] + probs[n:].flip(-1)) / 2 if flip else probs


def _slide(
    model_fn: Callable[[Tensor], Tensor], image: Tensor, num_classes: int, crop_size: int, stride: int, flip: bool
) -> Tensor:
    """Window-averaged probabilities (N, C, H, W) of one scale."""
    n, _, h, w = image.shape
    # Pad centred to at least one crop. 0 on the normalized image is the mean pixel, which is hszhao's padding.
    pad_h, pad_w = max(crop_size - h, 0), max(crop_size - w, 0)
    top, left = pad_h // 2, pad_w // 2
    if pad_h or pad_w:
        image = F.pad(image, (left, pad_w - left, top, pad_h - top), value=0.0)
    height, width = image.shape[-2:]
    probs = torch.zeros(n, num_classes, height, width, dtype=torch.float32, device=image.device)
    counts = torch.zeros(1, 1, height, width, dtype=torch.float32, device=image.device)
    for y0 in window_starts(height, crop_size, stride):
        for x0 in window_starts(width, crop_size, stride):
            rows, cols = slice(y0, y0 + crop_size), slice(x0, x0 + crop_size)
            probs[:, :, rows, cols] += _window_probs(model_fn, image[:, :, rows, cols], num_classes, flip)
            counts[:, :, rows, cols] += 1
    return (probs / counts)[:, :, top : top + h, left : left + w]


@torch.no_grad()
def sliding_window_logits(
    model_fn: Callable[[Tensor], Tensor],
    image: Tensor,
    num_classes: int,
    crop_size: int,
    stride: int | None = None,
    flip: bool = False,
    scales: Sequence[float] = (1.0,),
) -> Tensor:
    """Class probabilities (N, num_classes, H, W) of ``image`` (N, 3, H, W) by the hszhao/semseg test protocol.

    For each scale the image is resized (bilinear, align_corners=False) to ``round(scale * H) x
    round(scale * W)``, padded (centred, value 0) to at least ``crop_size``, and covered by ``crop_size``
    windows every ``stride`` pixels (default ``ceil(2/3 * crop_size)``, hszhao's 476 for 713), the last one
    aligned to the border. Softmax probabilities are averaged over the mirrored pair when ``flip``, then
    over overlapping windows; each scale's map is resized back to H x W (bilinear, align_corners=False)
    and the scales are averaged. hszhao scales the long side to ``scale * 2048``, which for full-resolution
    Cityscapes is the same as scaling the image.

    ``model_fn`` maps (n, 3, h, w) to logits (n, num_classes, h, w) at input resolution; it gets the
    window and its mirror as one batch when ``flip``. The result is probabilities, not logits (take
    its argmax for the prediction). One crop-sized image at scale 1 without flip gives exactly
    ``softmax(model_fn(image))``.
    """
    if image.dim() != 4:
        raise ValueError(f"image must be (N, 3, H, W), got shape {tuple(image.shape)}")
    stride = math.ceil(2 * crop_size / 3) if stride is None else stride
    if not 0 < stride <= crop_size:
        raise ValueError(f"stride must be in 1..crop_size={crop_size} so windows cover the image, got {stride}")
    if not scales:
        raise ValueError("scales must not be empty")
    height, width = image.shape[-2:]
    total: Tensor | None = None
    for scale in scales:
        size = (round(scale * height), round(scale * width))
        scaled = image if size == (height, width) else F.interpolate(image, size, mode="bilinear", align_corners=False)
        probs = _slide(model_fn, scaled, num_classes, crop_size, stride, flip)
        if size != (height, width):
            probs = F.interpolate(probs, (height, width), mode="bilinear", align_corners=False)
        total = probs if total is None else total + probs
    return total / len(scales)
