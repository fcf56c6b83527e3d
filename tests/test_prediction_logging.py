"""Sample predictions as wandb masks: display image and mask layers, the N-th-validation cadence, real runs."""

from __future__ import annotations

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from PIL import Image

from helpers.marks import default_suite_runs
from helpers.trainer import BARE
from helpers.wandb_reader import history, offline_run, wandb_session
from mabn.data.cityscapes import CLASS_NAMES, CityscapesDataModule
from mabn.data.classes import IGNORE_INDEX
from mabn.data.images import IMAGENET_MEAN, IMAGENET_STD
from mabn.run.loggers import WandbLogger
from mabn.tasks import SegmentationTask
from mabn.tasks.sliding import sliding_window_logits
from mabn.tasks.wandb_media import display_image, prediction_masks

ARCH = "resnet18"  # what is logged does not depend on the encoder's depth


def _normalize(rgb: np.ndarray) -> torch.Tensor:
    """HxWx3 uint8 -> 3xHxW float32 as the data pipeline feeds the model."""
    x = torch.from_numpy(rgb).permute(2, 0, 1).float() / 255.0
    return (x - torch.tensor(IMAGENET_MEAN).view(3, 1, 1)) / torch.tensor(IMAGENET_STD).view(3, 1, 1)


# 1. What one logged sample holds


def test_display_image_undoes_the_normalization():
    rgb = np.random.default_rng(0).integers(0, 256, size=(6, 10, 3), dtype=np.uint8)
    shown = display_image(_normalize(rgb))
    assert shown.dtype == np.uint8 and np.array_equal(shown, rgb)


def test_masks_hold_prediction_and_label_ids_with_ignore_after_the_classes():
    gen = torch.Generator().manual_seed(0)
    pred = torch.randint(0, 19, (6, 10), generator=gen)
    label = torch.randint(0, 19, (6, 10), generator=gen)
    label[0, :4] = IGNORE_INDEX
    masks = prediction_masks(pred, label, CLASS_NAMES)
    assert set(masks) == {"prediction", "ground_truth"}
    assert np.array_equal(masks["prediction"]["mask_data"], pred.numpy())
    expected = label.clone()
    expected[0, :4] = 19
    assert np.array_equal(masks["ground_truth"]["mask_data"], expected.numpy())
    labels = masks["ground_truth"]["class_labels"]
    assert labels == masks["prediction"]["class_labels"]
    assert labels[0] == "road" and labels[18] == "bicycle" and labels[19] == "ignore" and len(labels) == 20


def test_wide_frames_are_subsampled_in_step_for_image_and_masks():
    rgb = np.random.default_rng(1).integers(0, 256, size=(8, 2050, 3), dtype=np.uint8)  # > 2 x 1024: stride 3
    label = torch.from_numpy(np.random.default_rng(2).integers(0, 19, size=(8, 2050)))
    shown = display_image(_normalize(rgb))
    masks = prediction_masks(label, label, CLASS_NAMES)
    assert np.array_equal(shown, rgb[::3, ::3])
    assert np.array_equal(masks["ground_truth"]["mask_data"], label.numpy()[::3, ::3])


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="3xHxW"):
        display_image(torch.zeros(1, 4, 4))
    with pytest.raises(ValueError, match="HxW"):
        prediction_masks(torch.zeros(4, 4), torch.zeros(4, 5), CLASS_NAMES)
    with pytest.raises(ValueError, match="num_logged_predictions"):
        SegmentationTask(norm="bn", num_logged_predictions=-1)


# 2. When samples are logged


class _Capture(WandbLogger):
    """A WandbLogger (run disabled) that keeps what the task logs, with the validation it came from."""

    def __init__(self):
        super().__init__(mode="disabled")
        self.logged: list[tuple[int, list]] = []  # (global step, wandb images)

    def log_metrics(self, metrics, step=None):
        if "val/predictions" in metrics:
            self.logged.append((step, metrics["val/predictions"]))
        super().log_metrics(metrics, step)


@pytest.mark.parametrize(
    ("every", "expected"), default_suite_runs([(2, [0, 2]), (1, [0, 1, 2]), (0, [])], keep=[(2, [0, 2])])
)
def test_every_nth_validation_logs_when_wandb_is_disabled(
    tiny_cityscapes, tmp_path, monkeypatch, request, every, expected
):
    wandb_session(request, monkeypatch, "disabled")
    monkeypatch.chdir(tmp_path)
    task = SegmentationTask(norm="bn", log_predictions_every_n_epochs=every, num_logged_predictions=2, arch=ARCH)
    data = CityscapesDataModule(str(tiny_cityscapes), crop_size=32, val_batch_size=2, num_workers=0)
    logger = _Capture()
    trainer = pl.Trainer(**{**BARE, "logger": [pl.loggers.CSVLogger(tmp_path), logger]})
    logged_at = []  # the validations (0-based) that logged samples
    for i in range(3):
        before = len(logger.logged)
        trainer.validate(task, data, verbose=False)
        logged_at += [i] * (len(logger.logged) - before)
    assert task.validations_done == 3
    assert logged_at == expected
    for _, images in logger.logged:
        assert len(images) == 2 and all(img._masks.keys() == {"prediction", "ground_truth"} for img in images)


@pytest.mark.slow  # a stage-2 fit
def test_fit_logs_masks_of_the_first_val_images_to_an_offline_run(tiny_cityscapes, tmp_path, monkeypatch, request):
    """A real offline run: the history (read by wandb's own reader) has the samples of validations 1 and 3,
    not of the sanity check, and the stored masks are the labels and the final model's predictions."""
    wandb_session(request, monkeypatch, "offline")
    monkeypatch.chdir(tmp_path)
    task = SegmentationTask(
        norm="bn", log_predictions_every_n_epochs=2, num_logged_predictions=2, warmup_epochs=1, arch=ARCH
    )
    data = CityscapesDataModule(
        str(tiny_cityscapes), crop_size=32, global_batch_size=2, val_batch_size=2, num_workers=0
    )
    logger = WandbLogger(save_dir=str(tmp_path / "runs"))
    steps: list[int] = []  # global step at each validation
    record = pl.callbacks.LambdaCallback(
        on_validation_epoch_end=lambda trainer, module: steps.append(trainer.global_step)
    )
    trainer = pl.Trainer(max_epochs=3, callbacks=[record], num_sanity_val_steps=1, **{**BARE, "logger": logger})
    trainer.fit(task, data)
    logger.experiment.finish()

    assert len(steps) == 4  # the sanity check and three epochs
    run = offline_run(tmp_path / "runs")
    logged = [row for row in history(run) if "val/predictions._type" in row]
    assert [row["trainer/global_step"] for row in logged] == [steps[1], steps[3]]

    images, labels = next(iter(data.val_dataloader()))
    task.eval()
    with torch.no_grad():
        preds = sliding_window_logits(task.model, images, 19, 32).argmax(1)  # the last validation's predictions
    for row in logged:
        masks = row["val/predictions.all_masks"]
        assert row["val/predictions.count"] == 2 and len(masks) == 2
        for i, layers in enumerate(masks):
            truth = np.array(Image.open(run / "files" / layers["ground_truth"]["path"]))
            expected = labels[i].numpy().copy()
            expected[expected == IGNORE_INDEX] = 19
            assert np.array_equal(truth, expected)
            predicted = np.array(Image.open(run / "files" / layers["prediction"]["path"]))
            assert predicted.shape == expected.shape and predicted.max() < 19
    for i, layers in enumerate(logged[-1]["val/predictions.all_masks"]):
        predicted = np.array(Image.open(run / "files" / layers["prediction"]["path"]))
        assert np.array_equal(predicted, preds[i].numpy())
