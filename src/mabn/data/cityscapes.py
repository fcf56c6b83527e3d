"""Cityscapes fine annotations (19 training classes): the facts of the dataset on top of the generic segmentation
dataset of ``mabn.data.folder`` (reading, checks, augmentation and loaders are ``FolderDataset``'s and
``FolderDataModule``'s): its layout, its labelId -> trainId mapping and its classes.

Reads the official layout directly: ``*_gtFine_labelIds.png`` files are mapped to trainIds on the fly, so no
``csCreateTrainIdLabelImgs`` preprocessing step is needed.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import albumentations as A
import numpy as np
from torchvision.datasets import Cityscapes

from .classes import IGNORE_INDEX, ClassTable
from .errors import DatasetError, require_pairs
from .folder import FolderDataModule, FolderDataset
from .loading import DataLayout, DataPlan
from .pairs import Sample

__all__ = [
    "CLASSES",
    "CLASS_NAMES",
    "NUM_CLASSES",
    "TRAIN_ID_COLORS",
    "TRAIN_TO_LABEL_ID",
    "CityscapesDataModule",
    "CityscapesDataset",
    "label_ids_to_train_ids",
]

IMAGES, LABELS = "leftImg8bit", "gtFine"
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
# The 19 evaluated classes as a class table: trainIds, their colours and labelIds (every other labelId ignored, by
# ``label_ids_to_train_ids``).
CLASSES = ClassTable(
    CLASS_NAMES,
    tuple(tuple(color) for color in TRAIN_ID_COLORS.tolist()),  # type: ignore[misc]
    None,
    tuple(sorted((int(label_id), index) for index, label_id in enumerate(TRAIN_TO_LABEL_ID.tolist()))),
    "Cityscapes",
)


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


class CityscapesDataset(FolderDataset):
    """Cityscapes ``split`` under ``root`` in the official layout, yielding normalized images and trainIds 0..18
    (``FolderDataset`` with Cityscapes' layout, labelIds and classes). ``samples[i].name`` is item ``i``'s frame id,
    ``<city>_<seq>_<frame>``."""

    image_folder = IMAGES
    mask_term, mask_expected = "label", "a single-channel labelIds PNG"
    # Predictions as the benchmark server and cityscapesscripts' evalPixelLevelSemanticLabeling read them: labelIds
    # in ``labelIds/<frame>_labelIds.png`` (it matches ``<city>_<seq>_<frame>*.png`` to each ground truth).
    prediction_masks = "labelIds"
    prediction_scorer = "CITYSCAPES_RESULTS=<folder> csEvalPixelLevelSemanticLabeling"
    # The official files' sizes match: a pair is checked when it is read, not all 3,475 pairs' headers at each start.
    index_sizes = False

    def __init__(
        self,
        root: str | Path,
        split: str,
        transform: A.BasicTransform | A.Compose | None = None,
        classes: ClassTable = CLASSES,
    ) -> None:
        if classes.names != CLASSES.names:
            raise ValueError(f"Cityscapes has its own 19 classes, not {', '.join(classes.names)}")
        super().__init__(root, split, CLASSES, transform)

    @staticmethod
    def frame_name(image: Path) -> str:
        """``<city>_<seq>_<frame>`` for a Cityscapes image, the file's stem for any other."""
        return image.name[: -len(IMAGE_SUFFIX)] if image.name.endswith(IMAGE_SUFFIX) else image.stem

    @classmethod
    def mask_file(cls, frame: str) -> Path:
        return Path(cls.prediction_masks, f"{frame}_labelIds.png")

    @staticmethod
    def find_pairs(root: Path, split: str) -> list[Sample]:
        """All image/label pairs of a split, sorted by city and frame, paired by file name.

        Raises ``DatasetError`` naming the folder or file for a missing split folder, an empty split, or an
        image without its label file (or the reverse).
        """
        image_dir, label_dir = Path(root) / IMAGES / split, Path(root) / LABELS / split
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
        return [Sample(Path(key).name, images[key], labels[key]) for key in sorted(images)]

    def class_map(self, mask: np.ndarray, path: Path) -> np.ndarray:
        """The trainIds of the labelIds ``mask`` (``label_ids_to_train_ids``); a label of no Cityscapes id at all
        is an error naming the file (a trainIds or colour image given for the labelIds)."""
        train = label_ids_to_train_ids(mask)
        if not (train != IGNORE_INDEX).any() and mask.max() > MAX_LABEL_ID:
            unknown = np.unique(mask[mask > MAX_LABEL_ID])
            raise DatasetError(
                f"label file {path} holds no Cityscapes class: its ids {unknown[:5].tolist()} are outside "
                f"the labelIds 0..{MAX_LABEL_ID} (expected *{LABEL_SUFFIX}, not a trainIds or colour image)"
            )
        return train


class CityscapesDataModule(FolderDataModule):
    """Cityscapes fine train/val in the official layout under ``data_dir``, with the hszhao/semseg recipe:
    ``FolderDataModule`` with Cityscapes' dataset, its 19 classes and the paper's crop.

    Args:
        data_dir: the dataset's root folder, which holds ``leftImg8bit/`` and ``gtFine/`` (the official layout).
        crop_size: the side in pixels of the square random training crops (the paper's 713); smaller images are
            padded up to it.
    """

    fixed_classes = CLASSES
    dataset_class = CityscapesDataset
    layout = DataLayout(
        (IMAGES, LABELS),
        f"No Cityscapes given (DATA=...): expected {IMAGES}/<split>/<city>/*{IMAGE_SUFFIX} and\n"
        f"{LABELS}/<split>/<city>/*{LABEL_SUFFIX}. Running the demo profile on generated street scenes\n"
        "(configs/demo/cityscapes.yaml).",
        "cityscapes",
        name="cityscapes",
    )

    def __init__(self, data_dir: str, crop_size: int = 713, **kwargs: Any) -> None:
        super().__init__(data_dir, crop_size, **kwargs)

    @staticmethod
    def plan(args: Mapping[str, Any]) -> DataPlan:
        """``--dry-run``'s plan: the size of the training split the data module's ``args`` name, from file names
        alone (the labelIds of the official files are each a class or ignored: no value to check)."""
        return DataPlan(
            len(CityscapesDataset.find_pairs(Path(args["data_dir"]), args.get("train_split") or "train")), []
        )
