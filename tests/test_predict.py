"""python -m mabn test|predict on a short stage-2 fit: the PNGs predict writes, scored by cityscapesscripts'
own evaluator, give test's mIoU; output folders of another run are never written into."""

from __future__ import annotations

import copy
import importlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import mabn
from helpers.commands import run_mabn
from helpers.fits import copy_run
from mabn.cli.commands import test as evaluate
from mabn.data import cityscapes
from mabn.data.cityscapes import CLASS_NAMES
from mabn.inference import predict


@pytest.fixture(scope="session")
def fitted(stage2_run, tmp_path_factory) -> tuple[Path, Path]:
    """(data root, last checkpoint) of the session's ``stage2_run`` (a 2-step MABN fit of a PSPNet on ResNet-18 at
    crop 32 on a tiny demo set of 32x64 images), the run in a folder of this module's, which predict writes into:
    test and predict rebuild whatever arch the checkpoint names and score it the same way."""
    folder = copy_run(stage2_run.folder, tmp_path_factory.mktemp("predict") / "run")
    return stage2_run.data, folder / "checkpoints" / "last.ckpt"


def _run(command: str, argv: list[str], capsys) -> tuple[int, str, list[str]]:
    """Exit code, stdout and stderr lines of ``python -m mabn <command> <argv>``."""
    code, out, err = run_mabn([command, *argv], capsys)
    return code, out, err.strip().splitlines()


def _official(results: Path, data: Path, monkeypatch, tmp_path: Path) -> dict:
    """cityscapesscripts' evalPixelLevelSemanticLabeling over the val ground truth and the PNGs in ``results``."""
    monkeypatch.setenv("CITYSCAPES_DATASET", str(data))
    monkeypatch.setenv("CITYSCAPES_RESULTS", str(results))
    evaluator = importlib.import_module("cityscapesscripts.evaluation.evalPixelLevelSemanticLabeling")
    args = copy.copy(evaluator.args)
    args.predictionPath, args.predictionWalk = str(results), None
    args.evalInstLevelScore = False  # needs *_gtFine_instanceIds.png
    args.evalPixelAccuracy, args.JSONOutput, args.quiet = False, False, True
    args.exportFile = str(tmp_path / "official.json")
    gt = sorted(str(p) for p in (data / "gtFine" / "val").rglob("*_gtFine_labelIds.png"))
    preds = [evaluator.getPrediction(args, g) for g in gt]
    return evaluator.evaluateImgLists(preds, gt, args)


@pytest.mark.slow  # the official evaluator over predict's PNGs
def test_official_evaluator_on_predict_pngs_gives_the_miou_of_test(fitted, tmp_path, monkeypatch, capsys):
    data, ckpt = fitted
    monkeypatch.chdir(tmp_path)
    options = [str(ckpt), "--num-workers", "0", "--flip"]
    code, out, err = _run("test", options, capsys)
    assert code == 0, err
    assert "| class | IoU (%) | accuracy (%) |" in out
    assert "crop 32, flip True, scales [1.0]" in out  # the checkpoint's crop and scales, flip asked for
    assert not list(tmp_path.iterdir())  # test writes nothing
    result = evaluate.run_test(evaluate.parser().parse_args(options))  # the same run, for its float64 numbers
    assert f"| **mean** | **{100 * result['miou'].item():.2f}** | **{100 * result['macc'].item():.2f}** |" in out

    code, out, err = _run("predict", [*options, "--overlay"], capsys)
    assert code == 0, err
    folder = ckpt.parent.parent / "predictions" / f"{ckpt.stem}-val"
    frames = sorted(p.name[: -len("_gtFine_labelIds.png")] for p in (data / "gtFine" / "val").rglob("*labelIds.png"))
    for part, suffix in (("labelIds", "labelIds"), ("color", "color"), ("overlay", "overlay")):
        assert sorted(p.name for p in (folder / part).iterdir()) == [f"{f}_{suffix}.png" for f in frames], part
    manifest = json.loads((folder / predict.MANIFEST).read_text())
    assert manifest["checkpoint"] == str(ckpt.resolve()) and manifest["crop"] == 32 and manifest["flip"] is True

    official = _official(folder / "labelIds", data, monkeypatch, tmp_path)
    official_iou = torch.tensor([official["classScores"][name] for name in CLASS_NAMES], dtype=torch.float64)
    # Like for like: classes in neither the ground truth nor the predictions are n/a (NaN) in both, and both
    # average over the others.
    torch.testing.assert_close(result["per_class_iou"], official_iou, equal_nan=True, rtol=0, atol=1e-6)
    assert result["miou"].item() == pytest.approx(official["averageScoreClasses"], abs=1e-6)
    # The comparison covers both kinds of class: n/a ones left out of the mean, and scored ones.
    assert official_iou.isnan().any() and (official_iou > 0).any() and 0 < result["miou"].item() < 1

    # The PNGs hold labelIds (road is 7, not its trainId 0) and the Cityscapes colours.
    label_ids = np.asarray(Image.open(folder / "labelIds" / f"{frames[0]}_labelIds.png"))
    colors = np.asarray(Image.open(folder / "color" / f"{frames[0]}_color.png"))
    assert set(np.unique(label_ids)) <= set(cityscapes.TRAIN_TO_LABEL_ID.tolist())
    for label_id in np.unique(label_ids):
        train_id = cityscapes.TRAIN_TO_LABEL_ID.tolist().index(label_id)
        assert (colors[label_ids == label_id] == cityscapes.TRAIN_ID_COLORS[train_id]).all()


def test_label_id_and_colour_tables_follow_cityscapes():
    # The 19 evaluated classes' labelIds in trainId order (cityscapesscripts' labels table).
    label_ids = [7, 8, 11, 12, 13, 17, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 31, 32, 33]  # fmt: skip
    assert cityscapes.TRAIN_TO_LABEL_ID.tolist() == label_ids
    assert cityscapes.TRAIN_ID_COLORS[0].tolist() == [128, 64, 128]  # road
    assert cityscapes.TRAIN_ID_COLORS[13].tolist() == [0, 0, 142]  # car
    assert (
        cityscapes.CityscapesDataset.frame_name(Path("x/aachen_000000_000019_leftImg8bit.png"))
        == "aachen_000000_000019"
    )
    assert cityscapes.CityscapesDataset.frame_name(Path("x/street.jpg")) == "street"


def test_predict_never_writes_into_another_runs_folder(fitted, tmp_path, monkeypatch, capsys):
    data, ckpt = fitted
    monkeypatch.chdir(tmp_path)
    images = tmp_path / "images"
    images.mkdir()
    frame = next((data / "leftImg8bit" / "val").rglob("*.png"))
    (images / "street.png").write_bytes(frame.read_bytes())
    out = tmp_path / "out"
    out.mkdir()
    mine = out / "notes.txt"
    mine.write_text("a user's file")
    argv = [str(ckpt), "--images", str(images), "--out", str(out), "--num-workers", "0"]
    code, _, err = _run("predict", argv, capsys)
    assert code == 2 and len(err) == 1, err
    assert (
        err[0].startswith(f"error: {out} already holds files of another run (no predict.json)")
        and "--overwrite" in err[0]
    )
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"] and mine.read_text() == "a user's file"

    fresh = tmp_path / "fresh"
    argv[argv.index(str(out))] = str(fresh)
    assert _run("predict", argv, capsys)[0] == 0
    written = (fresh / "labelIds" / "street_labelIds.png").stat().st_mtime_ns
    assert _run("predict", argv, capsys)[0] == 0  # the same run again continues in its folder
    assert (fresh / "labelIds" / "street_labelIds.png").stat().st_mtime_ns >= written
    code, _, err = _run("predict", [*argv, "--flip"], capsys)  # other options: another run
    assert code == 2 and "checkpoint " in err[0]
    assert _run("predict", [*argv, "--flip", "--overwrite"], capsys)[0] == 0
    assert json.loads((fresh / predict.MANIFEST).read_text())["flip"] is True
    assert not list(fresh.rglob("*.tmp"))


def test_test_refuses_a_checkpoint_of_stage_1(tmp_path, capsys):
    path = tmp_path / "stage1.ckpt"
    torch.save({"state_dict": {}, "hyper_parameters": {"_class_path": "mabn.tasks.ClassificationTask"}}, path)
    code, _, err = _run("test", [str(path)], capsys)
    assert code == 2 and err == [
        f"error: {path} is not a stage-2 checkpoint (mabn.tasks.ClassificationTask); "
        "expected mabn.tasks.segmentation.SegmentationTask"
    ]


def test_test_refuses_a_stage_2_checkpoint_whose_weights_do_not_fit_in_one_line(tmp_path, capsys):
    path = tmp_path / "mismatch.ckpt"
    hparams = {"_class_path": "mabn.tasks.SegmentationTask", "norm": "bn", "num_classes": 3, "eval_scales": (1.0,)}
    state = {"model.classifier.2.weight": torch.zeros(5, 512, 1, 1)}  # 5 classes, where the arguments say 3
    torch.save({"state_dict": state, "hyper_parameters": hparams}, path)
    code, _, err = _run("test", [str(path)], capsys)
    assert code == 2 and len(err) == 1, err[-5:]
    assert err[0].startswith(f"error: {path} does not fit the SegmentationTask its hyper_parameters describe: "), err
    assert "1 mis-shaped key(s) (e.g. classifier.2.weight)" in err[0] and "missing key(s)" in err[0]


def test_load_predicts_a_batch_as_each_image_alone_with_probabilities(fitted):
    """``Segmenter.predict`` of a list, or of an N x H x W x 3 array, gives each image's class map and probabilities
    as a call for that image alone does; the probabilities sum to 1 over the classes and their argmax is the map.
    The segmenter comes from ``mabn.load``, the package's one-line entry point."""
    data, ckpt = fitted
    segmenter = mabn.load(ckpt, device="cpu")
    assert isinstance(segmenter, predict.Segmenter) and mabn.load is predict.load and not hasattr(mabn, "lode")
    frames = sorted((data / "leftImg8bit" / "val").rglob("*.png"))[:2]
    images = [np.asarray(Image.open(frame).convert("RGB")) for frame in frames]
    alone = [segmenter.predict(image, probs=True) for image in images]
    assert alone[0][0].shape == images[0].shape[:2] and alone[0][1].shape == (len(CLASS_NAMES), *images[0].shape[:2])
    np.testing.assert_array_equal(segmenter.predict(frames[0]), alone[0][0])  # one image: its map, as before

    maps, probs = segmenter.predict(images, probs=True)
    assert isinstance(maps, list) and len(maps) == len(probs) == 2
    for (one_map, one_probs), batch_map, batch_probs in zip(alone, maps, probs):
        np.testing.assert_array_equal(batch_map, one_map)
        np.testing.assert_allclose(batch_probs, one_probs, rtol=0, atol=1e-5)

    stacked_maps, stacked_probs = segmenter.predict(np.stack(images), probs=True)
    assert stacked_maps.dtype == np.uint8 and stacked_probs.shape == (2, len(CLASS_NAMES), *images[0].shape[:2])
    np.testing.assert_array_equal(stacked_maps, np.stack([one_map for one_map, _ in alone]))
    np.testing.assert_allclose(stacked_probs.sum(axis=1), 1, rtol=0, atol=1e-5)
    np.testing.assert_array_equal(stacked_probs.argmax(axis=1), stacked_maps)
    assert len(np.unique(stacked_maps)) > 1  # a map of one class would make the comparisons above trivial

    # Images of other sizes in one list, one per batch: each still gets its own.
    small = images[1][:20, :40]
    mixed = segmenter.predict([images[0], small, images[1]], batch_size=1)
    assert [m.shape for m in mixed] == [images[0].shape[:2], (20, 40), images[1].shape[:2]]
    np.testing.assert_array_equal(mixed[1], segmenter.predict(small))
    np.testing.assert_array_equal(mixed[2], alone[1][0])
    with pytest.raises(ValueError, match=r"^batch_size=0: "):
        segmenter.predict(images, batch_size=0)
