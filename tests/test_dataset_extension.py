"""A dataset of another layout, added as docs/design.md's recipe says: a data module of one's own, named by class
path, with nothing of ``src/`` edited (``helpers.voc_like``, Pascal VOC's layout). Its checkpoint records the data
module, so that ``test``, ``predict``, ``mabn.load`` and ``export`` read its classes, its layout and its naming from
it; and a dataset of 19 classes of its own is not taken for Cityscapes."""

from __future__ import annotations

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from PIL import Image

import mabn
from helpers import voc_like
from helpers.commands import run_mabn
from helpers.trainer import STAGE2_FIT, flags
from mabn.inference import export
from mabn.recipes import CONFIGS
from mabn.tasks import SegmentationTask


@pytest.fixture(scope="module")
def voc_run(tmp_path_factory):
    """(the data root, the checkpoint) of a 2-step fit of PSPNet on ResNet-18 on a VOC-layout dataset of 21 classes,
    through ``python -m mabn fit`` with the data module given by class path."""
    from mabn.__main__ import main

    root = tmp_path_factory.mktemp("voc")
    data = voc_like.generate(root / "data", classes=21)
    argv = [
        "fit", "--config", str(CONFIGS / "cityscapes.yaml"), "--trainer.default_root_dir", str(root / "run"),
        "--data.class_path", "helpers.voc_like.VOCDataModule", "--data.init_args.data_dir", str(data), *STAGE2_FIT,
        *flags("model.init_args", arch="resnet18", num_classes=21, log_predictions_every_n_epochs=0),
        "--model.init_args.backbone", "null", "--trainer.logger", "false",
    ]  # fmt: skip
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)
        assert main(argv) == 0
    return data, root / "run" / "checkpoints" / "last.ckpt"


@pytest.mark.slow  # a fit and the four readers of its checkpoint
def test_a_checkpoint_records_its_data_module_and_inference_reads_the_dataset_through_it(voc_run, tmp_path, capsys):
    data, ckpt = voc_run
    recorded = torch.load(ckpt, map_location="cpu", weights_only=True)["datamodule_hyper_parameters"]
    assert recorded["_class_path"] == "helpers.voc_like.VOCDataModule"

    # test: the val split of VOC's list, scored in VOC's classes.
    code, out, err = run_mabn(["test", str(ckpt), "--num-workers", "0"], capsys)
    assert code == 0, err
    assert "| aeroplane |" in out and "| tvmonitor |" in out and "road" not in out

    # predict: the split's images from its list, the masks named and valued as VOC's SegmentationClass files.
    out_dir = tmp_path / "pred"
    code, out, err = run_mabn(
        ["predict", str(ckpt), "--split", "val", "--out", str(out_dir), "--num-workers", "0"], capsys
    )
    assert code == 0, err
    ids = (data / "ImageSets" / "Segmentation" / "val.txt").read_text().split()
    assert sorted(p.name for p in (out_dir / "SegmentationClass").iterdir()) == [f"{i}.png" for i in ids]
    assert "(SegmentationClass/, color/)" in out and "evaluate" not in out  # VOC's module names no scorer
    written = np.asarray(Image.open(out_dir / "SegmentationClass" / f"{ids[0]}.png"))

    # mabn.load: the same class map, in VOC's class names.
    segmenter = mabn.load(ckpt, device="cpu")
    assert segmenter.class_names == voc_like.VOC_NAMES
    class_map = segmenter.predict(data / "JPEGImages" / f"{ids[0]}.jpg")
    np.testing.assert_array_equal(segmenter.to_mask(class_map), written)

    # export: the metadata names VOC's classes.
    result = export.export(ckpt, tmp_path / "exported", (48, 64), formats=("torchscript",))
    assert result.metadata["class_names"] == list(voc_like.VOC_NAMES)
    assert result.metadata["class_colors"][15] == [192, 128, 128]  # person, in VOC's colour map


def _checkpoint(path, data_module: str, num_classes: int, data_dir) -> None:
    """A stage-2 checkpoint as LightningCLI writes it, of a ResNet-18 PSPNet from random weights whose data module
    is ``data_module`` (a class path) on ``data_dir``."""
    torch.manual_seed(0)
    task = SegmentationTask(norm="bn", num_classes=num_classes, arch="resnet18", backbone=None)
    hparams = {"_class_path": data_module, "data_dir": str(data_dir), "crop_size": 32}
    torch.save(
        {
            "state_dict": task.state_dict(),
            "hyper_parameters": {**dict(task.hparams), "_class_path": "mabn.tasks.SegmentationTask"},
            "datamodule_hyper_parameters": hparams,
            "pytorch-lightning_version": pl.__version__,
        },
        path,
    )


def test_nineteen_classes_of_a_data_module_are_its_own_not_cityscapes(tmp_path, capsys):
    """A checkpoint of 19 outputs whose data module fixes 19 classes of its own: every reader names those classes
    (19 is Cityscapes' count, which says nothing of the dataset)."""
    data = voc_like.generate(tmp_path / "data", classes=19, train=1, val=1)
    ckpt = tmp_path / "parts.ckpt"
    _checkpoint(ckpt, "helpers.voc_like.NineteenDataModule", 19, data)
    names = [f"part{i}" for i in range(19)]
    assert list(mabn.load(ckpt, device="cpu").class_names) == names
    assert export.metadata(export.load_model(ckpt))["class_names"] == names
    code, out, err = run_mabn(["test", str(ckpt), "--num-workers", "0"], capsys)
    assert code == 0, err
    assert "| part18 |" in out and "road" not in out
    out_dir = tmp_path / "pred"
    code, out, err = run_mabn(
        ["predict", str(ckpt), "--split", "val", "--out", str(out_dir), "--num-workers", "0"], capsys
    )
    assert code == 0, err
    assert [p.name for p in (out_dir / "SegmentationClass").iterdir()] == ["2007_val000.png"]


def test_a_data_module_that_cannot_be_imported_is_one_line_naming_it(tmp_path, capsys):
    data = voc_like.generate(tmp_path / "data", classes=21, train=1, val=1)
    path = tmp_path / "moved.ckpt"
    _checkpoint(path, "gone_module.VOCDataModule", 21, data)
    code, _, err = run_mabn(["predict", str(path), "--split", "val", "--out", str(tmp_path / "p")], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert err.startswith(f"error: {path} was trained with the data module gone_module.VOCDataModule, which cannot be")
