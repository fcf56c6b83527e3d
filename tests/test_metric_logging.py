"""Stage 2's validation and test results as the loggers get them: mIoU, mAcc and pixel accuracy in the metrics,
and the per-class IoU and accuracy as a wandb.Table of an offline run, against a numpy reference computed from
the model's own predictions; and what the CSV logger rewrites at the save Lightning makes at every logging step."""

from __future__ import annotations

import csv
import json
import math

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
import yaml

from helpers.trainer import BARE
from helpers.wandb_reader import history, offline_run, wandb_session
from mabn.data.cityscapes import CLASS_NAMES, CityscapesDataModule
from mabn.data.classes import IGNORE_INDEX
from mabn.run.files import file_identity
from mabn.run.loggers import CSVLogger, WandbLogger
from mabn.tasks import SegmentationTask
from mabn.tasks.sliding import sliding_window_logits

NUM_CLASSES = len(CLASS_NAMES)


def _reference(preds: np.ndarray, labels: np.ndarray) -> dict[str, np.ndarray]:
    """Per-class IoU and accuracy (NaN where undefined) from a float64 confusion matrix built here."""
    labelled = labels != IGNORE_INDEX
    confmat = np.zeros((NUM_CLASSES, NUM_CLASSES), dtype=np.float64)
    np.add.at(confmat, (labels[labelled], preds[labelled]), 1)
    true_pos, gt_pixels = np.diag(confmat), confmat.sum(axis=1)
    with np.errstate(invalid="ignore"):
        return {
            "iou": true_pos / (gt_pixels + confmat.sum(axis=0) - true_pos),
            "accuracy": true_pos / gt_pixels,
            "pixel_accuracy": true_pos.sum() / gt_pixels.sum(),
        }


def _table(run, row: dict, key: str) -> dict:
    """The wandb.Table logged as ``key`` in a history ``row``, read from the run's files."""
    assert row[f"{key}._type"] == "table-file"
    return json.loads((run / "files" / row[f"{key}.path"]).read_text())


@pytest.mark.slow  # a stage-2 fit and its test
def test_validation_and_test_log_macc_and_the_per_class_table(tiny_cityscapes, tmp_path, monkeypatch, request):
    wandb_session(request, monkeypatch, "offline")
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)  # random weights whose predictions hold the two kinds of class asserted below
    task = SegmentationTask(norm="bn", arch="resnet18", log_predictions_every_n_epochs=0)
    data = CityscapesDataModule(str(tiny_cityscapes), crop_size=32, val_batch_size=2, num_workers=0)
    wandb_logger = WandbLogger(save_dir=str(tmp_path / "runs"))
    loggers = [CSVLogger(str(tmp_path / "runs")), wandb_logger]
    trainer = pl.Trainer(**{**BARE, "logger": loggers})
    trainer.validate(task, data, verbose=False)
    trainer.test(task, data.val_dataloader(), verbose=False)
    wandb_logger.experiment.finish()

    images, labels = next(iter(data.val_dataloader()))  # the whole split: 2 images, one batch
    task.eval()
    with torch.no_grad():
        preds = sliding_window_logits(task.model, images, NUM_CLASSES, 32).argmax(1)
    expected = _reference(preds.numpy(), labels.numpy())
    present = ~np.isnan(expected["accuracy"])
    # Classes absent from the ground truth but predicted (IoU 0, accuracy undefined) make mAcc's mean differ
    # from one over every class with an IoU.
    assert 1 < present.sum() < (~np.isnan(expected["iou"])).sum()
    macc = np.nanmean(expected["accuracy"])

    with open(tmp_path / "runs" / "metrics.csv", newline="") as file:
        rows = list(csv.DictReader(file))
    for stage in ("val", "test"):
        logged = [row for row in rows if row.get(f"{stage}/macc")]
        assert len(logged) == 1, stage
        assert float(logged[0][f"{stage}/macc"]) == pytest.approx(macc, rel=1e-6)
        assert float(logged[0][f"{stage}/miou"]) == pytest.approx(np.nanmean(expected["iou"]), rel=1e-6)
        assert float(logged[0][f"{stage}/pixel_acc"]) == pytest.approx(expected["pixel_accuracy"], rel=1e-6)

    run = offline_run(tmp_path / "runs")
    for stage in ("val", "test"):
        key = f"{stage}/per_class"
        [row] = [row for row in history(run) if f"{key}._type" in row]
        table = _table(run, row, key)
        assert table["columns"] == ["class", "IoU", "accuracy"]
        assert [r[0] for r in table["data"]] == list(CLASS_NAMES)
        for column, values in (("IoU", expected["iou"]), ("accuracy", expected["accuracy"])):
            logged = [r[table["columns"].index(column)] for r in table["data"]]
            assert [v is None for v in logged] == [math.isnan(v) for v in values], column
            np.testing.assert_allclose(
                [v for v in logged if v is not None], values[~np.isnan(values)], rtol=1e-12, err_msg=column
            )


def test_each_save_rewrites_the_metrics_and_the_hyperparameters_only_once_they_change(tmp_path):
    logger = CSVLogger(str(tmp_path))
    logger.log_hyperparams({"lr": 0.01})
    hparams, metrics = tmp_path / "hparams.yaml", tmp_path / "metrics.csv"
    written = file_identity(hparams)  # a write is a new file renamed onto the name: a new identity
    for step in range(3):
        logger.log_metrics({"loss": 1.0 / (step + 1)}, step=step)
        logger.save()
        assert file_identity(hparams) == written, step
        assert len(list(csv.DictReader(metrics.open()))) == step + 1
    logger.log_hyperparams({"warmup": 3})
    logger.save()
    assert file_identity(hparams) != written
    assert yaml.safe_load(hparams.read_text()) == {"lr": 0.01, "warmup": 3}
