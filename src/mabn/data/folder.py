"""Segmentation datasets: the base of every one (``FolderDataset``, ``FolderDataModule``: reading, the crop, the
recipe's augmentation and loaders, over the modules of one concern each: ``pairs``, ``masks``, ``check``,
``augment``, ``loading``), in the layout of a dataset of the
user's own, in one folder: what ``python -m mabn segment --data DIR`` trains on (docs/your-data.md). A dataset of
another layout is a subclass that names its layout, its ids and its classes (``mabn.data.cityscapes``).

Layout::

    DIR/classes.yaml                    the classes (``mabn.data.classes``)
    DIR/images/<split>/<name>.<ext>     .png, .jpg, .jpeg, .bmp, .tif, .tiff or .webp, any mode (read as displayed)
    DIR/masks/<split>/<name>.png        one PNG per image, of the image's size: single-channel mask values, or
                                        the class colours with ``mask_format: color``

for the splits ``train`` and ``val``. An image and its mask pair by their path below the split folder without
the suffix (``images/val/a/x.jpg`` and ``masks/val/a/x.png``). The recipe is stage 2's (``train_transform``'s
augmentation, ``FolderDataModule``'s batches, loaders and crop): a training image smaller than the crop is padded
up to it as the augmentation pads (the image with the mean pixel, the mask with ignored pixels), and
``small_images`` says how many are.

What is checked when: ``--dry-run`` checks the whole dataset (``check_dataset``) and names every problem at once,
one line per kind: ``classes.yaml``; for both splits the folders, that every image has its PNG mask and the reverse,
the sizes (from the files' headers, no pixel decoded) and every mask's values (decoded, in worker processes for many
masks); and that the training images fill one global batch. A fit checks ``classes.yaml`` when the data module is
made, then each split's pairs and sizes as it is indexed and its mask values before the first step (stopping at the
first problem). A fit records the masks its scan found clean in a file of the user's cache directory
(``mabn.data.masks.MaskCache``: never in the data folder), so that later dry runs and fits decode only new or
changed masks; a dry run reads it and, writing nothing, decodes each other mask once. A mask read during the fit
that holds a value of no class ends it with the same line, whatever the cache said. The pass over the mask values
also counts each mask's pixels per class, kept in the cache with its verdict: the dry run prints each class's share
of the training pixels, with a warning line for a class of none and for ignored pixels of more than half
(``ClassPixels``).
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cached_property
from pathlib import Path
from typing import Any

import albumentations as A
import numpy as np
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, Dataset

from ..distributed import say
from ..run import per_device_batch
from .augment import train_transform
from .check import check_dataset, data_crop, reading_lines, small_images
from .classes import CLASSES_FILE, ClassTable
from .errors import DatasetError
from .images import imagenet_normalize, read_image
from .loading import DataLayout, DataPlan, make_loader, node_devices
from .masks import ClassPixels, read_mask, unknown_line, unknown_masks, unknown_values
from .pairs import IMAGES, MASK_EXPECTED, MASK_TERM, MASK_TYPE, MASKS, Sample, find_pairs, pair_sizes

__all__ = ["FolderDataModule", "FolderDataset"]


class FolderDataset(Dataset):
    """The ``split`` of a segmentation dataset under ``root``, yielding normalized images and class maps: the base
    of every segmentation dataset, in the layout of this module. A dataset of another layout names it on top
    (``mabn.data.cityscapes``): its pairing (``find_pairs``), what its messages call a mask (``mask_term``,
    ``mask_expected``), whether indexing reads the sizes (``index_sizes``) and how its mask values map to classes
    (``class_map``).

    Items are ``(image, label)``: a float32 tensor 3xHxW normalized with the ImageNet mean/std and an int64 tensor
    HxW of class indices with ``IGNORE_INDEX`` (255) for ignored pixels, the mask values (or colours) mapped to
    classes by ``classes`` (``ClassTable.classes_of``). ``transform`` is an albumentations-style callable applied to
    ``image=`` (uint8 HxWx3 RGB) and ``mask=`` (uint8 class map) before normalization, e.g. :func:`train_transform`;
    ``None`` keeps the full image. ``samples[i]`` names the files of item ``i``; ``sizes[i]`` is its (width,
    height), read from the headers when the split is indexed (None where ``index_sizes`` is off).
    """

    image_folder = IMAGES  # the folder of the images below the root, which holds the split folders
    mask_term, mask_expected = MASK_TERM, MASK_EXPECTED
    # Where ``python -m mabn predict`` writes a frame's mask in the dataset's values, below its output folder, and
    # what a split's predictions are scored with there ("" where the dataset names no scorer).
    prediction_masks = MASKS
    prediction_scorer = ""
    # Whether indexing a split reads every pair's size from the headers, so that a mask of another size than its
    # image is named before the first step (its pair is checked when it is read either way).
    index_sizes = True

    def __init__(
        self,
        root: str | Path,
        split: str,
        classes: ClassTable,
        transform: A.BasicTransform | A.Compose | None = None,
    ) -> None:
        self.root, self.split, self.classes, self.transform = Path(root), split, classes, transform
        self.samples = self.find_pairs(self.root, split)
        self.sizes: list[tuple[int, int]] | None = None
        if self.index_sizes:
            self.sizes = self.image_sizes()
        self._normalize = imagenet_normalize()

    @staticmethod
    def find_pairs(root: Path, split: str) -> list[Sample]:
        """The image/mask pairs of ``split`` under ``root`` in sorted order; ``DatasetError`` for the first problem
        of the layout."""
        return find_pairs(root, split)

    @classmethod
    def split_images(cls, root: Path, split: str) -> list[Path]:
        """What ``predict --split`` predicts of ``split`` under ``root``: folders or image files (the split's folder
        of images, searched recursively)."""
        return [root / cls.image_folder / split]

    @staticmethod
    def frame_name(image: Path) -> str:
        """The frame an image file holds, which names its prediction files: the file's stem."""
        return image.stem

    @classmethod
    def mask_file(cls, frame: str) -> Path:
        """The mask prediction of ``frame`` below the output folder, as the dataset's own masks are named."""
        return Path(cls.prediction_masks, f"{frame}{MASK_TYPE}")

    def image_sizes(self) -> list[tuple[int, int]]:
        """``sizes``, read from the headers now where indexing did not read them; ``DatasetError`` for an unreadable
        file or a mask of another size than its image (``pair_sizes``)."""
        if self.sizes is not None:
            return self.sizes
        return pair_sizes(self.samples, self.root / self.image_folder / self.split)

    @property
    def class_names(self) -> tuple[str, ...]:
        """The classes' names in index order: what a task evaluating this dataset names in its tables."""
        return self.classes.names

    def __len__(self) -> int:
        return len(self.samples)

    def read_pair(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """The raw item: uint8 RGB image HxWx3 and uint8 class map HxW, checked to have the same size."""
        sample = self.samples[index]
        image = read_image(sample.image)
        mask = read_mask(sample.label, self.classes, self.mask_term, self.mask_expected)
        if image.shape[:2] != mask.shape[:2]:  # sizes not indexed, or the files changed since
            (ih, iw), (mh, mw) = image.shape[:2], mask.shape[:2]
            raise DatasetError(
                f"size mismatch: image {sample.image} is {iw}x{ih} but {self.mask_term} {sample.label} is "
                f"{mw}x{mh} (WxH)"
            )
        return image, self.class_map(mask, sample.label)

    def class_map(self, mask: np.ndarray, path: Path) -> np.ndarray:
        """The uint8 class map of the mask read from ``path`` (``ClassTable.classes_of``); a value (colour) of no
        class is an error naming the file (``unknown_values``)."""
        classes, unknown = self.classes.classes_of(mask)
        if unknown.size:
            raise self.unknown_values(path, unknown)
        return classes

    def unknown_values(self, path: Path, values: np.ndarray) -> DatasetError:
        """The error for the values (colours) ``values`` of no class that the mask at ``path`` holds, naming it
        first, with how many of the split's masks hold such values (a scan of the others, on this error only:
        ``FolderDataModule`` scans before a fit, so this is met by files changed since, or by a mask its cache
        vouched for)."""
        scanned = unknown_masks(self.root, self.samples, self.classes, save=False)[0]
        others = [bad for bad in scanned if bad[0] != path]
        bad = [(path, values), *others]
        return DatasetError(unknown_line(self.root, self.split, self.classes, bad, len(self.samples)))

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        image, label = self.read_pair(index)
        if self.transform is not None:
            out = self.transform(image=image, mask=label)
            image, label = out["image"], out["mask"]
        image = self._normalize(image=image)["image"]
        return torch.from_numpy(np.ascontiguousarray(image.transpose(2, 0, 1))), torch.from_numpy(
            label.astype(np.int64)
        )


class FolderDataModule(pl.LightningDataModule):
    """Stage 2's data: the train and val splits of a segmentation dataset under ``data_dir``, with the hszhao/semseg
    PSPNet recipe; the base of every segmentation data module, in the layout of this module (a dataset of one's
    own). A dataset of another layout names it on top (``mabn.data.cityscapes``): its dataset (``dataset``), its
    classes where it fixes them (``fixed_classes``), its default crop and its dry-run plan.

    Training batches are ``batch_size`` (per device) random ``crop_size`` crops (``train_transform``); with
    ``global_batch_size`` the per-device batch is its share instead, by the rule of ``mabn.run.scaling.device_batch``
    with the model's normalization batch. The train loader shuffles and drops the last partial batch so every batch
    splits into whole ghost batches. Validation yields full, untransformed images (``val_batch_size`` 1 by default)
    for sliding-window evaluation.

    The classes come from ``data_dir/classes.yaml``: ``num_classes`` (linked to the model's) and ``class_names``
    (the validation tables) are read from it when the module is made. The crop is ``crop_size``, or where that is
    null one from the training images' sizes (``data_crop``), decided when the module is set up; smaller training
    images are padded up to it, and a fit says how many are (``small_images``, as ``--dry-run`` does). The class
    table and the crop are kept in the module's hyperparameters (``classes``, ``crop_size``), which Lightning writes
    into every checkpoint: what ``python -m mabn test`` and ``predict`` read. ``class_pixels``: the training split's
    pixels per class (``ClassPixels``), counted by the check of its masks when the module is set up for a fit (None
    before, and for classes a dataset fixes, whose masks are not checked).

    Args:
        data_dir: the dataset's folder, which holds ``classes.yaml``, ``images/<split>/`` and ``masks/<split>/``
            (docs/your-data.md).
        crop_size: the side in pixels of the square random training crops; null (configs/segment.yaml): from the
            data, the recipe's 713 where the median training image's shorter side holds it, else the largest
            multiple of 8 within that side. Smaller images are padded up to it.
        batch_size: training crops per device and step (replaced by the share of ``global_batch_size`` if set).
        val_batch_size: full images per device and validation step.
        num_workers: data loading processes per device; 0: load in the training process; null: the cores
            shared by the node's devices, at most 8 (``mabn.data.loading.default_workers``).
        scale_range: the lowest and highest factor of the random training rescale, before the crop.
        rotate_limit: the largest random training rotation, in degrees either way (applied with p 0.5).
        blur_p: the probability of a 5x5 Gaussian blur of a training image.
        train_split: the split folder trained on, below the image and mask folders (``images/`` and ``masks/``;
            Cityscapes: ``leftImg8bit/`` and ``gtFine/``).
        val_split: the split folder validated on, below the image and mask folders.
        global_batch_size: the largest training batch over all devices: each device takes its share, in whole
            normalization batches (never under one); null: ``batch_size`` per device.
    """

    # The classes a dataset defines itself, whose masks hold only their values or ignored ones (Cityscapes'); None:
    # those of the data folder's classes.yaml, which the checkpoints record and whose masks are checked for values
    # of no class before a fit.
    fixed_classes: ClassTable | None = None
    # The dataset of its layout: what ``full_dataset`` makes, and what inference reads a split and names frames by.
    dataset_class: type[FolderDataset] = FolderDataset
    layout = DataLayout(
        (IMAGES, MASKS),
        "No dataset given (DATA=...): expected images/<split>/*, masks/<split>/*.png and classes.yaml\n"
        "(docs/your-data.md). Running the demo profile on the generated example (configs/demo/cityscapes.yaml).",
        "segment",
        files=(CLASSES_FILE,),
    )
    # Init arguments that change how a run reads its data, not what it trains on (mabn.cli.plan.run_settings).
    run_settings = frozenset({"num_workers", "val_batch_size"})
    class_pixels: ClassPixels | None = None

    def __init__(
        self,
        data_dir: str,
        crop_size: int | None = None,
        batch_size: int = 2,
        val_batch_size: int = 1,
        num_workers: int | None = None,
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
        self.train_set: FolderDataset | None = None
        self.val_set: FolderDataset | None = None

    @cached_property
    def classes(self) -> ClassTable:
        return self.fixed_classes or ClassTable.read(Path(self.data_dir) / CLASSES_FILE)

    @property
    def num_classes(self) -> int:
        return len(self.classes.names)

    @property
    def class_names(self) -> tuple[str, ...]:
        return self.classes.names

    @classmethod
    def recorded_classes(cls, hparams: Mapping[str, Any]) -> ClassTable | None:
        """The classes of a model trained on this module with hyperparameters ``hparams`` (a checkpoint's): the
        fixed ones, else the table ``setup`` recorded; None where it records none."""
        if cls.fixed_classes is not None:
            return cls.fixed_classes
        return ClassTable.from_dict(hparams["classes"]) if "classes" in hparams else None

    @classmethod
    def full_dataset(cls, root: str | Path, split: str, classes: ClassTable) -> FolderDataset:
        """The full images and labels of ``split`` under ``root`` with ``classes``: what validation, ``test`` and
        ``predict --split`` read."""
        return cls.dataset_class(root, split, classes=classes)

    def dataset(self, split: str) -> FolderDataset:
        """The full-image dataset of ``split``."""
        return self.full_dataset(self.data_dir, split, self.classes)

    def setup(self, stage: str | None = None) -> None:
        """Index the splits the stage needs; raises ``DatasetError`` if the layout is missing or broken."""
        if self.fixed_classes is None:
            self.hparams["classes"] = self.classes.as_dict()
        if self.crop_size is None:  # from the data, and so into the checkpoints, which test and predict read
            self.crop_size, line = data_crop(self.dataset(self.train_split).image_sizes(), None)
            self.hparams["crop_size"] = self.crop_size
            say(line)
        world = self.trainer.world_size if self.trainer is not None else 1
        module = self.trainer.lightning_module if self.trainer is not None else None
        norm_batch = module.hparams.get("norm_batch_size") if module is not None else None
        self.batch_size = per_device_batch(self.batch_size, self.global_batch_size, world, norm_batch)
        if stage in (None, "fit"):
            self.train_set = self.make_dataset(self.train_split, train=True)
        if stage in (None, "fit", "validate"):
            self.val_set = self.make_dataset(self.val_split, train=False)

    def make_dataset(self, split: str, train: bool) -> FolderDataset:
        """The dataset of ``split``: with the training augmentation (``train_transform`` at ``crop_size``) when
        ``train``, full images otherwise."""
        dataset = self.dataset(split)
        if self.fixed_classes is None:
            # Every mask's values before the first step, not at the mask's first read hours in; the masks found
            # clean go into the cache, so the next fit (a resume, a rerun) and dry run decode only new or changed
            # ones.
            problem, pixels = unknown_values(dataset.root, split, dataset.samples, self.classes)
            if problem:
                raise DatasetError(problem)
            if train:
                self.class_pixels = pixels  # what class_weights=counts weighs the classes by (mabn.tasks.losses)
        if train:
            if dataset.sizes is not None:
                count, line = small_images(dataset.sizes, self.crop_size)
                if count:  # a fit speaks of padding only where there is some; a dry run always says the count
                    say(line)
            dataset.transform = self.augmentation()
        return dataset

    def augmentation(self) -> A.Compose:
        """``train_transform`` with this module's settings; the training loader seeds it for each sample
        (``mabn.data.loading.TrainingSampler``)."""
        return train_transform(self.crop_size, self.scale_range, self.rotate_limit, self.blur_p)

    @staticmethod
    def plan(args: Mapping[str, Any]) -> DataPlan:
        """``--dry-run``'s plan once the whole dataset passed ``check_dataset``, before the plan's own count of
        batches, so that too few training images for the global batch is said with the dataset's other problems
        and its fix: the size of the training split, the crop and why (``data_crop``), how many of its images are
        smaller than the crop (``small_images``), the share of each class in the training pixels with warnings on
        classes of none and on ignored pixels of more than half (``ClassPixels.lines``), and how images of other
        modes than 8-bit RGB or of an EXIF orientation are read (``reading_lines``)."""
        sizes, pixels = check_dataset(args)
        crop, crop_line = data_crop(sizes, args.get("crop_size"))
        lines = [crop_line, small_images(sizes, crop)[1], *pixels.lines(), *reading_lines(args)]
        return DataPlan(len(sizes), lines, crop, pixels)

    def _loader(self, dataset: FolderDataset | None, batch_size: int, train: bool) -> DataLoader:
        if dataset is None:
            raise RuntimeError("call setup() before asking for a dataloader")
        return make_loader(dataset, batch_size, train, self.num_workers, node_devices(self.trainer))

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, self.batch_size, train=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, self.val_batch_size, train=False)
