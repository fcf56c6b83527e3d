"""A crop from the data (docs/your-data.md, "Crop"): a dataset of one's own whose training images are mostly smaller
than the recipe's 713 trains at a crop from them, the largest multiple of 8 within the median image's shorter side;
the recipe's crop where the median image holds it; a given ``crop_size`` always wins. The dry run and the fit say
which crop and why, the few smaller images are padded, and the checkpoint keeps the crop."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

from helpers import own_dataset
from helpers.own_dataset import line, segment
from mabn.data.check import data_crop
from mabn.data.folder import FolderDataModule


@pytest.fixture(scope="module")
def small_images(tmp_path_factory) -> Path:
    return own_dataset.bands(tmp_path_factory.mktemp("crop") / "small")


def test_the_crop_is_the_largest_multiple_of_8_within_the_median_images_shorter_side():
    # The median of the shorter sides, portrait and landscape alike (30, 96, 99, 100, 120): 99 px, crop 96.
    sizes = [(128, 96), (100, 130), (40, 30), (300, 99), (120, 160)]
    crop, said = data_crop(sizes, None)
    assert crop == 96
    assert said == (
        "crop: 96x96, from the data: the median training image is 99 px on its shorter side, under the recipe's 713 "
        "(crop_size null: the largest multiple of 8 within it; --data.init_args.crop_size sets one)"
    )
    assert data_crop([(20, 5)], None)[0] == 8  # never under one output stride
    assert data_crop([(100, 60), (50, 40)], None)[0] == 40  # of two, the lower median: most images hold the crop
    # Where the median image holds the recipe's crop, the recipe's crop it is.
    assert data_crop([(2048, 1024), (2048, 1024), (64, 64)], None) == (
        713,
        "crop: 713x713, the recipe's: the median training image is 1024 px on its shorter side (crop_size null)",
    )
    assert data_crop(sizes, 713) == (713, "crop: 713x713, crop_size as given")  # a given crop always wins


def test_the_dry_run_says_the_crop_from_the_data_and_a_given_one_wins(small_images, tmp_path, capsys):
    code, lines, err = segment(small_images, tmp_path / "run", capsys, "--model.init_args.arch", "resnet18")
    assert code == 0, err
    assert line(lines, "crop:").startswith("crop: 96x96, from the data: the median training image is 96 px")
    assert "0 of the 32 training images are smaller than the crop 96x96" in lines
    # The recipe's 713 given on the command line is given: the images are padded up to it.
    given = ("--model.init_args.arch", "resnet18", "--data.init_args.crop_size", "713")
    code, lines, err = segment(small_images, tmp_path / "run", capsys, *given)
    assert code == 0, err
    assert line(lines, "crop:") == "crop: 713x713, crop_size as given"
    assert line(lines, "32 of the 32").startswith("32 of the 32 training images are smaller than the crop 713x713")


def test_the_data_module_takes_the_crop_from_its_images_and_pads_the_few_smaller_ones(tmp_path, capsys):
    data = own_dataset.bands(tmp_path / "d", train=8)
    for i in (0, 1):  # two training pairs of 64x80 among six of 96x128
        for kind in ("images", "masks"):
            path = data / kind / "train" / f"{i:03d}.png"
            with Image.open(path) as image:
                image.resize((80, 64), Image.Resampling.NEAREST).save(path)
    module = FolderDataModule(str(data), num_workers=0)
    assert module.crop_size is None
    capsys.readouterr()
    module.setup("fit")
    said = capsys.readouterr().out.splitlines()
    assert module.crop_size == module.hparams["crop_size"] == 96  # the checkpoint's, which test and predict read
    assert line(said, "crop:").startswith("crop: 96x96, from the data: the median training image is 96 px")
    assert line(said, "2 of the 8").startswith("2 of the 8 training images are smaller than the crop 96x96: padded")
    image, label = module.train_set[0]
    assert image.shape == (3, 96, 96) and label.shape == (96, 96)
    given = FolderDataModule(str(data), crop_size=64, num_workers=0)
    given.setup("fit")
    assert given.crop_size == given.hparams["crop_size"] == 64
