"""Stage 2's training augmentation, the recipe's (``train_transform``)."""

from __future__ import annotations

import albumentations as A
import cv2

from .classes import IGNORE_INDEX
from .images import (
    IMAGENET_MEAN,
)

# Padding the uint8 image with the mean pixel makes padded areas exactly 0 after normalization (as hszhao pads).
MEAN_PIXEL = tuple(255.0 * m for m in IMAGENET_MEAN)


def train_transform(
    crop_size: int = 713,
    scale_range: tuple[float, float] = (0.5, 2.0),
    rotate_limit: float = 10.0,
    blur_p: float = 0.5,
    seed: int | None = None,
) -> A.Compose:
    """The hszhao/semseg PSPNet training augmentation (before normalization), in its order.

    Random scale in ``scale_range`` (image bilinear, mask nearest) -> rotation within +-``rotate_limit``
    degrees with p 0.5 (image padded with the mean pixel, mask with 255) -> 5x5 Gaussian blur with p
    ``blur_p`` -> horizontal flip -> centred pad to ``crop_size`` (mean / 255) -> random ``crop_size`` crop.

    The default crop is the paper's (and hszhao's) 713: PSPNet takes any input size (its encoder at output
    stride 8 gives 90x90 features for 713, and both heads upsample to the input size).
    """
    low, high = scale_range
    return A.Compose(
        [
            # RandomScale samples from 1 + scale_limit.
            A.RandomScale(
                scale_limit=(low - 1.0, high - 1.0),
                interpolation=cv2.INTER_LINEAR,
                mask_interpolation=cv2.INTER_NEAREST,
                p=1.0,
            ),
            A.Rotate(
                limit=(-rotate_limit, rotate_limit),
                interpolation=cv2.INTER_LINEAR,
                mask_interpolation=cv2.INTER_NEAREST,
                border_mode=cv2.BORDER_CONSTANT,
                fill=MEAN_PIXEL,
                fill_mask=IGNORE_INDEX,
                p=0.5,
            ),
            # hszhao calls cv2.GaussianBlur(img, (5, 5), 0); OpenCV derives sigma 1.1 for a 5-tap kernel.
            A.GaussianBlur(blur_limit=(5, 5), sigma_limit=(1.1, 1.1), p=blur_p),
            A.HorizontalFlip(p=0.5),
            A.PadIfNeeded(
                min_height=crop_size,
                min_width=crop_size,
                position="center",
                border_mode=cv2.BORDER_CONSTANT,
                fill=MEAN_PIXEL,
                fill_mask=IGNORE_INDEX,
            ),
            A.RandomCrop(height=crop_size, width=crop_size),
        ],
        seed=seed,
    )
