"""Cityscapes fine annotations (19 training classes) with the hszhao/semseg PSPNet augmentation.

Reads the official layout directly: ``*_gtFine_labelIds.png`` files are mapped to trainIds on the fly, so no
``csCreateTrainIdLabelImgs`` preprocessing step is needed.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import albumentations as A
import cv2
import numpy as np
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, Dataset
from torchvision.datasets import Cityscapes

from ..distributed import rank
from ..run import device_batch
from .errors import DatasetError, require_pairs
from .images import IMAGENET_MEAN, imagenet_normalize, read_image, read_values
from .loading import DataPlan, augmentation_seed, make_loader

__all__ = [
    "CLASS_NAMES",
    "IGNORE_INDEX",
    "NUM_CLASSES",
    "TRAIN_ID_COLORS",
    "TRAIN_TO_LABEL_ID",
    "CityscapesDataModule",
    "CityscapesDataset",
    "CityscapesSample",
    "DatasetError",
    "label_ids_to_train_ids",
    "train_transform",
]

IGNORE_INDEX = 255
# Padding the uint8 image with the mean pixel makes padded areas exactly 0 after normalization (as hszhao pads).
MEAN_PIXEL = tuple(255.0 * m for m in IMAGENET_MEAN)
IMAGE_SUFFIX = "_leftImg8bit.png"
LABEL_SUFFIX = "_gtFine_labelIds.png"
LAYOUT = (
    "<root>/leftImg8bit/<split>/<city>/<city>_<seq>_<frame>_leftImg8bit.png with labels in "
    "<root>/gtFine/<split>/<city>/<city>_<seq>_<frame>_gtFine_labelIds.png"
)


# The one Cityscapes table (torchvision's list of the 34 labelIds): every name, id, trainId and colour below is
# read from it. trainId 255 marks the classes ignored in evaluation, -1 the license plate (labelId -1).
LABEL_IDS = {cls.name: cls.id for cls in Cityscapes.classes}
_EVALUATED = sorted((cls for cls in Cityscapes.classes if 0 <= cls.train_id < IGNORE_INDEX), key=lambda c: c.train_id)
CLASS_NAMES = tuple(cls.name for cls in _EVALUATED)
NUM_CLASSES = len(CLASS_NAMES)
MAX_LABEL_ID = max(cls.id for cls in Cityscapes.classes)  # 33: labelIds above it are in no Cityscapes table
TRAIN_TO_LABEL_ID = np.array([cls.id for cls in _EVALUATED], dtype=np.uint8)
TRAIN_ID_COLORS = np.array([cls.color for cls in _EVALUATED], dtype=np.uint8)
# labelId -> trainId for every uint8 value; any id but the 19 evaluated classes' is ignored.
TRAIN_ID_LUT = np.full(256, IGNORE_INDEX, dtype=np.uint8)
TRAIN_ID_LUT[TRAIN_TO_LABEL_ID] = np.arange(NUM_CLASSES, dtype=np.uint8)


def label_ids_to_train_ids(label: np.ndarray) -> np.ndarray:
    """Map Cityscapes labelIds to trainIds 0..18 as uint8, via a 256-entry lookup table.

    Every id that is not one of the 19 evaluated classes maps to ``IGNORE_INDEX`` (255): the void and
    ignored-in-eval classes, the license plate, and any value not in the Cityscapes table at all
    (including negative or >255 values of wider integer arrays).
    """
    label = np.asarray(label)
    if label.dtype == np.uint8:
        return TRAIN_ID_LUT[label]
    if not np.issubdtype(label.dtype, np.integer):
        raise TypeError(f"labelIds must be an integer array, got dtype {label.dtype}")
    train = np.full(label.shape, IGNORE_INDEX, dtype=np.uint8)
    known = (label >= 0) & (label < TRAIN_ID_LUT.size)
    train[known] = TRAIN_ID_LUT[label[known]]
    return train


class CityscapesSample(NamedTuple):
    """One image/label pair; ``name`` is ``<city>_<seq>_<frame>``, the official frame id."""

    name: str
    image: Path
    label: Path


def find_samples(root: str | Path, split: str) -> list[CityscapesSample]:
    """All image/label pairs of a split, sorted by city and frame, paired by file name.

    Raises ``DatasetError`` naming the folder or file for a missing split folder, an empty split, or an
    image without its label file (or the reverse).
    """
    root = Path(root)
    image_dir, label_dir = root / "leftImg8bit" / split, root / "gtFine" / split
    for folder in (image_dir, label_dir):
        if not folder.is_dir():
            raise DatasetError(f"missing Cityscapes folder {folder}; expected the official layout {LAYOUT}")
    images = {
        p.relative_to(image_dir).as_posix()[: -len(IMAGE_SUFFIX)]: p for p in image_dir.glob(f"*/*{IMAGE_SUFFIX}")
    }
    labels = {
        p.relative_to(label_dir).as_posix()[: -len(LABEL_SUFFIX)]: p for p in label_dir.glob(f"*/*{LABEL_SUFFIX}")
    }
    if not images:
        raise DatasetError(f"no images matching <city>/*{IMAGE_SUFFIX} in {image_dir}; expected {LAYOUT}")
    require_pairs(
        images,
        labels,
        lambda key, n: (
            f"image {images[key]} has no label file {label_dir / (key + LABEL_SUFFIX)} "
            f"({n} image(s) without labels in {image_dir})"
        ),
        lambda key, n: (
            f"label {labels[key]} has no image file {image_dir / (key + IMAGE_SUFFIX)} "
            f"({n} label(s) without images in {label_dir})"
        ),
    )
    return [CityscapesSample(Path(key).name, images[key], labels[key]) for key in sorted(images)]


class CityscapesDataset(Dataset):
    """Cityscapes ``split`` under ``root`` in the official layout, yielding normalized images and trainIds.

    Items are ``(image, label)``: a float32 tensor 3xHxW normalized with the ImageNet mean/std and an int64
    tensor HxW of trainIds 0..18 with ``IGNORE_INDEX`` (255) for unlabeled pixels. ``transform`` is an
    albumentations-style callable applied to ``image=`` (uint8 HxWx3 RGB) and ``mask=`` (uint8 trainIds)
    before normalization, e.g. :func:`train_transform`; ``None`` keeps the full image. ``samples[i]`` names
    the files of item ``i``.
    """

    def __init__(self, root: str | Path, split: str, transform: A.BasicTransform | A.Compose | None = None) -> None:
        self.root = Path(root)
        self.split = split
        self.transform = transform
        self.samples = find_samples(self.root, split)
        self._normalize = imagenet_normalize()

    def __len__(self) -> int:
        return len(self.samples)

    def read_pair(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """The raw item: uint8 RGB image HxWx3 and uint8 trainId label HxW, checked to have the same size."""
        sample = self.samples[index]
        image = read_image(sample.image)
        label = read_values(sample.label, "label")
        if label.ndim != 2:
            raise DatasetError(
                f"label file {sample.label} has shape {label.shape}; expected a single-channel labelIds PNG"
            )
        if image.shape[:2] != label.shape:
            (ih, iw), (lh, lw) = image.shape[:2], label.shape
            raise DatasetError(
                f"size mismatch: image {sample.image} is {iw}x{ih} but label {sample.label} is {lw}x{lh} (WxH)"
            )
        train = label_ids_to_train_ids(label)
        if not (train != IGNORE_INDEX).any() and label.max() > MAX_LABEL_ID:
            unknown = np.unique(label[label > MAX_LABEL_ID])
            raise DatasetError(
                f"label file {sample.label} holds no Cityscapes class: its ids {unknown[:5].tolist()} are outside "
                f"the labelIds 0..{MAX_LABEL_ID} (expected *{LABEL_SUFFIX}, not a trainIds or colour image)"
            )
        return image, train

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        image, label = self.read_pair(index)
        if self.transform is not None:
            out = self.transform(image=image, mask=label)
            image, label = out["image"], out["mask"]
        image = self._normalize(image=image)["image"]
        return torch.from_numpy(np.ascontiguousarray(image.transpose(2, 0, 1))), torch.from_numpy(
            label.astype(np.int64)
        )


def train_transform(
    crop_size: int = 713,
    scale_range: tuple[float, float] = (0.5, 2.0),
    rotate_limit: float = 10.0,
    blur_p: float = 0.5,
    seed: int | None = None,
) -> A.Compose:
    """The hszhao/semseg PSPNet training augmentation (before normalization), in its order.

    Random scale in ``scale_range`` (image bilinear, mask nearest) -> rotation within +-``rotate_limit``
    degrees with p 0.5 (image padded with the mean pixel, mask with 255) -> 5x5 Gaussian blur with p
    ``blur_p`` -> horizontal flip -> centred pad to ``crop_size`` (mean / 255) -> random ``crop_size`` crop.

    The default crop is the paper's (and hszhao's) 713: PSPNet takes any input size (its encoder at output
    stride 8 gives 90x90 features for 713, and both heads upsample to the input size).
    """
    low, high = scale_range
    return A.Compose(
        [
            # RandomScale samples from 1 + scale_limit.
            A.RandomScale(
                scale_limit=(low - 1.0, high - 1.0),
                interpolation=cv2.INTER_LINEAR,
                mask_interpolation=cv2.INTER_NEAREST,
                p=1.0,
            ),
            A.Rotate(
                limit=(-rotate_limit, rotate_limit),
                interpolation=cv2.INTER_LINEAR,
                mask_interpolation=cv2.INTER_NEAREST,
                border_mode=cv2.BORDER_CONSTANT,
                fill=MEAN_PIXEL,
                fill_mask=IGNORE_INDEX,
                p=0.5,
            ),
            # hszhao calls cv2.GaussianBlur(img, (5, 5), 0); OpenCV derives sigma 1.1 for a 5-tap kernel.
            A.GaussianBlur(blur_limit=(5, 5), sigma_limit=(1.1, 1.1), p=blur_p),
            A.HorizontalFlip(p=0.5),
            A.PadIfNeeded(
                min_height=crop_size,
                min_width=crop_size,
                position="center",
                border_mode=cv2.BORDER_CONSTANT,
                fill=MEAN_PIXEL,
                fill_mask=IGNORE_INDEX,
            ),
            A.RandomCrop(height=crop_size, width=crop_size),
        ],
        seed=seed,
    )


class CityscapesDataModule(pl.LightningDataModule):
    """Cityscapes fine train/val in the official layout under ``data_dir``, with the hszhao/semseg recipe.

    Training batches are ``batch_size`` (per device) random ``crop_size`` crops; with ``global_batch_size`` the
    per-device batch is its share instead, by the rule of ``mabn.run.scaling.device_batch`` with the model's
    normalization batch. The train loader shuffles and drops the last partial batch so every batch splits into
    whole ghost batches. Validation yields
    full, untransformed images (``val_batch_size`` 1 by default) for sliding-window evaluation.

    Args:
        data_dir: the dataset's root folder, which holds ``leftImg8bit/`` and ``gtFine/`` (the official layout).
        crop_size: the side in pixels of the square random training crops; smaller images are padded up to it.
        batch_size: training crops per device and step (replaced by the share of ``global_batch_size`` if set).
        val_batch_size: full images per device and validation step.
        num_workers: data loading processes per device; 0: load in the training process.
        scale_range: the lowest and highest factor of the random training rescale, before the crop.
        rotate_limit: the largest random training rotation, in degrees either way (applied with p 0.5).
        blur_p: the probability of a 5x5 Gaussian blur of a training image.
        train_split: the split folder trained on, below ``leftImg8bit/`` and ``gtFine/``.
        val_split: the split folder validated on.
        global_batch_size: the largest training batch over all devices: each device takes its share, in whole
            normalization batches (never under one); null: ``batch_size`` per device.
    """

    num_classes: int = NUM_CLASSES
    class_names: tuple[str, ...] = CLASS_NAMES

    def __init__(
        self,
        data_dir: str,
        crop_size: int = 713,
        batch_size: int = 2,
        val_batch_size: int = 1,
        num_workers: int = 4,
        scale_range: tuple[float, float] = (0.5, 2.0),
        rotate_limit: float = 10.0,
        blur_p: float = 0.5,
        train_split: str = "train",
        val_split: str = "val",
        global_batch_size: int | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.data_dir = data_dir
        self.crop_size = crop_size
        self.batch_size = batch_size
        self.val_batch_size = val_batch_size
        self.num_workers = num_workers
        self.scale_range = scale_range
        self.rotate_limit = rotate_limit
        self.blur_p = blur_p
        self.train_split = train_split
        self.val_split = val_split
        self.global_batch_size = global_batch_size
        self.train_set: CityscapesDataset | None = None
        self.val_set: CityscapesDataset | None = None

    def setup(self, stage: str | None = None) -> None:
        """Index the splits the stage needs; raises ``DatasetError`` if the layout is missing or broken."""
        if self.global_batch_size:
            world = self.trainer.world_size if self.trainer is not None else 1
            module = self.trainer.lightning_module if self.trainer is not None else None
            norm_batch = module.hparams.get("norm_batch_size") if module is not None else None
            self.batch_size = device_batch(self.global_batch_size, world, norm_batch)
        if stage in (None, "fit"):
            self.train_set = self.make_dataset(self.train_split, train=True)
        if stage in (None, "fit", "validate"):
            self.val_set = self.make_dataset(self.val_split, train=False)

    def make_dataset(self, split: str, train: bool) -> CityscapesDataset:
        """The dataset of ``split``: with the training augmentation (``train_transform`` at ``crop_size``) when
        ``train``, full images otherwise. Data modules of other layouts override this."""
        return CityscapesDataset(self.data_dir, split, self.augmentation() if train else None)

    def augmentation(self) -> A.Compose:
        """``train_transform`` with this module's settings, seeded from torch so that seed_everything also fixes
        the augmentations with num_workers=0."""
        return train_transform(
            self.crop_size, self.scale_range, self.rotate_limit, self.blur_p, seed=augmentation_seed(rank())
        )

    @staticmethod
    def plan(args: Mapping[str, Any]) -> DataPlan:
        """``--dry-run``'s plan: the size of the training split the data module's ``args`` name, from file names
        alone."""
        return DataPlan(len(find_samples(args["data_dir"], args.get("train_split") or "train")), [])

    def _loader(self, dataset: CityscapesDataset | None, batch_size: int, train: bool) -> DataLoader:
        if dataset is None:
            raise RuntimeError("call setup() before asking for a dataloader")
        return make_loader(dataset, batch_size, train, self.num_workers)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, self.batch_size, train=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, self.val_batch_size, train=False)
