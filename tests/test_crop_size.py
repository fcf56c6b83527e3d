"""The paper's crop 713 (not a multiple of the output stride 8) goes through the whole PSPNet, training and eval."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch
import yaml

from mabn.data.cityscapes import CityscapesDataModule, train_transform
from mabn.models import PSPNet

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "cityscapes.yaml"


def _check_sizes(model: PSPNet, height: int, width: int) -> None:
    """Training gives main and auxiliary logits, eval the main logits, all at the input's height x width."""
    x = torch.randn(2, 3, height, width, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out, aux = model.train()(x)  # batch 2: the 1x1 pyramid bin needs more than one value per channel
        assert out.shape == aux.shape == (2, 19, height, width)
        assert model.eval()(x[:1]).shape == (1, 19, height, width)


@pytest.mark.parametrize("norm", ["bn", "mabn"])
def test_sizes_one_above_a_multiple_of_8_give_logits_of_the_input_size(norm):
    # 713 = 8 * 89 + 1; 41 and 57 leave the same remainder at a fraction of the cost, non-square.
    _check_sizes(PSPNet(norm=norm, norm_batch_size=None), 41, 57)


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
