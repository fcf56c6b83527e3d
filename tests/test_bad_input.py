"""Bad input, as a user types it, through the real entry point (``python -m mabn <stage>``, ``export``,
``plots``): each case ends with exit code 2 and one ``error:`` line naming the culprit, and changes no file
outside the run's own folder (no demo data, no backbone, no other run). Grayscale and RGBA images train.

The configuration cases are refused before any model is built; the dataset cases build the model and stop at the
first read of the broken file, so they use a tiny crop, one step and ResNet-18 (``arch``; the model is not what
they check).
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from helpers.marks import default_suite_runs
from helpers.trainer import fit_flags
from mabn.cli import launch
from mabn.cli.commands import stage
from mabn.data.synthetic import cityscapes as demo_cityscapes
from mabn.data.synthetic import imagenet as demo_imagenet
from mabn.data.synthetic import segment as demo_segment

TINY_FIT = [
    *fit_flags(1, limit_val_batches=1, num_sanity_val_steps=1),
    "--data.init_args.num_workers", "0", "--model.init_args.arch", "resnet18",
]  # fmt: skip
CITYSCAPES_FIT = [*TINY_FIT, "--data.init_args.global_batch_size", "2", "--data.init_args.crop_size", "32"]
IMAGENET_FIT = [*TINY_FIT, "--data.init_args.batch_size", "2", "--data.init_args.image_size", "32",
                "--data.init_args.val_resize", "36"]  # fmt: skip


@pytest.fixture(scope="session")
def sets(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sets")
    return {
        "cityscapes": demo_cityscapes.generate(root / "cs", n_train=2, n_val=1, size=(32, 64)),
        "imagenet": demo_imagenet.generate(root / "in", n_train=2, n_val=1, size=36),
        "segment": demo_segment.generate(root / "seg", n_train=2, n_val=2, size=(32, 64)),
        "segment-color": demo_segment.generate(root / "color", n_train=2, n_val=2, size=(32, 64), mask_format="color"),
    }


@pytest.fixture
def work(tmp_path, sets, monkeypatch) -> Iterator[Path]:
    """A working folder with a copy of both small sets, as the current directory. The runs are in this
    process: wandb (disabled) is torn down after the test, or later tests' loggers would reuse its run and
    settings."""
    for name, src in sets.items():
        shutil.copytree(src, tmp_path / name)
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    import wandb

    if wandb.run is not None:
        wandb.finish()
    wandb.teardown()


def _snapshot(root: Path, skip: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and skip not in p.parents
    }


def _first(folder: Path, pattern: str) -> Path:
    return sorted(folder.rglob(pattern))[0]


def _ckpt(path: Path, class_path: str, norm: str = "mabn") -> None:
    torch.save(
        {"state_dict": {}, "hyper_parameters": {"norm": norm, "_class_path": class_path}, "global_step": 1}, path
    )


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 3])


def _label(path: Path, fill: int | None = None, size: tuple[int, int] | None = None) -> None:
    label = np.asarray(Image.open(path))
    if size is not None:
        label = np.zeros(size, np.uint8) + 7
    if fill is not None:
        label = np.full_like(label, fill)
    Image.fromarray(label).save(path)


def _mask_value(folder: Path, value: int | tuple[int, int, int]) -> None:
    """One pixel of each mask in ``folder`` set to ``value`` (a colour in colour masks)."""
    for path in sorted(folder.glob("*.png")):
        mask = np.asarray(Image.open(path)).copy()
        mask[3, 5] = value
        Image.fromarray(mask).save(path)


def _other_run_backbone(w: Path) -> None:
    (w / "pretrain/demo").mkdir(parents=True)
    torch.save({"config": {"run_dir": "runs/demo/pretrain/first"}}, w / "pretrain/demo/resnet101-mabn.pt")


def _occupied(w: Path) -> None:
    (w / "runs/demo/cityscapes/mabn/checkpoints").mkdir(parents=True)
    _ckpt(w / "runs/demo/cityscapes/mabn/checkpoints/last.ckpt", "mabn.tasks.SegmentationTask")


CS, IN, SEGMENT = "cityscapes", "imagenet", "segment"
OWN = ["--data", "{w}/segment", "--backbone", "none", "--", *CITYSCAPES_FIT]
OWN_COLOR = ["--data", "{w}/segment-color", "--backbone", "none", "--", *CITYSCAPES_FIT]
SEG, CLS = "mabn.tasks.SegmentationTask", "mabn.tasks.ClassificationTask"

# (id, entry, argv (with {w}: the working folder), setup, expected text in the error line)
CASES: list[tuple[str, str, list[str], Callable[[Path], None] | None, str]] = [
    ("data-typo", "pretrain", ["--data", "{w}/imagenett"], None, "imagenett: no such folder"),
    ("missing-split-folder", CS, ["--data", "{w}/cityscapes"],
     lambda w: shutil.rmtree(w / "cityscapes/gtFine"), "missing folder {w}/cityscapes/gtFine"),
    ("unknown-norm", CS, ["--norm", "mabm"], None, "NORM=mabm: unknown norm"),
    ("unknown-norm-dry-run", CS, ["--norm", "mabm", "--dry-run"], None, "NORM=mabm: unknown norm"),
    ("negative-base-lr", CS, ["--", "--model.init_args.base_lr", "-0.01"], None, "base_lr=-0.01: must be > 0"),
    ("negative-head-lr-mult", CS, ["--", "--model.init_args.head_lr_mult", "-1"], None, "head_lr_mult=-1.0"),
    ("unknown-arch", "pretrain", ["--", "--model.init_args.arch", "resnet19"], None,
     "arch='resnet19': choose one of resnet18, resnet34, resnet50, resnet101, resnet152"),
    ("batch-not-whole-ghost-batches", CS, ["--", "--data.init_args.global_batch_size", "6",
     "--model.init_args.norm_batch_size", "4"], None,
     "global_batch_size=6 does not split into normalization batches of norm_batch_size=4"),
    ("syncbn-on-cpu", CS, ["--norm", "syncbn"], None, "NORM=syncbn synchronizes BatchNorm"),
    ("missing-backbone", CS, ["--backbone", "{w}/pretrain/nope.pt"], None, "BACKBONE={w}/pretrain/nope.pt: no such"),
    ("real-stage-2-without-stage-1", CS, ["--data", "{w}/cityscapes"], None,
     "no stage-1 backbone pretrain/resnet101-mabn.pt: run stage 1 first (make pretrain NORM=mabn"),
    ("truncated-resume", CS, ["--resume", "{w}/cut.ckpt"],
     lambda w: (_ckpt(w / "cut.ckpt", SEG), _truncate(w / "cut.ckpt")), "cut.ckpt is not a readable checkpoint"),
    ("foreign-stage-resume", CS, ["--resume", "{w}/stage1.ckpt"],
     lambda w: _ckpt(w / "stage1.ckpt", CLS), f"written by {CLS}"),
    ("new-run-over-a-run", CS, [], _occupied, "runs/demo/cityscapes/mabn already holds a run"),
    ("backbone-of-another-run", "pretrain", [], _other_run_backbone, "holds the backbone of another run"),
    ("truncated-backbone", CS, ["--data", "{w}/cityscapes", "--backbone", "{w}/b.pt", "--", *CITYSCAPES_FIT],
     lambda w: (w.joinpath("b.pt").write_bytes(b"\x80\x02cut"),), "b.pt is not a readable backbone file"),
    ("image-without-label", CS, ["--data", "{w}/cityscapes", "--backbone", "none", "--", *CITYSCAPES_FIT],
     lambda w: _first(w / "cityscapes/gtFine/val", "*.png").unlink(), "has no label file"),
    ("label-of-another-size", CS, ["--data", "{w}/cityscapes", "--backbone", "none", "--", *CITYSCAPES_FIT],
     lambda w: _label(_first(w / "cityscapes/gtFine/val", "*.png"), size=(16, 16)), "size mismatch"),
    ("truncated-png", CS, ["--data", "{w}/cityscapes", "--backbone", "none", "--", *CITYSCAPES_FIT],
     lambda w: _truncate(_first(w / "cityscapes/leftImg8bit/val", "*.png")), "cannot read image file"),
    ("label-ids-outside-the-table", CS, ["--data", "{w}/cityscapes", "--backbone", "none", "--", *CITYSCAPES_FIT],
     lambda w: _label(_first(w / "cityscapes/gtFine/val", "*.png"), fill=200), "holds no Cityscapes class"),
    ("empty-split", CS, ["--data", "{w}/cityscapes", "--backbone", "none", "--", *CITYSCAPES_FIT],
     lambda w: [p.unlink() for p in (w / "cityscapes/leftImg8bit/val").rglob("*.png")], "no images matching"),
    ("own-data-without-classes-file", SEGMENT, ["--data", "{w}/segment"],
     lambda w: (w / "segment/classes.yaml").unlink(), "DATA={w}/segment: missing file {w}/segment/classes.yaml"),
    ("own-image-without-mask", SEGMENT, OWN, lambda w: (w / "segment/masks/val/scene001.png").unlink(),
     "image {w}/segment/images/val/scene001.jpg has no mask {w}/segment/masks/val/scene001.png (1 image(s)"),
    ("own-mask-of-another-size", SEGMENT, OWN, lambda w: _label(w / "segment/masks/val/scene001.png", size=(16, 16)),
     "size mismatch: image {w}/segment/images/val/scene001.jpg is 64x32 but mask {w}/segment/masks/val/scene001.png "
     "is 16x16 (WxH) (1 of the 2 pairs"),
    ("own-mask-value-of-no-class", SEGMENT, OWN, lambda w: _mask_value(w / "segment/masks/val", 99),
     "mask {w}/segment/masks/val/scene000.png holds value 99, neither a class nor ignored by "
     "{w}/segment/classes.yaml (class mask values 7, 8, 11, 17, 21, 23, 24, 26, ignore_index 0); 2 of the 2 masks"),
    ("own-mask-colour-of-no-class", SEGMENT, OWN_COLOR, lambda w: _mask_value(w / "segment-color/masks/val", (1, 2, 3)),
     "mask {w}/segment-color/masks/val/scene000.png holds colour [1, 2, 3], neither a class's nor ignored by "
     "{w}/segment-color/classes.yaml (colors, ignore_color [0, 0, 0]); 2 of the 2 masks in "
     "{w}/segment-color/masks/val hold such colours"),
    ("own-classes-file-that-does-not-parse", SEGMENT, OWN,
     lambda w: (w / "segment/classes.yaml").write_text("classes: [road, car\n"),
     "classes file {w}/segment/classes.yaml is not valid YAML: "),
    ("empty-class-folder", "pretrain", ["--data", "{w}/imagenet", "--", *IMAGENET_FIT],
     lambda w: [p.unlink() for p in sorted((w / "imagenet/val").iterdir())[0].iterdir()], "holds no images"),
    ("truncated-image", "pretrain", ["--data", "{w}/imagenet", "--", *IMAGENET_FIT],
     lambda w: _truncate(_first(w / "imagenet/val", "*.png")), "cannot read image"),
    ("export-truncated-checkpoint", "export", ["{w}/cut.ckpt"],
     lambda w: (_ckpt(w / "cut.ckpt", SEG), _truncate(w / "cut.ckpt")), "cut.ckpt"),
    ("export-foreign-file", "export", ["{w}/b.pt"],
     lambda w: torch.save({"format": "mabn-backbone"}, w / "b.pt"), "b.pt"),
    ("plots-without-log", "plots", ["{w}/runs/nothing"],
     lambda w: (w / "runs/nothing").mkdir(parents=True), "no metrics.csv under"),
]  # fmt: skip


def _main(entry: str) -> Callable[[list[str]], object]:
    """``python -m mabn <entry> ...`` in this process."""
    from mabn.__main__ import main

    return lambda argv: sys.exit(main([entry, *argv]))


# The cases refused before anything is read run in the default suite, with one case per kind of bad data file; the
# other data files (each a scan of its dataset, ~0.7 s) run in the slow suite, and tests/test_dataset_check.py holds
# the dataset check's lines in the default suite.
SLOW_CASES = {"truncated-png", "label-ids-outside-the-table", "label-of-another-size", "empty-split",
              "own-mask-of-another-size", "own-mask-colour-of-no-class", "own-image-without-mask",
              "empty-class-folder", "unknown-norm-dry-run"}  # fmt: skip


@pytest.mark.parametrize(
    ("entry", "argv", "setup", "expected"),
    default_suite_runs(
        [c[1:] for c in CASES], keep=[c[1:] for c in CASES if c[0] not in SLOW_CASES], ids=[c[0] for c in CASES]
    ),  # fmt: skip
)
def test_bad_input_is_one_error_line_and_changes_nothing_else(work, capsys, entry, argv, setup, expected):
    if setup is not None:
        setup(work)
    stage = entry if entry in launch.PROFILES else None
    norm = argv[argv.index("--norm") + 1] if "--norm" in argv else "mabn"
    data = Path(argv[argv.index("--data") + 1].format(w=work)) if "--data" in argv else None
    run = work / launch.run_dir(stage or "none", norm, data is None, None, data)
    before = _snapshot(work, run)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        _main(entry)([a.format(w=work) for a in argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2, err[-10:]
    errors = [line for line in err if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0] == err[-1], err[-10:]
    assert expected.format(w=work) in errors[0]
    print(errors[0])  # what the user reads (collected into docs/reliability.md)
    assert _snapshot(work, run) == before  # nothing outside the run's folder: no demo data, backbone or other run
    assert not (work / "data").exists()


@pytest.mark.slow  # a fit; tests/test_image_modes.py's fit reads each image as displayed in the default suite
def test_grayscale_and_rgba_images_train(work, capsys):
    city = work / "cityscapes/leftImg8bit"
    gray, rgba = sorted(city.rglob("*.png"))[:2]
    Image.open(gray).convert("L").save(gray)
    Image.open(rgba).convert("RGBA").save(rgba)
    pictures = work / "imagenet/train"
    Image.open(_first(pictures, "*.png")).convert("L").save(_first(pictures, "*.png"))
    stage.main([CS, "--data", str(work / "cityscapes"), "--norm", "gn", "--backbone", "none", "--", *CITYSCAPES_FIT])
    assert (work / "runs/cityscapes/gn/checkpoints/last.ckpt").is_file()
    stage.main(["pretrain", "--data", str(work / "imagenet"), "--norm", "gn", "--", *IMAGENET_FIT])
    assert (work / "runs/pretrain/gn/checkpoints/last.ckpt").is_file()


def _bomb(path: Path, width: int, height: int) -> None:
    """A PNG of a few bytes whose header claims ``width`` x ``height`` pixels (a decompression bomb's header)."""
    import struct
    import zlib

    Image.new("L", (1, 1)).save(path)
    data = bytearray(path.read_bytes())
    ihdr = 8 + 8  # signature, then the IHDR chunk's length and type
    data[ihdr : ihdr + 8] = struct.pack(">II", width, height)
    data[ihdr + 13 : ihdr + 17] = struct.pack(">I", zlib.crc32(bytes(data[ihdr - 4 : ihdr + 13])))
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("side", [17_000, 40_000])  # PIL warns up to twice its limit and raises above
def test_an_image_over_the_pixel_limit_is_one_line_naming_the_file(tmp_path, side):
    from mabn.data.errors import DatasetError
    from mabn.data.images import MAX_IMAGE_PIXELS, image_size, read_image

    assert Image.MAX_IMAGE_PIXELS == MAX_IMAGE_PIXELS == 2**28 < side * side
    bomb = tmp_path / "bomb.png"
    _bomb(bomb, side, side)
    for read in (lambda: read_image(bomb), lambda: image_size(bomb, "label")):
        with pytest.raises(DatasetError) as info:
            read()
        line = str(info.value)
        assert "\n" not in line and line.startswith("cannot read ") and f" file {bomb}: Image size (" in line
        assert "pixels) exceeds limit of " in line  # PIL names 2 * MAX_IMAGE_PIXELS above twice the limit
        print(line)  # what the user reads (docs/reliability.md)


def test_an_image_of_cityscapes_size_is_read(tmp_path):
    from mabn.data.images import read_image

    Image.new("RGB", (2048, 1024)).save(tmp_path / "city.png")
    assert read_image(tmp_path / "city.png").shape == (1024, 2048, 3)
