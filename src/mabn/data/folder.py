"""A segmentation dataset of the user's own, in one folder: what ``python -m mabn segment --data DIR`` trains on
(docs/your-data.md).

Layout::

    DIR/classes.yaml                    the classes (``mabn.data.classes``)
    DIR/images/<split>/<name>.<ext>     .png, .jpg, .jpeg, .bmp, .tif, .tiff or .webp, any mode (read as RGB)
    DIR/masks/<split>/<name>.png        one PNG per image, of the image's size: single-channel mask values, or
                                        the class colours with ``mask_format: color``

for the splits ``train`` and ``val``. An image and its mask pair by their path below the split folder without
the suffix (``images/val/a/x.jpg`` and ``masks/val/a/x.png``). The recipe is stage 2's (``CityscapesDataModule``'s
augmentation, batches, loaders and crop): a training image smaller than the crop is padded up to it as the
augmentation pads (the image with the mean pixel, the mask with ignored pixels), and ``small_images`` says how
many are.

What is checked when: ``classes.yaml`` when the data module is made (``--dry-run`` included); that every image
has its mask and the reverse, and their sizes (from the files' headers, no pixel decoded), when a split is
indexed (the training split also by ``--dry-run``); a mask's values when the mask is first read, and then the
whole split is scanned to say how many masks hold values (colours) of no class.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cached_property
from pathlib import Path
from typing import Any

import albumentations as A
import numpy as np

from ..distributed import say
from .cityscapes import (
    CityscapesDataModule,
    CityscapesDataset,
    CityscapesSample,
)
from .classes import CLASSES_FILE, COLOR, ClassTable
from .errors import DatasetError, require_pairs
from .images import image_size, imagenet_normalize, read_image

__all__ = ["FolderDataModule", "FolderDataset", "find_pairs", "small_images"]

IMAGES, MASKS = "images", "masks"
IMAGE_TYPES = (".png", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff", ".webp")
MASK_TYPE = ".png"
LAYOUT = f"DIR/{IMAGES}/<split>/<name>.<png|jpg|...> with masks DIR/{MASKS}/<split>/<name>.png and DIR/{CLASSES_FILE}"


def _files(folder: Path, suffixes: tuple[str, ...]) -> dict[str, Path]:
    """The files below ``folder`` with one of ``suffixes`` (any case; hidden files left out), by their path
    below ``folder`` without the suffix; two files of one such name are an error."""
    found: dict[str, Path] = {}
    for path in sorted(folder.rglob("*")):
        if path.suffix.lower() not in suffixes or path.name.startswith(".") or not path.is_file():
            continue
        key = path.relative_to(folder).with_suffix("").as_posix()
        if key in found:
            raise DatasetError(f"{found[key]} and {path} have the same name: one mask pairs with one image")
        found[key] = path
    return found


def find_pairs(root: str | Path, split: str) -> list[CityscapesSample]:
    """The image/mask pairs of ``split`` in sorted order, as ``(name, image, mask)``; ``DatasetError`` naming the
    folder or the first file for a missing split folder, a split without images, an image without its mask or a
    mask without its image (with how many)."""
    root = Path(root)
    image_dir, mask_dir = root / IMAGES / split, root / MASKS / split
    for folder in (image_dir, mask_dir):
        if not folder.is_dir():
            raise DatasetError(f"missing folder {folder}; expected {LAYOUT}")
    images, masks = _files(image_dir, IMAGE_TYPES), _files(mask_dir, (MASK_TYPE,))
    if not images:
        raise DatasetError(f"no images ({', '.join(IMAGE_TYPES)}) in {image_dir}; expected {LAYOUT}")
    require_pairs(
        images,
        masks,
        lambda key, n: (
            f"image {images[key]} has no mask {mask_dir / (key + MASK_TYPE)} "
            f"({n} image(s) without masks in {image_dir})"
        ),
        lambda key, n: (
            f"mask {masks[key]} has no image {image_dir / key}.<{'|'.join(t[1:] for t in IMAGE_TYPES)}> "
            f"({n} mask(s) without images in {mask_dir})"
        ),
    )
    return [CityscapesSample(Path(key).name, images[key], masks[key]) for key in sorted(images)]


def pair_sizes(samples: list[CityscapesSample], image_dir: Path) -> list[tuple[int, int]]:
    """The (width, height) of each pair's image, read from the headers; ``DatasetError`` naming the first pair
    whose mask has another size, and how many do."""
    sizes, mismatched = [], []
    for sample in samples:
        image, mask = image_size(sample.image), image_size(sample.label, "mask")
        sizes.append(image)
        if image != mask:
            mismatched.append((sample, image, mask))
    if mismatched:
        sample, (iw, ih), (mw, mh) = mismatched[0]
        raise DatasetError(
            f"size mismatch: image {sample.image} is {iw}x{ih} but mask {sample.label} is {mw}x{mh} (WxH) "
            f"({len(mismatched)} of the {len(samples)} pairs in {image_dir} differ)"
        )
    return sizes


def small_images(sizes: list[tuple[int, int]], crop_size: int) -> tuple[int, str]:
    """(how many of the training images of ``sizes`` (width, height) are narrower or lower than the crop, and so
    padded up to it; the line that says so)."""
    count = sum(1 for width, height in sizes if min(width, height) < crop_size)
    line = f"{count} of the {len(sizes)} training images are smaller than the crop {crop_size}x{crop_size}"
    return count, line + (": padded up to it (images with the mean pixel, masks with ignored pixels)" if count else "")


class FolderDataset(CityscapesDataset):
    """The ``split`` of a dataset in the layout of this module under ``root``, yielding normalized images and class
    maps: items as ``CityscapesDataset``'s (3xHxW float32, HxW int64 class indices with 255 for ignored pixels),
    the mask values (or colours) mapped to classes by ``classes`` (``ClassTable.classes_of``). ``sizes[i]`` is
    item ``i``'s (width, height)."""

    def __init__(
        self,
        root: str | Path,
        split: str,
        classes: ClassTable,
        transform: A.BasicTransform | A.Compose | None = None,
    ) -> None:
        self.root, self.split, self.classes, self.transform = Path(root), split, classes, transform
        self.samples = find_pairs(self.root, split)
        self.sizes = pair_sizes(self.samples, self.root / IMAGES / split)
        self._normalize = imagenet_normalize()

    def read_mask(self, path: Path) -> np.ndarray:
        """The mask's values (H x W), or its RGB colours (H x W x 3) for colour masks."""
        if self.classes.mask_format == COLOR:
            return read_image(path, "mask")
        mask = read_image(path, "mask", mode=None)
        if mask.ndim != 2:
            raise DatasetError(
                f"mask file {path} has shape {mask.shape}; expected a single-channel PNG of mask values "
                "(greyscale or palette), not a colour image"
            )
        return mask

    def read_pair(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """The raw item: uint8 RGB image HxWx3 and uint8 class map HxW."""
        sample = self.samples[index]
        image = read_image(sample.image)
        mask = self.read_mask(sample.label)
        if image.shape[:2] != mask.shape[:2]:  # the files changed since they were indexed
            (ih, iw), (mh, mw) = image.shape[:2], mask.shape[:2]
            raise DatasetError(
                f"size mismatch: image {sample.image} is {iw}x{ih} but mask {sample.label} is {mw}x{mh} (WxH)"
            )
        classes, unknown = self.classes.classes_of(mask)
        if unknown.size:
            raise self.unknown_values()
        return image, classes

    def unknown_values(self) -> DatasetError:
        """The error for mask values (colours) of no class: the first mask of the split (in sorted order) that
        holds one, its values, and how many of the split's masks do (a scan of the whole split, on this error
        only)."""
        first, count = None, 0
        for sample in self.samples:
            _, unknown = self.classes.classes_of(self.read_mask(sample.label))
            if unknown.size:
                count += 1
                first = first or (sample.label, unknown)
        assert first is not None, "called without a mask holding an unknown value"
        path, values = first
        return DatasetError(
            f"mask {path} holds {self.classes.describe_unknown(values)}; {count} of the {len(self.samples)} masks "
            f"in {self.root / MASKS / self.split} hold such {self.classes.mask_unit}"
        )


class FolderDataModule(CityscapesDataModule):
    """Stage 2 on a dataset in the layout of this module under ``data_dir``, with the Cityscapes recipe: the same
    arguments, augmentation (``train_transform``), batches over devices and loaders as ``CityscapesDataModule``.

    The classes come from ``data_dir/classes.yaml``: ``num_classes`` (linked to the model's) and ``class_names``
    (the validation tables) are read from it when the module is made. The crop is ``crop_size`` whatever the
    images' sizes: smaller training images are padded up to it, and a fit says how many are (``small_images``,
    as ``--dry-run`` does). The class table and the crop are kept in the module's hyperparameters (``classes``,
    ``crop_size``), which Lightning writes into every checkpoint: what ``python -m mabn test`` and ``predict``
    read.
    """

    @cached_property
    def classes(self) -> ClassTable:
        return ClassTable.read(Path(self.data_dir) / CLASSES_FILE)

    @property
    def num_classes(self) -> int:  # type: ignore[override]
        return len(self.classes.names)

    @property
    def class_names(self) -> tuple[str, ...]:  # type: ignore[override]
        return self.classes.names

    def setup(self, stage: str | None = None) -> None:
        self.hparams["classes"] = self.classes.as_dict()
        super().setup(stage)

    def make_dataset(self, split: str, train: bool) -> FolderDataset:
        dataset = FolderDataset(self.data_dir, split, self.classes)
        if train:
            count, line = small_images(dataset.sizes, self.crop_size)
            if count:  # a fit speaks of padding only where there is some; a dry run always says the count
                say(line)
            dataset.transform = self.augmentation()
        return dataset

    @staticmethod
    def train_samples(args: Mapping[str, Any]) -> int:
        """The size of the training split, from file names alone; the classes file is parsed too, so that
        ``--dry-run`` and the check before a run refuse one that does not parse."""
        root = Path(args["data_dir"])
        ClassTable.read(root / CLASSES_FILE)
        return len(find_pairs(root, args.get("train_split") or "train"))

    @staticmethod
    def plan_lines(args: Mapping[str, Any]) -> list[str]:
        """What ``--dry-run`` says of the training images: how many are smaller than the crop (``small_images``),
        from the files' headers, which are checked to give each mask its image's size."""
        root, split = Path(args["data_dir"]), args.get("train_split") or "train"
        sizes = pair_sizes(find_pairs(root, split), root / IMAGES / split)
        return [small_images(sizes, args["crop_size"])[1]]
