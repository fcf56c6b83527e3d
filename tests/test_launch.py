"""The stage profiles of ``python -m mabn pretrain|cityscapes``: the real dataset's recipe when ``--data`` has its
layout, else a message saying what was expected and the demo profile (never silently)."""

import pytest

from mabn import launch

LAYOUTS = {"pretrain": ("train", "val"), "cityscapes": ("leftImg8bit", "gtFine")}
NAMES = {"pretrain": "ImageNet", "cityscapes": "Cityscapes"}


@pytest.mark.parametrize("stage", sorted(LAYOUTS))
def test_real_layout_runs_the_recipe(stage, tmp_path, capsys):
    for folder in LAYOUTS[stage]:
        (tmp_path / folder).mkdir()
    assert launch.PROFILES[stage].resolve(tmp_path) == ([f"{stage}.yaml"], tmp_path)
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("stage", sorted(LAYOUTS))
@pytest.mark.parametrize("present", [0, 1], ids=["empty", "half-layout"])
def test_missing_dataset_says_so_and_runs_the_demo(stage, present, tmp_path, capsys):
    for folder in LAYOUTS[stage][:present]:
        (tmp_path / folder).mkdir()
    configs, root = launch.PROFILES[stage].resolve(tmp_path, dry_run=True)  # dry run: nothing generated
    assert configs == [f"{stage}.yaml", f"demo/{stage}.yaml"]
    assert root == launch.DEMO_DATA / ("demo-imagenet" if stage == "pretrain" else "demo-cityscapes")
    out = capsys.readouterr().out
    assert out.startswith(f"No {NAMES[stage]} at {tmp_path}: expected ")
    assert all(folder in out for folder in LAYOUTS[stage]) and f"configs/demo/{stage}.yaml" in out


def test_no_data_argument(capsys):
    launch.PROFILES["pretrain"].resolve(None, dry_run=True)
    assert capsys.readouterr().out.startswith("No ImageNet given (DATA=...)")
