"""A dataset of a layout the product does not know, added as a user adds one (docs/design.md, "Add a dataset"): a
module of their own with a data module subclass, named by class path (``--data.class_path``); nothing of ``src/``
is edited. The layout is Pascal VOC's: ``JPEGImages/<id>.jpg``, ``SegmentationClass/<id>.png`` (class indices,
255 on object borders) and ``ImageSets/Segmentation/<split>.txt`` listing a split's ids."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from mabn.data.classes import ClassTable
from mabn.data.errors import DatasetError
from mabn.data.folder import FolderDataModule, FolderDataset
from mabn.data.pairs import Sample

VOC_NAMES = (
    "background", "aeroplane", "bicycle", "bird", "boat", "bottle", "bus", "car", "cat", "chair", "cow",
    "diningtable", "dog", "horse", "motorbike", "person", "pottedplant", "sheep", "sofa", "train", "tvmonitor",
)  # fmt: skip


def _palette(count: int) -> list[list[int]]:
    """VOC's colour map: class i's bits spread over the high bits of R, G and B."""
    colors = []
    for i in range(count):
        r = g = b = 0
        c = i
        for j in range(8):
            r |= ((c >> 0) & 1) << (7 - j)
            g |= ((c >> 1) & 1) << (7 - j)
            b |= ((c >> 2) & 1) << (7 - j)
            c >>= 3
        colors.append([r, g, b])
    return colors


class VOCDataset(FolderDataset):
    """A split of the VOC layout under ``root``: the ids its list names, paired by id."""

    image_folder = "JPEGImages"
    prediction_masks = "SegmentationClass"

    @staticmethod
    def find_pairs(root: Path, split: str) -> list[Sample]:
        listing = Path(root) / "ImageSets" / "Segmentation" / f"{split}.txt"
        if not listing.is_file():
            raise DatasetError(f"missing split list {listing}")
        pairs = []
        for frame in listing.read_text().split():
            image, mask = Path(root, "JPEGImages", f"{frame}.jpg"), Path(root, "SegmentationClass", f"{frame}.png")
            if not (image.is_file() and mask.is_file()):
                raise DatasetError(f"{listing} names {frame}, but {image} or {mask} is missing")
            pairs.append(Sample(frame, image, mask))
        return pairs

    @classmethod
    def split_images(cls, root: Path, split: str) -> list[Path]:
        return [pair.image for pair in cls.find_pairs(root, split)]


class VOCDataModule(FolderDataModule):
    """VOC's 21 classes in VOC's layout."""

    dataset_class = VOCDataset
    fixed_classes = ClassTable.parse({"classes": list(VOC_NAMES), "colors": _palette(21)}, "VOC")


class NineteenDataModule(VOCDataModule):
    """A VOC-layout dataset of 19 classes of its own: as many as Cityscapes has, and none of its names."""

    fixed_classes = ClassTable.parse({"classes": [f"part{i}" for i in range(19)], "colors": _palette(19)}, "parts")


def generate(root: Path, classes: int, train: int = 4, val: int = 2, size: tuple[int, int] = (48, 64)) -> Path:
    """Write a VOC-layout dataset of ``train`` and ``val`` random JPEG images of ``size`` with masks of vertical
    bands of classes 0, 1 and ``classes - 1`` and a 255 border between them; returns ``root``."""
    rng = np.random.default_rng(0)
    height, width = size
    for folder in ("JPEGImages", "SegmentationClass", "ImageSets/Segmentation"):
        (root / folder).mkdir(parents=True, exist_ok=True)
    for split, count in (("train", train), ("val", val)):
        ids = [f"2007_{split}{i:03d}" for i in range(count)]
        for frame in ids:
            Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(
                root / "JPEGImages" / f"{frame}.jpg"
            )
            mask = np.zeros((height, width), np.uint8)
            mask[:, width // 3 :] = 1
            mask[:, 2 * width // 3 :] = classes - 1
            mask[:, width // 3] = 255
            Image.fromarray(mask).save(root / "SegmentationClass" / f"{frame}.png")
        (root / "ImageSets" / "Segmentation" / f"{split}.txt").write_text("\n".join(ids) + "\n")
    return root
