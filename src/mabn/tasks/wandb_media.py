"""What a segmentation task shows on wandb: its validation images with their predicted and true classes as mask
layers, and its per-class table; the loggers that take them now."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from pytorch_lightning import LightningModule
from pytorch_lightning.loggers import WandbLogger

from ..data.classes import IGNORE_INDEX
from ..data.images import IMAGENET_MEAN, IMAGENET_STD

# Logged images wider than this are subsampled by an integer stride: a full Cityscapes frame (2048 px) and
# its two masks would add megabytes to the run at every logged validation.
DISPLAY_WIDTH = 1024
# wandb stores masks as 8-bit images: the class ids and the "ignore" id after them must fit in 0..255.
MAX_MASK_CLASSES = 255


CLASS_TABLE_COLUMNS = ("class", "IoU", "accuracy")


def class_table_rows(
    class_names: Sequence[str], per_class_iou: torch.Tensor, per_class_accuracy: torch.Tensor
) -> list[list[str | float | None]]:
    """The rows of the per-class table logged to wandb (``CLASS_TABLE_COLUMNS``): a class's name, IoU and accuracy
    as fractions, None where undefined (wandb stores tables as JSON, which has no NaN)."""
    return [
        [name, *(None if math.isnan(value) else value for value in values)]
        for name, *values in zip(class_names, per_class_iou.tolist(), per_class_accuracy.tolist())
    ]


def wandb_loggers(task: LightningModule) -> list[WandbLogger]:
    """The trainer's WandbLoggers that take images and tables now: on rank 0 (the process that holds the wandb
    run) and outside the sanity check (a few batches, no result of the run)."""
    if task.trainer.sanity_checking or not task.trainer.is_global_zero:
        return []
    return [logger for logger in task.loggers if isinstance(logger, WandbLogger)]


def log_predictions(
    task: LightningModule, images: torch.Tensor, preds: torch.Tensor, labels: torch.Tensor, names: Sequence[str]
) -> None:
    """The batch's images with their predicted and true classes (of ``names``) as wandb masks."""
    import wandb  # only reached with a WandbLogger, which has imported it already

    samples = [
        wandb.Image(
            display_image(image),
            masks=prediction_masks(pred, label, names),
            caption=f"val image {i}, step {task.global_step}",
        )
        for i, (image, pred, label) in enumerate(zip(images, preds, labels))
    ]
    for logger in wandb_loggers(task):
        logger.log_metrics({"val/predictions": samples}, step=task.global_step)


def log_class_table(
    task: LightningModule, stage: str, result: Mapping[str, torch.Tensor], names: Sequence[str]
) -> None:
    """A ``SegmentationMetric`` result's per-class table as ``<stage>/per_class``, where a WandbLogger takes it."""
    loggers = wandb_loggers(task)
    if not loggers:
        return
    import wandb  # only reached with a WandbLogger, which has imported it already

    rows = class_table_rows(names, result["per_class_iou"], result["per_class_accuracy"])
    table = wandb.Table(columns=list(CLASS_TABLE_COLUMNS), data=rows)
    for logger in loggers:
        logger.log_metrics({f"{stage}/per_class": table}, step=task.global_step)


def _display_stride(width: int) -> int:
    return max(1, math.ceil(width / DISPLAY_WIDTH))


def display_image(image: torch.Tensor) -> np.ndarray:
    """A normalized 3xHxW image as HxWx3 uint8 RGB for display: the data's ImageNet mean/std undone."""
    if image.ndim != 3 or image.shape[0] != 3:
        raise ValueError(f"expected a 3xHxW image, got shape {tuple(image.shape)}")
    stride = _display_stride(image.shape[-1])
    mean = torch.tensor(IMAGENET_MEAN, dtype=torch.float32, device=image.device).view(3, 1, 1)
    std = torch.tensor(IMAGENET_STD, dtype=torch.float32, device=image.device).view(3, 1, 1)
    pixels = (image[:, ::stride, ::stride].float() * std + mean) * 255.0
    return pixels.round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0).cpu().numpy()


def prediction_masks(
    prediction: torch.Tensor, label: torch.Tensor, class_names: Sequence[str]
) -> dict[str, dict[str, Any]]:
    """The wandb mask layers ``prediction`` and ``ground_truth`` of one HxW image, as uint8 class ids.

    Ignored pixels (``IGNORE_INDEX``, 255) of the label become the id ``len(class_names)``, labelled
    "ignore", so they stay visible and distinct from every class; both layers share one class-label map,
    so a class has the same colour in each. Subsampled like ``display_image`` to stay aligned with it.
    """
    n = len(class_names)
    if n > MAX_MASK_CLASSES:
        raise ValueError(f"{n} classes: prediction masks hold at most {MAX_MASK_CLASSES}")
    if prediction.shape != label.shape or prediction.ndim != 2:
        raise ValueError(f"prediction {tuple(prediction.shape)} and label {tuple(label.shape)} must be one HxW")
    stride = _display_stride(label.shape[-1])
    truth = label[::stride, ::stride].clone()
    truth[truth == IGNORE_INDEX] = n
    class_labels = {i: str(name) for i, name in enumerate(class_names)} | {n: "ignore"}
    return {
        "prediction": {
            "mask_data": prediction[::stride, ::stride].to(torch.uint8).cpu().numpy(),
            "class_labels": class_labels,
        },
        "ground_truth": {"mask_data": truth.to(torch.uint8).cpu().numpy(), "class_labels": class_labels},
    }
