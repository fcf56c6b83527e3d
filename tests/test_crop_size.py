"""The paper's crop 713 (not a multiple of the output stride 8) goes through the whole PSPNet, training and eval; a
training image smaller than the crop is padded up to it, the crop staying the one given."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch
import yaml

from helpers.marks import default_suite_runs
from mabn.data.augment import train_transform
from mabn.data.cityscapes import CityscapesDataModule
from mabn.data.classes import IGNORE_INDEX, ClassTable
from mabn.data.folder import FolderDataModule, FolderDataset
from mabn.data.synthetic import segment as demo_segment
from mabn.models import PSPNet

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "cityscapes.yaml"


def _check_sizes(model: PSPNet, height: int, width: int) -> None:
    """Training gives main and auxiliary logits, eval the main logits, all at the input's height x width."""
    x = torch.randn(2, 3, height, width, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out, aux = model.train()(x)  # batch 2: the 1x1 pyramid bin needs more than one value per channel
        assert out.shape == aux.shape == (2, 19, height, width)
        assert model.eval()(x[:1]).shape == (1, 19, height, width)


@pytest.mark.parametrize("norm", default_suite_runs(["bn", "mabn"], keep=["mabn"]))
def test_sizes_one_above_a_multiple_of_8_give_logits_of_the_input_size(norm):
    # 713 = 8 * 89 + 1; 41 and 57 leave the same remainder at a fraction of the cost, non-square. ResNet-18 has
    # ResNet-101's strides and dilations (output stride 8), so the sizes are the same.
    _check_sizes(PSPNet(norm=norm, norm_batch_size=None, arch="resnet18"), 41, 57)


@pytest.mark.slow  # tens of seconds on one CPU thread
def test_crop_713_gives_713_logits_in_training_and_eval():
    _check_sizes(PSPNet(norm="bn"), 713, 713)


def test_the_recipe_and_the_data_module_default_to_the_papers_crop_713():
    config = yaml.safe_load(CONFIG.read_text())
    assert config["data"]["init_args"]["crop_size"] == 713
    assert inspect.signature(CityscapesDataModule).parameters["crop_size"].default == 713
    image = (torch.rand(100, 120, 3) * 255).to(torch.uint8).numpy()
    out = train_transform(seed=0)(image=image, mask=image[..., 0])
    assert out["image"].shape == (713, 713, 3) and out["mask"].shape == (713, 713)


def test_a_training_image_smaller_than_the_crop_is_padded_up_to_the_crop(tmp_path):
    # One 32x20 (WxH) image, crop 32, no random scale, rotation or blur: 6 rows of padding above and below it.
    data = demo_segment.generate(tmp_path / "d", n_train=1, n_val=1, size=(20, 32))
    module = FolderDataModule(str(data), crop_size=32, scale_range=(1.0, 1.0), rotate_limit=0.0, blur_p=0.0)
    module.setup("fit")
    image, label = module.train_set[0]
    assert module.crop_size == 32 and image.shape == (3, 32, 32) and label.shape == (32, 32)
    pad = torch.cat([torch.arange(6), torch.arange(26, 32)])
    assert image[:, pad].abs().max() < 0.01  # the mean pixel, 0 once normalized (up to its rounding to uint8)
    assert (label[pad] == IGNORE_INDEX).all()
    _, original = FolderDataset(data, "train", ClassTable.read(data / "classes.yaml"))[0]
    assert torch.equal(label[6:26], original) or torch.equal(label[6:26], original.flip(-1))  # flipped with p 0.5
