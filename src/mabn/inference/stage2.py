"""A stage-2 checkpoint for inference, what ``python -m mabn test`` and ``predict`` (``mabn.cli.commands``) and
``mabn.inference.predict.load`` share: the checkpoint as a ready SegmentationTask with its classes and dataset, its
sliding-window protocol (crop, flip and scales, the checkpoint's own by default) and one device (a GPU when there
is one). Images are predicted in full by ``SegmentationTask.predict_classes``, the sliding-window code path of
validation.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytorch_lightning as pl

from ..data.cityscapes import CLASSES, NUM_CLASSES, CityscapesDataset
from ..data.classes import CLASSES_FILE, ClassTable
from ..data.folder import IMAGES, FolderDataset
from ..errors import ConfigError
from ..run import folder as runs
from ..tasks import SegmentationTask
from .checkpoint import load_task

STAGE2 = f"{SegmentationTask.__module__}.{SegmentationTask.__name__}"
STAGE2_NAMES = (STAGE2, "mabn.tasks.SegmentationTask")  # the class path as the configs spell it


@dataclass
class Stage2Checkpoint:
    """A stage-2 checkpoint loaded for inference: the task (eval mode) and its data module's arguments."""

    path: Path
    task: SegmentationTask
    data: dict[str, Any]  # the data module's hyperparameters (data_dir, crop_size, val_split, classes, ...)

    @property
    def run_folder(self) -> Path:
        """The experiment folder the checkpoint belongs to (``<run>/checkpoints/<file>.ckpt``)."""
        parent = self.path.parent
        return parent.parent if parent.name == runs.CHECKPOINTS else parent

    @property
    def own_data(self) -> bool:
        """Whether it was trained on a dataset of the user's own (``FolderDataModule``, which records its classes)."""
        return "classes" in self.data

    @property
    def classes(self) -> ClassTable:
        """Its classes (``recorded_classes``); ``ConfigError`` naming the file when it records none."""
        classes = recorded_classes(self.task.hparams.num_classes, self.data)
        if classes is None:
            raise ConfigError(
                f"{self.path} predicts {self.task.hparams.num_classes} classes and records no class table "
                f"(Cityscapes has {NUM_CLASSES})"
            )
        return classes

    def dataset(self, root: Path, split: str) -> CityscapesDataset:
        """The full images and labels of ``split`` under ``root``, in the layout it was trained on. A dataset of
        the user's own is read with ``root``'s own classes.yaml when it has one, which must name the same classes."""
        if not self.own_data:
            return CityscapesDataset(root, split)
        classes = self.classes
        if (root / CLASSES_FILE).is_file():
            classes = ClassTable.read(root / CLASSES_FILE)
            if classes.names != self.classes.names:
                raise ConfigError(
                    f"{root / CLASSES_FILE} names the classes {', '.join(classes.names)}, but {self.path} was "
                    f"trained on {', '.join(self.classes.names)}"
                )
        return FolderDataset(root, split, classes)

    def image_folder(self, root: Path, split: str) -> Path:
        """The images of ``split`` under ``root``: ``leftImg8bit/<split>``, or ``images/<split>`` for a dataset of
        the user's own."""
        return root / (IMAGES if self.own_data else "leftImg8bit") / split


def recorded_classes(num_classes: int, data: dict[str, Any]) -> ClassTable | None:
    """The classes of a stage-2 checkpoint with ``num_classes`` outputs and data module arguments ``data``: the
    table a dataset of the user's own records, else Cityscapes' 19; None for another count without a table."""
    if "classes" in data:
        return ClassTable.from_dict(data["classes"])
    return CLASSES if num_classes == NUM_CLASSES else None


def load_stage2(path: Path) -> Stage2Checkpoint:
    """The SegmentationTask of a stage-2 checkpoint with its weights (``mabn.inference.checkpoint``); ``ConfigError`` in
    one line naming the file when it is not one or its weights do not fit."""
    info = runs.read_checkpoint(path)  # mapped: a checkpoint of another stage is refused before its weights are read
    class_path = info.hparams.get("_class_path")
    if (class_path is not None and class_path not in STAGE2_NAMES) or "eval_scales" not in info.hparams:
        raise ConfigError(f"{path} is not a stage-2 checkpoint ({class_path or 'unknown task'}); expected {STAGE2}")
    restored = load_task(path)
    return Stage2Checkpoint(path, restored.task, restored.data)


def configure(
    checkpoint: Stage2Checkpoint,
    crop: int | None = None,
    flip: bool | None = None,
    scales: list[float] | tuple[float, ...] | None = None,
) -> None:
    """Set the task's sliding-window protocol: the window size, the mirrored pass and the image scales given,
    the checkpoint's for each one that is None."""
    hp = checkpoint.task.hparams
    crop = crop if crop is not None else hp.eval_crop or checkpoint.data.get("crop_size")
    if not crop or crop < 1:
        raise ConfigError(f"--crop={crop}: give the window size in pixels, at least 1")
    hp.eval_crop = crop
    hp.eval_flip = hp.eval_flip if flip is None else flip
    if scales is not None:
        if min(scales) <= 0:
            raise ConfigError(f"--scales {list(scales)}: every scale must be > 0")
        hp.eval_scales = tuple(scales)


def data_root(checkpoint: Stage2Checkpoint, given: Path | None) -> Path:
    """The dataset's root: ``given``, else the one the checkpoint was trained on."""
    root = given or checkpoint.data.get("data_dir")
    if root is None:
        raise ConfigError(f"{checkpoint.path} names no data_dir: give the dataset's root with --data")
    return Path(root)


def inference_trainer(**kwargs: Any) -> pl.Trainer:
    """One device (a GPU when there is one), no logger, no checkpoints: nothing is written by the Trainer."""
    return pl.Trainer(
        accelerator="auto", devices=1, logger=False, enable_checkpointing=False, enable_model_summary=False, **kwargs
    )
