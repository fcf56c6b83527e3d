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

from ..data.classes import CLASSES_FILE, ClassTable
from ..data.folder import FolderDataModule, FolderDataset
from ..errors import ConfigError
from ..recipes import class_at
from ..run import first_line
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
    def data_module(self) -> type[FolderDataModule]:
        """The data module it was trained with (``data_module_class``), which declares its dataset's layout, classes
        and prediction files."""
        return data_module_class(self.data, self.path)

    @property
    def classes(self) -> ClassTable:
        """Its classes (``recorded_classes``); ``ConfigError`` naming the file when it records none."""
        classes = recorded_classes(self.task.hparams.num_classes, self.data, self.path)
        if classes is None:
            raise ConfigError(
                f"{self.path} predicts {self.task.hparams.num_classes} classes and records no class table"
            )
        return classes

    def dataset(self, root: Path, split: str) -> FolderDataset:
        """The full images and labels of ``split`` under ``root``, in the layout it was trained on. A dataset whose
        classes come from its folder is read with ``root``'s own classes.yaml when it has one, which must name the
        same classes."""
        classes = self.classes
        if self.data_module.fixed_classes is None and (root / CLASSES_FILE).is_file():
            classes = ClassTable.read(root / CLASSES_FILE)
            if classes.names != self.classes.names:
                raise ConfigError(
                    f"{root / CLASSES_FILE} names the classes {', '.join(classes.names)}, but {self.path} was "
                    f"trained on {', '.join(self.classes.names)}"
                )
        return self.data_module.full_dataset(root, split, classes)

    def split_images(self, root: Path, split: str) -> list[Path]:
        """The images of ``split`` under ``root``, in the layout it was trained on (``FolderDataset.split_images``)."""
        return self.data_module.dataset_class.split_images(root, split)


def data_module_class(data: dict[str, Any], path: Path | None = None) -> type[FolderDataModule]:
    """The data module class a checkpoint's data hyperparameters ``data`` name (LightningCLI records its class path);
    ``FolderDataModule`` where they name none (a checkpoint written outside the CLI). ``ConfigError`` for a class
    that cannot be imported or is no segmentation data module."""
    class_path = data.get("_class_path")
    if class_path is None:
        return FolderDataModule
    try:
        found = class_at(class_path)
    except (ImportError, AttributeError, ValueError) as err:
        raise ConfigError(
            f"{path or 'the checkpoint'} was trained with the data module {class_path}, which cannot be imported "
            f"here ({first_line(err)}): make its module importable (PYTHONPATH) to read the checkpoint's dataset"
        ) from err
    if not (isinstance(found, type) and issubclass(found, FolderDataModule)):
        raise ConfigError(f"{path or 'the checkpoint'}: its data module {class_path} is no FolderDataModule")
    return found


def recorded_classes(num_classes: int, data: dict[str, Any], path: Path | None = None) -> ClassTable | None:
    """The classes of a stage-2 checkpoint with ``num_classes`` outputs and data module arguments ``data``, as its
    data module declares them (``FolderDataModule.recorded_classes``); None where it records none or a table of
    another size."""
    classes = data_module_class(data, path).recorded_classes(data)
    return classes if classes is not None and len(classes.names) == num_classes else None


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
