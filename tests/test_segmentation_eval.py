"""Evaluation: SegmentationMetric against the official Cityscapes evaluator and a numpy reference, and
sliding-window inference."""

from __future__ import annotations

import copy
import importlib
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn

from mabn.data.cityscapes import CLASS_NAMES, label_ids_to_train_ids
from mabn.data.classes import IGNORE_INDEX
from mabn.data.synthetic import cityscapes as demo_cityscapes
from mabn.tasks.metrics import SegmentationMetric, format_iou_table
from mabn.tasks.sliding import sliding_window_logits, window_starts


def test_metric_on_a_hand_computed_example() -> None:
    target = torch.tensor([[[0, 0, 1, 1], [1, 2, 255, 2]]])
    preds = torch.tensor([[[0, 1, 1, 1], [1, 0, 2, 255]]])
    metric = SegmentationMetric(num_classes=4)
    metric.update(preds, target)
    out = metric.compute()
    # class 0: tp 1, fn 1 (pred 1), fp 1 (a class-2 pixel) -> 1/3; class 1: tp 3, fp 1 -> 3/4;
    # class 2: tp 0, fn 2 (one predicted 0, one predicted 255; the 2 on the ignored pixel does not count) -> 0;
    # class 3: in neither ground truth nor predictions -> undefined, left out of the mean.
    expected = torch.tensor([1 / 3, 3 / 4, 0.0, math.nan], dtype=torch.float64)
    torch.testing.assert_close(out["per_class_iou"], expected, equal_nan=True)
    assert out["miou"].item() == pytest.approx((1 / 3 + 3 / 4 + 0.0) / 3)
    assert out["pixel_accuracy"].item() == pytest.approx(4 / 7)
    # Accuracy: class 0 1/2, class 1 3/3, class 2 0/2 (the 255 prediction a miss); class 3 undefined.
    expected_acc = torch.tensor([1 / 2, 1.0, 0.0, math.nan], dtype=torch.float64)
    torch.testing.assert_close(out["per_class_accuracy"], expected_acc, equal_nan=True)
    assert out["macc"].item() == pytest.approx((1 / 2 + 1 + 0) / 3)


def _pixels_of(confmat: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """(preds, target) as one row of pixels holding ``confmat[t, p]`` pixels of class t predicted as p."""
    pairs = [(t, p) for (t, p), count in np.ndenumerate(confmat) for _ in range(int(count))]
    target, preds = zip(*pairs)
    return torch.tensor([preds]), torch.tensor([target])


def test_per_class_accuracy_and_macc_match_numpy_on_a_confusion_matrix() -> None:
    # Rows: true class (the last row: ignored pixels); columns: predicted class (the last column: 255, no class).
    # Class 2 is only predicted (accuracy undefined, IoU 0); class 3 is in the ground truth, never predicted.
    confmat = np.array(
        [
            [5, 1, 2, 0, 1],
            [0, 7, 0, 0, 3],
            [0, 0, 0, 0, 0],
            [1, 2, 1, 0, 0],
            [4, 0, 3, 1, 2],
        ],
        dtype=np.float64,
    )
    preds, target = _pixels_of(confmat)
    preds[preds == 4], target[target == 4] = 255, IGNORE_INDEX
    metric = SegmentationMetric(num_classes=4)
    metric.update(preds, target)
    out = metric.compute()

    labelled = confmat[:4]
    with np.errstate(invalid="ignore"):
        accuracy = np.diag(labelled) / labelled.sum(axis=1)
    assert np.isnan(accuracy[2]) and accuracy[3] == 0  # both kinds of class are in the comparison
    np.testing.assert_allclose(out["per_class_accuracy"].numpy(), accuracy, rtol=0, atol=1e-15)
    assert out["macc"].item() == pytest.approx(np.nanmean(accuracy), abs=1e-15)
    assert out["macc"].item() != pytest.approx(out["pixel_accuracy"].item())  # class-weighted, not pixel-weighted
    assert out["per_class_iou"][2].item() == 0.0  # defined for IoU, where accuracy is not


def test_majority_baseline_equals_the_miou_of_predicting_the_majority_class() -> None:
    gen = torch.Generator().manual_seed(2)
    target = torch.randint(0, 5, (3, 16, 16), generator=gen)
    target[0, :8] = 3  # class 3 is the most frequent
    target[1, 0] = 255
    metric = SegmentationMetric(num_classes=19)
    metric.update(torch.randint(0, 19, target.shape, generator=gen), target)
    baseline = metric.compute()["majority_miou"]
    constant = SegmentationMetric(num_classes=19)
    constant.update(torch.full_like(target, 3), target)
    assert baseline.item() == pytest.approx(constant.compute()["miou"].item(), rel=1e-12)


def test_metric_states_add_up_across_processes() -> None:
    # merge_state applies each state's dist_reduce_fx, as the DDP sync does.
    gen = torch.Generator().manual_seed(1)
    target = torch.randint(0, 19, (4, 8, 8), generator=gen)
    target[:, 0] = IGNORE_INDEX
    preds = torch.randint(0, 19, (4, 8, 8), generator=gen)
    whole, rank0, rank1 = SegmentationMetric(), SegmentationMetric(), SegmentationMetric()
    whole.update(preds, target)
    rank0.update(preds[:2], target[:2])
    rank1.update(preds[2:], target[2:])
    rank0.merge_state(rank1)
    assert torch.equal(rank0.confmat, whole.confmat)
    torch.testing.assert_close(rank0.compute()["miou"], whole.compute()["miou"])


def test_metric_rejects_bad_input() -> None:
    metric = SegmentationMetric()
    with pytest.raises(ValueError, match="same shape"):
        metric.update(torch.zeros(1, 2, 2, dtype=torch.long), torch.zeros(1, 2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="outside"):
        metric.update(torch.zeros(1, 2, 2, dtype=torch.long), torch.full((1, 2, 2), 19))
    with pytest.raises(ValueError, match="argmax"):
        metric.update(torch.zeros(1, 2, 2), torch.zeros(1, 2, 2, dtype=torch.long))


def test_format_iou_table() -> None:
    ious, accuracies = torch.tensor([0.5, 0.0, 0.12345]), torch.tensor([0.75, math.nan, 0.2])
    table = format_iou_table(ious, ["road", "wall", "sky"], accuracies)
    assert table.splitlines() == [
        "| class | IoU (%) | accuracy (%) |",
        "|---|---:|---:|",
        "| road | 50.00 | 75.00 |",
        "| wall | 0.00 | n/a |",
        "| sky | 12.35 | 20.00 |",
        "| **mean** | **20.78** | **47.50** |",
    ]
    with pytest.raises(ValueError, match="2 accuracy values for 3 class names"):
        format_iou_table(ious, ["road", "wall", "sky"], accuracies[:2])


def _corrupt_predictions(gt_label_ids: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Prediction labelIds: the ground truth with noise, some ignored ids, and no train/motorcycle/bicycle."""
    from cityscapesscripts.helpers.labels import trainId2label

    train_to_label_id = np.array([trainId2label[t].id for t in range(19)])
    pred = label_ids_to_train_ids(gt_label_ids).astype(np.int64)
    noisy = rng.random(pred.shape) < 0.3
    # Noise from classes 0..15 only: rider etc. get predicted without being in the ground truth (IoU 0),
    # while train (16), motorcycle (17) and bicycle (18) appear in neither (IoU undefined).
    pred[noisy | (pred == IGNORE_INDEX)] = rng.integers(0, 16, pred.shape)[noisy | (pred == IGNORE_INDEX)]
    pred = train_to_label_id[pred]
    # Predicting ignored labelIds (unlabeled 0, parking 9) on labelled pixels: misses for the true class.
    pred[rng.random(pred.shape) < 0.05] = rng.choice([0, 9])
    return pred.astype(np.uint8)


def test_miou_matches_the_official_cityscapes_evaluator(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = demo_cityscapes.generate(tmp_path / "cityscapes", n_train=1, n_val=4, size=(64, 128), seed=3)
    results = tmp_path / "results"
    results.mkdir()
    # The evaluator reads these at import; they keep its defaults away from the repository.
    monkeypatch.setenv("CITYSCAPES_DATASET", str(root))
    monkeypatch.setenv("CITYSCAPES_RESULTS", str(results))
    evaluator = importlib.import_module("cityscapesscripts.evaluation.evalPixelLevelSemanticLabeling")
    args = copy.copy(evaluator.args)
    args.evalInstLevelScore = False  # needs *_gtFine_instanceIds.png
    args.evalPixelAccuracy = False
    args.JSONOutput = False
    args.exportFile = str(tmp_path / "resultPixelLevelSemanticLabeling.json")
    args.quiet = True

    rng = np.random.default_rng(0)
    metric = SegmentationMetric()
    gt_files = sorted((root / "gtFine" / "val").rglob("*_gtFine_labelIds.png"))
    pred_files = []
    for gt_file in gt_files:
        gt = np.asarray(Image.open(gt_file))
        pred = _corrupt_predictions(gt, rng)
        pred_file = results / gt_file.name.replace("_gtFine_labelIds", "_pred")
        Image.fromarray(pred).save(pred_file)
        pred_files.append(str(pred_file))
        metric.update(
            torch.from_numpy(label_ids_to_train_ids(pred)).long()[None],
            torch.from_numpy(label_ids_to_train_ids(gt)).long()[None],
        )
    official = evaluator.evaluateImgLists(pred_files, [str(f) for f in gt_files], args)
    ours = metric.compute()

    official_iou = torch.tensor([official["classScores"][name] for name in CLASS_NAMES], dtype=torch.float64)
    torch.testing.assert_close(ours["per_class_iou"], official_iou, equal_nan=True, rtol=0, atol=1e-12)
    assert ours["miou"].item() == pytest.approx(official["averageScoreClasses"], abs=1e-12)
    undefined = [CLASS_NAMES[i] for i in range(19) if math.isnan(official_iou[i])]
    assert undefined == ["train", "motorcycle", "bicycle"]
    assert (official_iou == 0).any()  # predicted-only classes count, with IoU 0

    # Pixel accuracy from the official confusion matrix (labelIds), over labelled ground-truth rows.
    confmat = np.asarray(official["confMatrix"])
    evaluated = [label.id for label in evaluator.labels if 0 <= label.trainId < 19]
    accuracy = confmat[evaluated, evaluated].sum() / confmat[evaluated].sum()
    assert ours["pixel_accuracy"].item() == pytest.approx(accuracy, abs=1e-12)


def _tiny_model(num_classes: int) -> nn.Module:
    """A conv net whose 5x5 receptive field makes window borders matter; random weights make it asymmetric."""
    return nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(), nn.Conv2d(6, num_classes, 3, padding=1)).eval()


def test_one_window_equals_whole_image_inference() -> None:
    model = _tiny_model(5)
    image = torch.randn(2, 3, 24, 24)
    with torch.no_grad():
        expected = model(image).softmax(dim=1)
    assert torch.equal(sliding_window_logits(model, image, num_classes=5, crop_size=24), expected)


def test_two_overlapping_windows_are_averaged() -> None:
    model = _tiny_model(4)
    image = torch.randn(1, 3, 24, 40)
    # crop 24, stride 16: windows at columns 0..23 and 16..39, overlapping on 16..23.
    result = sliding_window_logits(model, image, num_classes=4, crop_size=24, stride=16)
    with torch.no_grad():
        left = model(image[..., 0:24]).softmax(dim=1)
        right = model(image[..., 16:40]).softmax(dim=1)
    expected = torch.cat([left[..., :16], (left[..., 16:] + right[..., :8]) / 2, right[..., 8:]], dim=-1)
    torch.testing.assert_close(result, expected)
    with torch.no_grad():
        whole = model(image).softmax(dim=1)
    assert not torch.allclose(result, whole, atol=1e-4)  # the windows really were run separately


def test_flip_padding_and_scales() -> None:
    model = _tiny_model(3)
    image = torch.randn(1, 3, 16, 16)
    with torch.no_grad():
        plain = model(image).softmax(dim=1)
        mirrored = model(image.flip(-1)).softmax(dim=1).flip(-1)
        # Scale 0.5: an 8x8 image padded (centred, zeros) to the 16 crop, cut out and resized back.
        small = F.interpolate(image, (8, 8), mode="bilinear", align_corners=False)
        half = model(F.pad(small, (4, 4, 4, 4))).softmax(dim=1)[..., 4:12, 4:12]
    half = F.interpolate(half, (16, 16), mode="bilinear", align_corners=False)
    flipped = sliding_window_logits(model, image, num_classes=3, crop_size=16, flip=True)
    torch.testing.assert_close(flipped, (plain + mirrored) / 2)
    multi = sliding_window_logits(model, image, num_classes=3, crop_size=16, scales=(0.5, 1.0))
    torch.testing.assert_close(multi, (half + plain) / 2)


@pytest.mark.parametrize(
    ("size", "crop", "stride"), [(24, 24, 16), (40, 24, 16), (41, 10, 7), (100, 33, 1), (1024, 713, 476)]
)
def test_windows_cover_the_image_and_end_at_the_border(size: int, crop: int, stride: int) -> None:
    starts = window_starts(size, crop, stride)
    assert starts[0] == 0 and starts[-1] == size - crop
    assert all(0 < b - a <= stride for a, b in zip(starts, starts[1:]))
    covered = np.zeros(size, bool)
    for s in starts:
        covered[s : s + crop] = True
    assert covered.all()


def test_default_stride_is_two_thirds_of_the_crop_rounded_up() -> None:
    # hszhao/semseg on 1024x2048 Cityscapes: crop 713, stride 476, 2 x 4 windows.
    assert window_starts(1024, 713, 476) == [0, 311] and len(window_starts(2048, 713, 476)) == 4
    calls = []

    def model_fn(x: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[-1])
        return torch.zeros(x.shape[0], 2, *x.shape[-2:])

    # crop 10: stride ceil(6.67) = 7 gives 3 windows over 24 columns; stride 6 would give 4.
    sliding_window_logits(model_fn, torch.zeros(1, 3, 10, 24), num_classes=2, crop_size=10)
    assert len(calls) == 3


def test_sliding_window_rejects_bad_arguments() -> None:
    image = torch.zeros(1, 3, 8, 8)
    with pytest.raises(ValueError, match="logits of shape"):
        sliding_window_logits(lambda x: torch.zeros(x.shape[0], 2, 4, 4), image, num_classes=2, crop_size=8)
    with pytest.raises(ValueError, match="stride"):
        sliding_window_logits(_tiny_model(2), image, num_classes=2, crop_size=4, stride=5)
