"""The stage profiles of ``python -m mabn pretrain|cityscapes``: the real dataset's recipe when ``--data`` has its
layout, an error naming the missing folder when it does not, and the demo profile only without ``--data``,
with its artefacts kept apart from real runs."""

from pathlib import Path

import pytest

from mabn.cli import launch

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
def test_a_given_dataset_without_its_layout_is_an_error_never_the_demo(stage, present, tmp_path, capsys):
    for folder in LAYOUTS[stage][:present]:
        (tmp_path / folder).mkdir()
    with pytest.raises(launch.LaunchError, match=f"missing folder {tmp_path / LAYOUTS[stage][present]}"):
        launch.PROFILES[stage].resolve(tmp_path)
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("stage", sorted(LAYOUTS))
def test_without_data_the_demo_says_so(stage, capsys):
    configs, root = launch.PROFILES[stage].resolve(None)
    assert configs == [f"{stage}.yaml", f"demo/{stage}.yaml"]
    assert root == launch.DEMO_DATA / ("demo-imagenet" if stage == "pretrain" else "demo-cityscapes")
    out = capsys.readouterr().out
    assert out.startswith(f"No {NAMES[stage]} given (DATA=...)")
    assert all(folder in out for folder in LAYOUTS[stage]) and f"configs/demo/{stage}.yaml" in out


def _value(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


@pytest.mark.parametrize("stage", sorted(LAYOUTS))
def test_demo_and_real_runs_write_to_separate_folders_per_norm(stage, tmp_path):
    for folder in LAYOUTS[stage]:
        (tmp_path / folder).mkdir()
    real = launch.build_args(stage, tmp_path, "gn", 0, 1, [], backbone="none")
    demo = launch.build_args(stage, None, "gn", 0, 1, [])
    assert _value(real, "--trainer.default_root_dir") == str(Path("runs") / stage / "gn")
    assert _value(demo, "--trainer.default_root_dir") == str(Path("runs") / "demo" / stage / "gn")
    other = launch.build_args(stage, tmp_path, "mabn", 0, 1, [], backbone="none")
    assert _value(other, "--trainer.default_root_dir") == str(Path("runs") / stage / "mabn")
    if stage == "pretrain":  # the demo's backbone never lands where a real stage 1 exports
        assert _value(real, "--model.init_args.export_dir") == "pretrain"
        assert _value(demo, "--model.init_args.export_dir") == str(Path("pretrain") / "demo")


def test_stage2_demo_reads_only_the_demo_backbone(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("pretrain/demo").mkdir(parents=True)
    Path("pretrain/resnet101-gn.pt").write_bytes(b"real")
    demo = launch.build_args("cityscapes", None, "gn", 0, 1, [])
    assert "--model.init_args.backbone" not in demo  # the real backbone is not the demo's
    Path("pretrain/demo/resnet101-gn.pt").write_bytes(b"demo")
    demo = launch.build_args("cityscapes", None, "gn", 0, 1, [])
    assert _value(demo, "--model.init_args.backbone") == str(Path("pretrain/demo/resnet101-gn.pt"))
