"""``python -m mabn predict CKPT``: a stage-2 checkpoint's predictions as the PNG files Cityscapes takes.

For every image of a folder (``--images``, searched recursively) or of a Cityscapes split (``--data``,
``--split``: ``<root>/leftImg8bit/<split>``) it writes, named after the frame (the image's name without
``_leftImg8bit``), into the output folder:
- ``labelIds/<frame>_labelIds.png``: Cityscapes labelIds, what the benchmark server and cityscapesscripts'
  ``evalPixelLevelSemanticLabeling`` read (it matches ``<city>_<seq>_<frame>*.png`` to each ground truth, so
  point it at this folder alone: ``CITYSCAPES_RESULTS=<out>/labelIds``);
- ``color/<frame>_color.png``: the classes in the Cityscapes colours;
- ``overlay/<frame>_overlay.png`` with ``--overlay``: the colours blended over the image.

The output folder defaults to ``<run>/predictions/<checkpoint name>-<split or folder name>``. It records its
run in ``predict.json``; a folder holding any other files (another checkpoint, images or options, or files of
unknown origin) is refused unless ``--overwrite`` is given. Every file is written atomically.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import albumentations as A
import numpy as np
import torch
from PIL import Image
from pytorch_lightning.callbacks import BasePredictionWriter
from torch.utils.data import Dataset
from torchvision.datasets import Cityscapes

from . import cli
from .data.cityscapes import IGNORE_INDEX, IMAGE_SUFFIX, IMAGENET_MEAN, IMAGENET_STD, NUM_CLASSES
from .data.errors import DatasetError
from .data.loading import make_loader
from .errors import ConfigError
from .evaluate import Stage2Checkpoint, configure, data_root, eval_parser, inference_trainer, load_stage2
from .files import atomic_path, write_text_atomic

MANIFEST = "predict.json"
IMAGE_TYPES = (".png", ".jpg", ".jpeg")
OVERLAY_ALPHA = 0.5  # weight of the class colours over the image


def _train_id_tables() -> tuple[np.ndarray, np.ndarray]:
    """trainId -> labelId and trainId -> RGB colour (uint8) for the 19 evaluated classes."""
    label_ids = np.zeros(NUM_CLASSES, dtype=np.uint8)
    colors = np.zeros((NUM_CLASSES, 3), dtype=np.uint8)
    for cls in Cityscapes.classes:
        if 0 <= cls.train_id < IGNORE_INDEX:
            label_ids[cls.train_id] = cls.id
            colors[cls.train_id] = cls.color
    return label_ids, colors


TRAIN_TO_LABEL_ID, TRAIN_ID_COLORS = _train_id_tables()


def frame_name(image: Path) -> str:
    """``<city>_<seq>_<frame>`` for a Cityscapes image, the file's stem for any other."""
    return image.name[: -len(IMAGE_SUFFIX)] if image.name.endswith(IMAGE_SUFFIX) else image.stem


class FrameImages(Dataset):
    """The images under ``folder`` (recursively, sorted) as normalized 3xHxW tensors with their index.

    Normalized as ``CityscapesDataset`` does, so a split predicted here scores what ``test`` scores.
    """

    def __init__(self, folder: Path) -> None:
        if not folder.is_dir():
            raise DatasetError(f"no such image folder: {folder}")
        self.files = sorted(p for p in folder.rglob("*") if p.suffix.lower() in IMAGE_TYPES and p.is_file())
        if not self.files:
            raise DatasetError(f"no {'/'.join(IMAGE_TYPES)} images under {folder}")
        self.names = [frame_name(p) for p in self.files]
        seen: dict[str, Path] = {}
        for name, path in zip(self.names, self.files):
            if name in seen:  # their predictions would share one file name
                raise DatasetError(f"images {seen[name]} and {path} are both frame {name}: predict them separately")
            seen[name] = path
        self._normalize = A.Normalize(mean=IMAGENET_MEAN, std=IMAGENET_STD, max_pixel_value=255.0)

    def __len__(self) -> int:
        return len(self.files)

    def read_rgb(self, index: int) -> np.ndarray:
        try:
            with Image.open(self.files[index]) as img:
                return np.asarray(img.convert("RGB"))
        except (OSError, SyntaxError, ValueError) as err:
            raise DatasetError(f"cannot read image file {self.files[index]}: {err}") from err

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image = self._normalize(image=self.read_rgb(index))["image"]
        return torch.from_numpy(np.ascontiguousarray(image.transpose(2, 0, 1))), index


def save_png(path: Path, pixels: np.ndarray) -> None:
    with atomic_path(path) as tmp:
        Image.fromarray(pixels).save(tmp, format="PNG")


def overlay(image: np.ndarray, colors: np.ndarray) -> np.ndarray:
    blend = (1 - OVERLAY_ALPHA) * image.astype(np.float32) + OVERLAY_ALPHA * colors.astype(np.float32)
    return blend.round().clip(0, 255).astype(np.uint8)


class PredictionWriter(BasePredictionWriter):
    """Writes each predicted image's labelIds, colour and (optionally) overlay PNG as its batch ends."""

    def __init__(self, out: Path, images: FrameImages, with_overlay: bool) -> None:
        super().__init__(write_interval="batch")
        self.out, self.images, self.with_overlay = out, images, with_overlay
        self.written = 0

    def write_on_batch_end(
        self, trainer, pl_module, prediction: torch.Tensor, batch_indices, batch: Any, batch_idx: int, dataloader_idx=0
    ) -> None:
        for train_ids, index in zip(prediction.cpu().numpy(), batch[1].tolist()):
            name, colors = self.images.names[index], TRAIN_ID_COLORS[train_ids]
            save_png(self.out / "labelIds" / f"{name}_labelIds.png", TRAIN_TO_LABEL_ID[train_ids])
            save_png(self.out / "color" / f"{name}_color.png", colors)
            if self.with_overlay:
                save_png(self.out / "overlay" / f"{name}_overlay.png", overlay(self.images.read_rgb(index), colors))
            self.written += 1


def claim_folder(out: Path, manifest: dict[str, Any], overwrite: bool) -> None:
    """Make ``out`` this run's: refuse a folder with files of another run (or of unknown origin) unless
    ``overwrite``; a folder of the very same run (checkpoint, images, options) is continued."""
    if out.is_dir() and any(out.iterdir()):
        try:
            prior = json.loads((out / MANIFEST).read_text())
        except (OSError, ValueError):
            prior = None
        if prior != manifest and not overwrite:
            whose = f"checkpoint {prior.get('checkpoint')}" if isinstance(prior, dict) else f"no {MANIFEST}"
            raise ConfigError(
                f"{out} already holds files of another run ({whose}): pick another --out, or pass --overwrite "
                "to replace its predictions of the same frames"
            )
    elif out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file, not a folder")
    write_text_atomic(out / MANIFEST, json.dumps(manifest, indent=2) + "\n")


def image_folder(checkpoint: Stage2Checkpoint, ns: argparse.Namespace) -> Path:
    """``--images``, else the split's ``leftImg8bit/<split>`` of ``--data`` (the checkpoint's root by default)."""
    if ns.images is not None:
        if ns.data is not None or ns.split is not None:
            raise ConfigError("give either --images FOLDER or --data/--split, not both")
        return ns.images
    split = ns.split or checkpoint.data.get("val_split") or "val"
    return data_root(checkpoint, ns.data) / "leftImg8bit" / split


def run_predict(ns: argparse.Namespace) -> Path:
    checkpoint = load_stage2(ns.checkpoint)
    if checkpoint.task.hparams.num_classes != NUM_CLASSES:
        raise ConfigError(f"{ns.checkpoint} predicts {checkpoint.task.hparams.num_classes} classes, not Cityscapes' 19")
    configure(checkpoint, ns)
    folder = image_folder(checkpoint, ns)
    images = FrameImages(folder)
    out = ns.out or checkpoint.run_folder / "predictions" / f"{ns.checkpoint.stem}-{folder.name}"
    hp = checkpoint.task.hparams
    manifest = {
        "checkpoint": str(ns.checkpoint.resolve()),
        "images": str(folder.resolve()),
        "crop": hp.eval_crop,
        "flip": hp.eval_flip,
        "scales": list(hp.eval_scales),
        "overlay": ns.overlay,
    }
    claim_folder(out, manifest, ns.overwrite)
    writer = PredictionWriter(out, images, ns.overlay)
    loader = make_loader(images, 1, False, ns.num_workers)
    inference_trainer(callbacks=[writer]).predict(checkpoint.task, loader, return_predictions=False)
    parts = "labelIds/, color/" + (" and overlay/" if ns.overlay else "")
    print(f"Wrote {writer.written} predictions of {folder} to {out} ({parts}); evaluate {out / 'labelIds'}")
    return out


def parser() -> argparse.ArgumentParser:
    parser = eval_parser("predict", __doc__)
    parser.add_argument("--images", type=Path, help="a folder of images to predict (searched recursively)")
    parser.add_argument("--split", help="the split under leftImg8bit/ (default: the checkpoint's val split)")
    parser.add_argument("--out", type=Path, help="output folder (default: <run>/predictions/<ckpt>-<split>)")
    parser.add_argument("--overlay", action="store_true", help="also write the colours blended over each image")
    parser.add_argument("--overwrite", action="store_true", help="write into a folder holding another run's files")
    return parser


def main(argv: list[str] | None = None) -> None:
    cli.run_command(parser(), run_predict, argv)
