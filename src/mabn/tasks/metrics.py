"""Cityscapes-style semantic segmentation metrics: dataset-level confusion matrix, per-class IoU and accuracy, and
their means (mIoU, mAcc)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor
from torchmetrics import Metric

__all__ = ["SegmentationMetric", "format_iou_table"]


class SegmentationMetric(Metric):
    """Confusion matrix over a whole split, giving IoU exactly as the official Cityscapes evaluator does.

    ``update(preds, target)`` takes class indices of the same shape, e.g. (N, H, W). Target pixels equal to
    ``ignore_index`` are dropped, so predictions there never count. A prediction outside ``0..num_classes-1``
    (e.g. 255) on a labelled pixel is a miss for the true class but a false positive for none, as when a
    prediction PNG holds an ignored labelId in ``evalPixelLevelSemanticLabeling``.

    ``compute()`` returns ``miou`` (mean over the classes with a defined IoU), ``per_class_iou`` (NaN for a
    class that appears in neither the labelled ground truth nor the predictions on it: the official
    evaluator skips such classes in its average), ``per_class_accuracy`` (a class's correct pixels / its
    labelled pixels, a miss as above included; NaN for a class absent from the labelled ground truth, whose
    accuracy is undefined even where it is predicted), ``macc`` (the mean over the classes of the ground truth),
    ``pixel_accuracy`` (correct / labelled pixels) and ``majority_miou``, as float64 tensors. The states are
    summed across processes, so the result under DDP is that of the whole split.
    """

    is_differentiable = False
    higher_is_better = True
    full_state_update = False

    confmat: Tensor
    missed: Tensor

    def __init__(self, num_classes: int = 19, ignore_index: int = 255, **kwargs) -> None:
        super().__init__(**kwargs)
        self.num_classes = num_classes
        self.ignore_index = ignore_index
        # confmat[t, p]: labelled pixels of class t predicted as class p.
        self.add_state("confmat", default=torch.zeros(num_classes, num_classes, dtype=torch.long), dist_reduce_fx="sum")
        # missed[t]: labelled pixels of class t predicted as no valid class.
        self.add_state("missed", default=torch.zeros(num_classes, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, preds: Tensor, target: Tensor) -> None:
        """Accumulate one batch of predicted and ground-truth class indices."""
        if preds.shape != target.shape:
            raise ValueError(f"preds {tuple(preds.shape)} and target {tuple(target.shape)} must have the same shape")
        if preds.is_floating_point() or target.is_floating_point():
            raise ValueError("preds and target must be integer class indices (take the argmax of the logits first)")
        preds, target = preds.reshape(-1).long(), target.reshape(-1).long()
        labelled = target != self.ignore_index
        preds, target = preds[labelled], target[labelled]
        if ((target < 0) | (target >= self.num_classes)).any():
            bad = target[(target < 0) | (target >= self.num_classes)].unique()[:5].tolist()
            raise ValueError(
                f"target holds values {bad} outside 0..{self.num_classes - 1} and the ignore index {self.ignore_index}"
            )
        valid = (preds >= 0) & (preds < self.num_classes)
        pairs = target[valid] * self.num_classes + preds[valid]
        self.confmat += torch.bincount(pairs, minlength=self.num_classes**2).reshape(self.num_classes, -1)
        self.missed += torch.bincount(target[~valid], minlength=self.num_classes)

    def compute(self) -> dict[str, Tensor]:
        confmat = self.confmat.double()
        true_pos = confmat.diagonal()
        gt_pixels = confmat.sum(dim=1) + self.missed
        union = gt_pixels + confmat.sum(dim=0) - true_pos
        per_class_iou = _ratio(true_pos, union)
        per_class_accuracy = _ratio(true_pos, gt_pixels)
        # The floor a model must beat: predicting the most frequent class everywhere scores IoU =
        # its pixel share on that class and 0 on every other class present in the ground truth.
        majority_miou = (gt_pixels.max() / gt_pixels.sum()) / (gt_pixels > 0).sum()
        return {
            "miou": per_class_iou.nanmean(),
            "per_class_iou": per_class_iou,
            "macc": per_class_accuracy.nanmean(),
            "per_class_accuracy": per_class_accuracy,
            "pixel_accuracy": true_pos.sum() / gt_pixels.sum(),
            "majority_miou": majority_miou,
        }


def _ratio(numerator: Tensor, denominator: Tensor) -> Tensor:
    """``numerator / denominator`` per class, NaN where the denominator is 0 (a class with nothing to score)."""
    return torch.where(denominator > 0, numerator / denominator.clamp(min=1), torch.full_like(numerator, math.nan))


def _percent(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{100 * value:.2f}"


def format_iou_table(
    per_class_iou: Tensor | Sequence[float], class_names: Sequence[str], per_class_accuracy: Tensor | Sequence[float]
) -> str:
    """A markdown table of per-class IoU and accuracy in percent (2 decimals), ``n/a`` for undefined values, then
    their means over the defined ones (mIoU, mAcc) in bold."""
    ious = torch.as_tensor(per_class_iou, dtype=torch.float64).cpu()
    accuracies = torch.as_tensor(per_class_accuracy, dtype=torch.float64).cpu()
    if not len(ious) == len(accuracies) == len(class_names):
        raise ValueError(f"{len(ious)} IoU and {len(accuracies)} accuracy values for {len(class_names)} class names")
    rows = ["| class | IoU (%) | accuracy (%) |", "|---|---:|---:|"]
    rows += [
        f"| {name} | {_percent(iou)} | {_percent(acc)} |"
        for name, iou, acc in zip(class_names, ious.tolist(), accuracies.tolist())
    ]
    rows.append(f"| **mean** | **{_percent(ious.nanmean().item())}** | **{_percent(accuracies.nanmean().item())}** |")
    return "\n".join(rows)
