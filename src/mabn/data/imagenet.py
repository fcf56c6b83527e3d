"""ImageNet-style classification data: ``train/<class>/*`` and ``val/<class>/*`` image folders."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import albumentations as A
import pytorch_lightning as pl
import torch
from albumentations.pytorch import ToTensorV2
from torch.utils.data import DataLoader, Dataset

from .errors import DatasetError
from .images import imagenet_normalize, read_image
from .loading import DataLayout, DataPlan, make_loader, node_devices

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp")
LAYOUT = "<data_dir>/train/<class>/<image> and <data_dir>/val/<class>/<image>"


def class_names(split_dir: Path) -> list[str]:
    """Sorted class folder names of one split, checked to exist and be non-empty."""
    if not split_dir.is_dir():
        raise DatasetError(f"missing split folder {split_dir} (expected {LAYOUT})")
    names = sorted(e.name for e in os.scandir(split_dir) if e.is_dir())
    if not names:
        raise DatasetError(f"split folder {split_dir} holds no class folders (expected {LAYOUT})")
    return names


def image_files(folder: Path) -> list[str]:
    """The images of one class folder, sorted; a DatasetError when it holds none."""
    files = sorted(e.path for e in os.scandir(folder) if e.name.lower().endswith(IMAGE_EXTENSIONS))
    if not files:
        raise DatasetError(f"class folder {folder} holds no images ({', '.join(IMAGE_EXTENSIONS)})")
    return files


class ImageFolder(Dataset):
    """Images of ``split_dir/<class>/*`` labelled by the index of their class in ``classes``."""

    def __init__(self, split_dir: Path, classes: list[str], transform: A.Compose) -> None:
        self.samples = [(f, label) for label, name in enumerate(classes) for f in image_files(split_dir / name)]
        self.transform = transform

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        path, label = self.samples[index]
        return self.transform(image=read_image(path))["image"], label


class ImageFolderDataModule(pl.LightningDataModule):
    """ImageNet folder layout with the standard augmentation.

    Training: random resized crop to ``image_size`` and horizontal flip; validation: resize the shorter
    side to ``val_resize`` and centre-crop ``image_size``. The train loader drops the last partial batch
    so every batch splits into whole ghost batches.

    Args:
        data_dir: the dataset's root folder, which holds ``train/<class>/`` and ``val/<class>/`` image folders.
        batch_size: images per device and step, for training and validation.
        num_workers: data loading processes per device; 0: load in the training process; null: the cores
            shared by the node's devices, at most 8 (``mabn.data.loading.default_workers``).
        image_size: the side in pixels of the square images the model sees (training and validation crops).
        val_resize: the length in pixels the shorter side of a validation image is resized to before its centre
            crop.
        crop_scale: the smallest and largest area of a random training crop, as fractions of the image's area.
    """

    layout = DataLayout(
        ("train", "val"),
        "No ImageNet given (DATA=...): expected train/<wnid>/*.JPEG and val/<wnid>/*.JPEG.\n"
        "Running the demo profile on generated data (configs/demo/pretrain.yaml).",
        "imagenet",
        name="imagenet",
    )
    # Init arguments that change how a run reads its data, not what it trains on (mabn.cli.plan.run_settings).
    run_settings = frozenset({"num_workers"})

    def __init__(
        self,
        data_dir: str,
        batch_size: int = 32,
        num_workers: int | None = None,
        image_size: int = 224,
        val_resize: int = 256,
        crop_scale: tuple[float, float] = (0.08, 1.0),
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.root = Path(data_dir)
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.classes = class_names(self.root / "train")
        val_classes = class_names(self.root / "val")
        if val_classes != self.classes:
            only_train = sorted(set(self.classes) - set(val_classes))[:5]
            only_val = sorted(set(val_classes) - set(self.classes))[:5]
            raise DatasetError(
                f"class folders differ between {self.root / 'train'} and {self.root / 'val'}: "
                f"only in train {only_train}, only in val {only_val}"
            )
        normalize = [imagenet_normalize(), ToTensorV2()]
        self.train_transform = A.Compose(
            [A.RandomResizedCrop((image_size, image_size), scale=crop_scale), A.HorizontalFlip(), *normalize]
        )
        self.val_transform = A.Compose(
            [A.SmallestMaxSize(max_size=val_resize), A.CenterCrop(image_size, image_size), *normalize]
        )

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @staticmethod
    def plan(args: Mapping[str, Any]) -> DataPlan:
        """``--dry-run``'s plan: the size of the training split the data module's ``args`` name, from file names
        alone."""
        split = Path(args["data_dir"]) / "train"
        return DataPlan(sum(len(image_files(split / name)) for name in class_names(split)), [])

    def setup(self, stage: str | None = None) -> None:
        self.train_set = ImageFolder(self.root / "train", self.classes, self.train_transform)
        self.val_set = ImageFolder(self.root / "val", self.classes, self.val_transform)

    def train_dataloader(self) -> DataLoader:
        return make_loader(self.train_set, self.batch_size, True, self.num_workers, node_devices(self.trainer))

    def val_dataloader(self) -> DataLoader:
        return make_loader(self.val_set, self.batch_size, False, self.num_workers, node_devices(self.trainer))
