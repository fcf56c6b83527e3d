"""Both stages on any device count: the per-device and global batch, the lr by the linear scaling rule and the
schedule in epochs, as ``--dry-run`` says them for 1 to 64 GPUs (docs/scaling.md), and as a fit says them."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from mabn import scaling
from mabn.commands import stage as stage_command
from mabn.errors import ConfigError

LAYOUTS = [(1, 1), (8, 1), (8, 2), (8, 4), (8, 8)]  # GPUs per node x nodes, as the users run them
CITYSCAPES_TRAIN = 2975  # the real split's size: the recipe's epochs are of it
IMAGENET_CLASSES, IMAGENET_PER_CLASS = 16, 300  # enough for one global batch of 2048 on 64 devices


@pytest.fixture(scope="session")
def layouts(tmp_path_factory) -> dict[str, Path]:
    """Dataset layouts of empty files: a dry run plans from file names and reads no image."""
    root = tmp_path_factory.mktemp("layouts")
    cityscapes = root / "cityscapes"
    for split, count in (("train", CITYSCAPES_TRAIN), ("val", 1)):
        images, labels = cityscapes / "leftImg8bit" / split / "aachen", cityscapes / "gtFine" / split / "aachen"
        images.mkdir(parents=True)
        labels.mkdir(parents=True)
        for i in range(count):
            (images / f"aachen_000000_{i:06d}_leftImg8bit.png").touch()
            (labels / f"aachen_000000_{i:06d}_gtFine_labelIds.png").touch()
    imagenet = root / "imagenet"
    for c in range(IMAGENET_CLASSES):
        (imagenet / "val" / f"n{c:08d}").mkdir(parents=True)
        (imagenet / "val" / f"n{c:08d}" / "0.JPEG").touch()
        folder = imagenet / "train" / f"n{c:08d}"
        folder.mkdir(parents=True)
        for i in range(IMAGENET_PER_CLASS):
            (folder / f"{i}.JPEG").touch()
    return {"cityscapes": cityscapes, "pretrain": imagenet}


def _dry_run(capsys, stage: str, data: Path, gpus: int, nodes: int, *more: str) -> dict[str, str]:
    capsys.readouterr()
    stage_command.main([stage, "--data", str(data), "--gpus", str(gpus), "--nodes", str(nodes), "--dry-run", *more])
    lines = capsys.readouterr().out.splitlines()
    said = {line.split(":", 1)[0]: line.split(":", 1)[1].strip() for line in lines if ":" in line}
    return said | {"command": next(line for line in lines if line.startswith("python -m mabn fit"))}


def _numbers(text: str) -> list[float]:
    return [float(n) for n in re.findall(r"\d+(?:\.\d+)?", text)]


@pytest.mark.parametrize(("gpus", "nodes"), LAYOUTS, ids=[f"{g}x{n}" for g, n in LAYOUTS])
def test_stage2_keeps_16_up_to_8_devices_then_2_per_device_with_linear_lr_and_its_epochs(gpus, nodes, layouts, capsys):
    lines = _dry_run(capsys, "cityscapes", layouts["cityscapes"], gpus, nodes, "--backbone", "none")
    devices = gpus * nodes
    per_device = 16 // devices if devices <= 8 else 2  # the paper's 16, and never less than one pair per device
    global_batch = per_device * devices
    assert f"{per_device} per device x {devices} device(s) = global batch {global_batch}" in lines["batch"]
    per_epoch = math.ceil(CITYSCAPES_TRAIN / devices) // per_device
    assert _numbers(lines["iterations"])[:3] == [per_epoch, CITYSCAPES_TRAIN, 200 * per_epoch]
    assert math.isclose(_numbers(lines["lr"])[3], 0.01 * global_batch / 16)
    warmup, power, end = _numbers(lines["schedule"])[1:]
    assert (warmup, end) == (round(3 * per_epoch), 200 * per_epoch)


@pytest.mark.parametrize(("gpus", "nodes"), LAYOUTS, ids=[f"{g}x{n}" for g, n in LAYOUTS])
def test_stage1_keeps_120_epochs_with_drops_at_30_60_90_on_any_device_count(gpus, nodes, layouts, capsys):
    lines = _dry_run(capsys, "pretrain", layouts["pretrain"], gpus, nodes)
    devices, samples = gpus * nodes, IMAGENET_CLASSES * IMAGENET_PER_CLASS
    assert f"32 per device x {devices} device(s) = global batch {32 * devices}" in lines["batch"]
    per_epoch = math.ceil(samples / devices) // 32
    assert _numbers(lines["iterations"])[:3] == [per_epoch, samples, 120 * per_epoch]
    assert math.isclose(_numbers(lines["lr"])[3], 0.1 * 32 * devices / 256)
    drops = _numbers(lines["schedule"])
    assert drops[-3:] == [30 * per_epoch, 60 * per_epoch, 90 * per_epoch]


def test_device_batch_rule():
    """Independent statement of the rule: whole pairs, the recipe's 16 while 16 splits into whole pairs per
    device, one pair per device (so a larger global batch) beyond 8 devices, and an error otherwise."""
    for devices in range(1, 65):
        if devices in (1, 2, 4, 8):
            assert scaling.device_batch(16, devices, 2) * devices == 16
        elif devices > 8:
            assert scaling.device_batch(16, devices, 2) == 2
        else:
            with pytest.raises(ConfigError, match=f"over {devices} devices .* use 1, 2, 4, 8 or more than 8 devices"):
                scaling.device_batch(16, devices, 2)


def test_iterations_follow_the_sampler_and_the_dropped_last_batch():
    # 10 samples on 3 devices: each gets ceil(10/3) = 4 (two padded), 4 // 3 = 1 full batch of 3.
    assert scaling.loader_batches(10, 3, 3) == 1
    assert scaling.iterations_per_epoch(7, accumulate=2) == 4  # the last, partial window also steps
    assert scaling.total_iterations(7, 3, -1, 2) == 11  # ceil(21 / 2), as Lightning estimates
    assert scaling.total_iterations(7, 3, 5, 1) == 5


def test_missing_stage1_backbone_is_an_error_and_none_is_random_weights_on_purpose(
    layouts, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)  # no pretrain/ folder here
    capsys.readouterr()
    with pytest.raises(SystemExit) as missing:
        stage_command.main(["cityscapes", "--data", str(layouts["cityscapes"]), "--dry-run"])
    assert missing.value.code == 2
    error = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert error == [
        "error: no stage-1 backbone pretrain/resnet101-mabn.pt: run stage 1 first (make pretrain NORM=mabn "
        "DATA=<imagenet>), give one with BACKBONE=<file>, or BACKBONE=none (--backbone none) to train the encoder "
        "from random weights"
    ]
    random = _dry_run(capsys, "cityscapes", layouts["cityscapes"], 1, 1, "--backbone", "none")
    assert random["Backbone"] == "none (BACKBONE=none): the encoder starts from random weights"
    assert "--model.init_args.backbone" not in random["command"]


def test_dry_run_names_the_backbone_it_will_load(layouts, backbones, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    path = backbones.place(backbones.stage1("mabn"), Path("pretrain/resnet101-mabn.pt"))
    lines = _dry_run(capsys, "cityscapes", layouts["cityscapes"], 8, 1)
    assert lines["Backbone"] == f"{path}, stage 1's export for NORM=mabn (BACKBONE=... picks another)"
    pending = _dry_run(capsys, "cityscapes", layouts["cityscapes"], 8, 1, "--backbone-pending")
    assert pending["Backbone"] == lines["Backbone"]  # a file that is there is used
    path.unlink()
    pending = _dry_run(capsys, "cityscapes", layouts["cityscapes"], 8, 1, "--backbone-pending")
    assert pending["Backbone"].endswith("to be written by the stage-1 job this one waits for")
