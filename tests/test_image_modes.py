"""Images read as a viewer shows them (``mabn.data.images``, docs/your-data.md#how-images-are-read), through
``python -m mabn segment`` and ``predict`` on a generated dataset of one's own: photos stored sideways with an EXIF
orientation (6 and 8, as phones write them) are turned upright, their masks drawn as displayed (or carrying the
same orientation) pair with them, and 16-bit, 32-bit and floating-point images are scaled to 8 bits by their own
range, where PIL's conversion to RGB clips them to white; masks keep their values. Every image of the set has a
dark left half and a bright right half as displayed, its mask class ``dark`` left and ``bright`` right, so the
tensors the model is given show whether image and mask agree, whatever the augmentation did."""

from __future__ import annotations

import shutil
import tracemalloc
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from helpers.commands import run_mabn
from helpers.trainer import fit_flags
from mabn.__main__ import main
from mabn.data.classes import ClassTable
from mabn.data.folder import FolderDataset
from mabn.data.images import IMAGENET_MEAN, IMAGENET_STD, read_image, read_values
from mabn.inference.predict import Segmenter
from mabn.tasks import SegmentationTask

CLASSES = "classes: [dark, bright]\nmask_values: {0: dark, 1: bright, 1000: bright}   # 1000: the 16-bit mask\n"
EXIF_ORIENTATION = 274
# How the stored pixels of a photo of orientation 6 (8) are turned from the displayed ones: the inverse of the
# turn a viewer applies (PIL's ROTATE_270 for 6, ROTATE_90 for 8).
STORED = {6: Image.Transpose.ROTATE_90, 8: Image.Transpose.ROTATE_270}
# name: (file suffix, displayed (width, height), EXIF orientation of the image, whether the mask carries it too)
TRAIN = {
    "deep": (".png", (40, 40), None, False),  # 16-bit grey (I;16) of values 1000 and 3000, its mask 16-bit too
    "float": (".tif", (40, 40), None, False),  # 32-bit floats (F) of 0.25 and 0.75
    "grey": (".png", (40, 40), None, False),  # 8-bit grey (L)
    "portrait": (".jpg", (32, 48), 6, False),  # a phone's portrait photo: stored 48x32, its mask drawn 32x48
    "square": (".jpg", (40, 40), 6, False),  # square: stored as it is, it would pair with a mask turned wrong
    "tagged": (".jpg", (40, 48), 8, True),  # its mask stored sideways as the photo, with the photo's orientation
}
VAL = ("deep", "portrait")
RUN = [
    *fit_flags(1, check_val_every_n_epoch=2, num_sanity_val_steps=0),
    "--data.init_args.global_batch_size", str(len(TRAIN)), "--data.init_args.num_workers", "0",
    "--data.init_args.crop_size", "32",
    "--model.init_args.arch", "resnet18", "--model.init_args.log_predictions_every_n_epochs", "0",
]  # fmt: skip


def _right(width: int, height: int) -> np.ndarray:
    """H x W: True in the right half, as displayed (class ``bright``)."""
    return np.broadcast_to(np.arange(width) >= width // 2, (height, width))


def displayed(name: str) -> np.ndarray:
    """The H x W x 3 uint8 RGB pixels the image ``name`` shows: black left, white right."""
    width, height = TRAIN[name][1]
    return np.repeat(np.where(_right(width, height), 255, 0).astype(np.uint8)[..., None], 3, axis=2)


def _save(image: Image.Image, path: Path, orientation: int | None) -> None:
    """Save ``image`` (as displayed) at ``path``; with an EXIF ``orientation``, stored turned as a camera stores it."""
    if orientation is None:
        image.save(path)
        return
    exif = Image.Exif()
    exif[EXIF_ORIENTATION] = orientation
    image.transpose(STORED[orientation]).save(path, exif=exif, **({"quality": 95} if path.suffix == ".jpg" else {}))


def _write_pair(root: Path, split: str, name: str) -> None:
    suffix, (width, height), orientation, mask_turned = TRAIN[name]
    right = _right(width, height)
    if name == "deep":
        image = Image.fromarray(np.where(right, 3000, 1000).astype(np.uint16))
        mask = Image.fromarray(np.where(right, 1000, 0).astype(np.uint16))
    else:
        if name == "float":
            image = Image.fromarray(np.where(right, 0.75, 0.25).astype(np.float32))
        else:
            grey = Image.fromarray(displayed(name)[..., 0])
            image = grey if name == "grey" else grey.convert("RGB")
        mask = Image.fromarray(right.astype(np.uint8))
    for folder in ("images", "masks"):
        (root / folder / split).mkdir(parents=True, exist_ok=True)
    _save(image, root / "images" / split / f"{name}{suffix}", orientation)
    _save(mask, root / "masks" / split / f"{name}.png", orientation if mask_turned else None)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """The dataset: the pairs of ``TRAIN`` for training, those of ``VAL`` again for validation."""
    root = tmp_path_factory.mktemp("modes") / "d"
    for name in TRAIN:
        _write_pair(root, "train", name)
    for name in VAL:
        _write_pair(root, "val", name)
    (root / "classes.yaml").write_text(CLASSES)
    assert Image.open(root / "images/train/deep.png").mode == "I;16"  # the modes the cases stand for
    assert Image.open(root / "images/train/float.tif").mode == "F"
    assert Image.open(root / "masks/train/deep.png").mode == "I;16"
    assert Image.open(root / "images/train/portrait.jpg").size == (48, 32)  # stored sideways
    return root


def _pixels(images: torch.Tensor) -> np.ndarray:
    """N x 3 x H x W normalized tensors -> N x H x W x 3 pixel values 0..255 (float)."""
    mean, std = (torch.tensor(v).view(1, 3, 1, 1) for v in (IMAGENET_MEAN, IMAGENET_STD))
    return ((images.float() * std + mean) * 255).permute(0, 2, 3, 1).numpy()


@pytest.fixture(scope="module")
def fitted(data) -> tuple[Path, list[tuple[torch.Tensor, torch.Tensor]]]:
    """(the last checkpoint, the (images, labels) batches the model was given) of one step of
    ``python -m mabn segment`` on ``data``: one batch of all training images."""
    batches: list[tuple[torch.Tensor, torch.Tensor]] = []
    training_step = SegmentationTask.training_step

    def recording(self, batch, batch_idx):
        batches.append((batch[0].detach().cpu().clone(), batch[1].detach().cpu().clone()))
        return training_step(self, batch, batch_idx)

    run = data.parent / "run"
    with pytest.MonkeyPatch.context() as patch, warnings.catch_warnings():
        patch.setattr(SegmentationTask, "training_step", recording)
        warnings.simplefilter("ignore")  # third-party deprecations of the fit: not what these tests read
        assert main(["segment", "--data", str(data), "--backbone", "none", "--run-dir", str(run), "--", *RUN]) == 0
    return run / "checkpoints" / "last.ckpt", batches


def _off(pixels: np.ndarray, name: str) -> float:
    """How far ``pixels`` (H x W x 3, 0..255) are from what the image ``name`` shows: the mean absolute difference,
    which JPEG's ringing at the edge keeps above 0, and a turned or clipped reading puts near 128."""
    expected = displayed(name)
    assert pixels.shape == expected.shape, name
    return float(np.abs(pixels - expected).mean())


def _tolerance(name: str) -> float:
    return 4 if TRAIN[name][0] == ".jpg" else 0.01


def test_each_item_is_its_image_as_displayed_with_its_mask(data):
    dataset = FolderDataset(data, "train", ClassTable.read(data / "classes.yaml"))
    assert dataset.sizes == [TRAIN[sample.name][1] for sample in dataset.samples]  # headers, as displayed
    for index, sample in enumerate(dataset.samples):
        image, labels = dataset[index]
        assert _off(_pixels(image[None])[0], sample.name) < _tolerance(sample.name), sample.name
        # Every mask as displayed, the 16-bit one with its values (1000 is bright), none scaled.
        np.testing.assert_array_equal(labels.numpy(), _right(*TRAIN[sample.name][1]), err_msg=sample.name)


def test_the_fit_gives_the_model_each_image_as_displayed_against_its_mask(fitted):
    _, batches = fitted
    assert len(batches) == 1 and len(batches[0][0]) == len(TRAIN)  # one step of every training image
    images, labels = batches[0]
    for index, (pixels, classes) in enumerate(zip(_pixels(images), labels.numpy())):
        # Scaled, turned, cropped, blurred: the pixels of each class keep their brightness but at the edge (a
        # reading turned against its mask puts half of them on the wrong side, a clipped one all of them).
        bright = pixels.mean(axis=2) >= 128
        shares = [(bright[classes == value] == shown).mean() for value, shown in ((0, False), (1, True))]
        assert (classes != 255).sum() > 100, index  # a crop of the image, not of its padding
        assert all(share > 0.85 for share in shares if not np.isnan(share)), (index, shares)  # nan: none of it


def test_predict_reads_each_image_as_displayed(data, fitted, tmp_path, monkeypatch, capsys):
    ckpt, _ = fitted
    given: list[torch.Tensor] = []
    predict_classes = SegmentationTask.predict_classes

    def recording(self, images):
        given.append(images.detach().cpu().clone())
        return predict_classes(self, images)

    monkeypatch.setattr(SegmentationTask, "predict_classes", recording)
    names = ["deep", "float", "portrait", "tagged"]
    files = [data / "images" / "train" / f"{name}{TRAIN[name][0]}" for name in names]
    out = tmp_path / "out"
    code, _, err = run_mabn(
        ["predict", str(ckpt), "--images", *map(str, files), "--out", str(out), "--num-workers", "0"], capsys
    )
    assert code == 0, err
    assert len(given) == len(names)
    for name, path, images in zip(names, files, given):
        width, height = TRAIN[name][1]
        assert np.asarray(Image.open(out / "masks" / f"{name}.png")).shape == (height, width), name
        assert _off(_pixels(images)[0], name) < _tolerance(name), name
        # The Python API reads a PIL image as the file is read.
        with Image.open(path) as image:
            assert _off(Segmenter.rgb(image).astype(np.float64), name) < _tolerance(name), name


def test_the_dry_run_says_how_it_reads_each_mode_and_the_turned_files(data, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    argv = ["segment", "--data", str(data), "--backbone", "none", "--dry-run", "--", *RUN]
    code, out, err = run_mabn(argv, capsys)
    assert code == 0, err
    train = data / "images" / "train"
    lines = [
        f"images of mode F (1 file, e.g. {train / 'float.tif'}): floating-point, scaled to 8 bits by each image's "
        "own range",
        f"images of mode I;16 (2 files, e.g. {train / 'deep.png'}): 16-bit, scaled to 8 bits by each image's own range",
        f"images of mode L (1 file, e.g. {train / 'grey.png'}): grey, the grey in each of the three channels",
        "4 images carry an EXIF orientation: read as displayed",  # 3 for training, 1 for validation
        "1 mask carries an EXIF orientation: read as displayed",
    ]
    printed = out.splitlines()
    assert lines[0] in printed, out
    start = printed.index(lines[0])
    assert printed[start : start + len(lines)] == lines


def test_the_dry_run_reads_one_file_of_each_mode(data, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    broken = shutil.copytree(data, tmp_path / "d")
    first = broken / "images" / "train" / "deep.png"  # the first 16-bit image: its header reads, its pixels do not
    first.write_bytes(first.read_bytes()[:-30])  # the end of its compressed pixels
    argv = ["segment", "--data", str(broken), "--backbone", "none", "--dry-run", "--", *RUN]
    code, _, err = run_mabn(argv, capsys)
    assert code == 2 and err.splitlines()[-1] == f"error: cannot read image file {first}: image file is truncated"


@pytest.mark.parametrize(
    ("mode", "values", "expected"),
    [
        ("I;16B", [300, 600, 900], [0, 128, 255]),  # big-endian 16-bit, not from 0
        ("I", [-70000, 0, 70000], [0, 128, 255]),  # 32-bit integers, negative ones too
        ("I;16", [4000, 4000, 4000], [0, 0, 0]),  # one value: 0, not a division by 0
        ("F", [0.5, float("nan"), 1.5], [0, 0, 255]),  # no number: 0, and not in the range
    ],
)
def test_more_than_8_bits_are_scaled_by_the_images_own_range(tmp_path, mode, values, expected):
    dtype = {"I;16B": ">u2", "I": "<i4", "I;16": "<u2", "F": "<f4"}[mode]
    path = tmp_path / "image.tif"
    Image.frombytes(mode, (3, 1), np.asarray([values], dtype).tobytes()).save(path)
    assert Image.open(path).mode == mode
    np.testing.assert_array_equal(read_image(path), np.repeat(np.uint8([expected])[..., None], 3, axis=2))


def test_a_float_tiff_is_read_in_a_small_multiple_of_its_size(tmp_path):
    """A float32 TIFF of 2048x2048 (16 MiB of pixels): the reader's own allocations at their peak (tracemalloc:
    numpy's and Python's; PIL's decoded pixels, 4 bytes a pixel, come on top) stay under 8 bytes a pixel for the
    picture (its values, the 8-bit grey and the RGB result: 5.5 measured) and 6 for the mask (its values: 4.2); the
    whole-image copies and float64 temporaries took 33 and 8. The minimum lies in the first rows and the maximum in
    the last, so the scaling spans the whole image, a NaN is 0, and the values are those of the formula."""
    height, width = 2048, 2048
    values = np.linspace(-3.0, 5.0, height * width, dtype=np.float32).reshape(height, width)
    values[1000, 7] = np.nan
    path = tmp_path / "float.tif"
    Image.fromarray(values, mode="F").save(path)
    for read, limit in ((lambda: read_values(path, "mask"), 6), (lambda: read_image(path), 8)):
        tracemalloc.start()
        try:
            out = read()
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak / values.size < limit, (peak / values.size, limit)
    np.testing.assert_array_equal(read_values(path, "mask"), values)
    wide = values.astype(np.float64)
    expected = np.rint(np.nan_to_num((wide + 3.0) * (255 / 8.0), nan=0.0)).astype(np.uint8)
    assert expected[0, 0] == 0 and expected[-1, -1] == 255 and expected[1000, 7] == 0
    np.testing.assert_array_equal(out, np.repeat(expected[..., None], 3, axis=2))
