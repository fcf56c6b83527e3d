"""A stage-2 checkpoint's predictions: the files ``python -m mabn predict`` writes (``PredictionWriter``: the mask in
the dataset's own values, the colour image and the overlay of each frame; ``claim_folder``: an output folder holds
the predictions of one run, recorded in its manifest), and ``load(CKPT)``, the same predictions in Python
(``Segmenter.predict(image or images) -> class maps``, with the class probabilities on request).
"""

from __future__ import annotations

import glob
import json
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TypeAlias

import numpy as np
import torch
from PIL import Image
from pytorch_lightning.callbacks import BasePredictionWriter
from torch.utils.data import Dataset

from ..data.classes import ClassTable
from ..data.errors import DatasetError
from ..data.folder import FolderDataset
from ..data.images import imagenet_normalize, read_image, to_rgb
from ..data.pairs import IMAGE_TYPES
from ..errors import ConfigError
from ..run import atomic_path, write_text_atomic
from .stage2 import Stage2Checkpoint, configure, load_stage2

__all__ = ["Segmenter", "load"]

MANIFEST = "predict.json"
OVERLAY_ALPHA = 0.5  # weight of the class colours over the image
GLOB = re.compile(r"[*?[]")
ImageInput: TypeAlias = np.ndarray | Image.Image | str | Path  # what ``Segmenter.rgb`` converts


def _is_image(path: Path) -> bool:
    return path.suffix.lower() in IMAGE_TYPES and not path.name.startswith(".") and path.is_file()


def image_files(specs: list[str | Path]) -> list[Path]:
    """The images ``specs`` name, in order and each once: a folder's images (recursively, sorted), an image file,
    or a glob pattern's images (sorted; ``**`` matches any folders); ``DatasetError`` for one that names none."""
    files: list[Path] = []
    seen: set[Path] = set()
    for spec in specs:
        path = Path(spec)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if _is_image(p))
            if not found:
                raise DatasetError(f"no {'/'.join(IMAGE_TYPES)} images under {path}")
        elif path.is_file():
            found = [path]
        elif GLOB.search(str(spec)):
            found = sorted(Path(p) for p in glob.glob(str(spec), recursive=True) if _is_image(Path(p)))
            if not found:
                raise DatasetError(f"no {'/'.join(IMAGE_TYPES)} images match {spec}")
        else:
            raise DatasetError(f"no such image file or folder: {spec}")
        for image in found:
            if image not in seen:
                seen.add(image)
                files.append(image)
    return files


def images_name(specs: list[str | Path]) -> str:
    """What the images are called in the default output folder: a folder's name, an image's stem, the folder of
    a glob pattern; ``images`` for several."""
    if len(specs) != 1:
        return "images"
    path = Path(specs[0])
    if path.is_file():
        return path.stem
    fixed = path.parts[: next((i for i, part in enumerate(path.parts) if GLOB.search(part)), len(path.parts))]
    return Path(*fixed).resolve().name if fixed else "images"


class FrameImages(Dataset):
    """``files`` as normalized 3xHxW tensors with their index, each named by the frame it holds in ``layout``, the
    dataset of the checkpoint (``FolderDataset.frame_name``).

    Normalized as the datasets do, so a split predicted here scores what ``test`` scores.
    """

    def __init__(self, files: list[Path], layout: type[FolderDataset] = FolderDataset) -> None:
        self.files = list(files)
        self.layout = layout
        self.names = [layout.frame_name(p) for p in self.files]
        seen: dict[str, Path] = {}
        for name, path in zip(self.names, self.files):
            if name in seen:  # their predictions would share one file name
                raise DatasetError(f"images {seen[name]} and {path} are both frame {name}: predict them separately")
            seen[name] = path
        self._normalize = imagenet_normalize()

    def __len__(self) -> int:
        return len(self.files)

    def read_rgb(self, index: int) -> np.ndarray:
        return read_image(self.files[index])

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
    """Writes each predicted image's mask (named as its dataset names masks: ``FolderDataset.mask_file``), colour
    and (optionally) overlay PNG as its batch ends."""

    def __init__(self, out: Path, images: FrameImages, with_overlay: bool, classes: ClassTable) -> None:
        super().__init__(write_interval="batch")
        self.out, self.images, self.with_overlay, self.classes = out, images, with_overlay, classes
        self.written = 0

    def write_on_batch_end(
        self, trainer, pl_module, prediction: torch.Tensor, batch_indices, batch: Any, batch_idx: int, dataloader_idx=0
    ) -> None:
        for class_map, index in zip(prediction.cpu().numpy(), batch[1].tolist()):
            name, colors = self.images.names[index], self.classes.palette[class_map]
            save_png(self.out / self.images.layout.mask_file(name), self.classes.to_mask(class_map))
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


class Segmenter:
    """A stage-2 checkpoint ready to predict images in Python: ``load(checkpoint)`` makes one.

    ``predict(image)`` gives the H x W class map (uint8 class indices 0..K-1, in the order of ``class_names``) of
    an image of any size, by the sliding-window protocol of ``python -m mabn test`` with the options ``load``
    was given (the checkpoint's by default): the class map ``test`` scores for that image. It also takes a batch
    (a list of images, or an N x H x W x C uint8 array) and, with ``probs=True``, returns the class probabilities
    too. ``colorize`` and ``to_mask`` turn a class map into the colour image and the mask PNG that
    ``python -m mabn predict`` writes.
    """

    def __init__(self, checkpoint: Stage2Checkpoint, device: torch.device) -> None:
        self.checkpoint = checkpoint
        self.classes = checkpoint.classes
        self.device = device
        self.task = checkpoint.task.to(device).eval()
        self._normalize = imagenet_normalize()

    @property
    def class_names(self) -> tuple[str, ...]:
        return self.classes.names

    @property
    def colors(self) -> np.ndarray:
        """K x 3 uint8: the colour of each class."""
        return self.classes.palette

    @staticmethod
    def rgb(image: np.ndarray | Image.Image | str | Path) -> np.ndarray:
        """``image`` as H x W x 3 uint8 RGB, converted as the datasets convert their files: a path is read, a PIL
        image of any mode is turned by its EXIF orientation and converted (``mabn.data.images.to_rgb``), and a uint8
        array H x W (grey), H x W x 1, x 3 (RGB) or x 4 (RGBA) is converted."""
        if isinstance(image, str | Path):
            return read_image(image)
        if isinstance(image, Image.Image):
            return to_rgb(image)
        array = np.asarray(image)
        if array.dtype != np.uint8:
            raise ValueError(f"expected uint8 pixels (0..255), got dtype {array.dtype}")
        if array.ndim == 3 and array.shape[2] == 1:
            array = array[..., 0]
        if not (array.ndim == 2 or (array.ndim == 3 and array.shape[2] in (3, 4))):
            raise ValueError(f"expected an image H x W, H x W x 3 or H x W x 4, got shape {array.shape}")
        return np.asarray(Image.fromarray(array).convert("RGB"))

    def _tensor(self, pixels: np.ndarray) -> torch.Tensor:
        """H x W x 3 uint8 RGB -> the normalized 3 x H x W float32 tensor the network takes."""
        return torch.from_numpy(np.ascontiguousarray(self._normalize(image=pixels)["image"].transpose(2, 0, 1)))

    def _batches(self, images: Sequence[ImageInput], batch_size: int) -> Iterator[list[np.ndarray]]:
        """``images`` as RGB arrays in order, in runs of at most ``batch_size`` images of one size (a batch is one
        tensor), each read only when its run is due."""
        run: list[np.ndarray] = []
        for image in images:
            pixels = self.rgb(image)
            if run and (len(run) == batch_size or pixels.shape != run[0].shape):
                yield run
                run = []
            run.append(pixels)
        if run:
            yield run

    @torch.no_grad()
    def predict(self, images: ImageInput | Sequence[ImageInput], probs: bool = False, batch_size: int = 4) -> Any:
        """The H x W uint8 class map of an image (see ``rgb`` for what it takes); for a list of images the list of
        their class maps, for an N x H x W x C uint8 array the N x H x W array.

        With ``probs=True``: (class maps, probabilities), the probabilities shaped as the maps with the K classes
        first (K x H x W float32 for an image, N x K x H x W for an array; they sum to 1 over the classes and the
        class map is their argmax). Consecutive images of one size go through the network together, at most
        ``batch_size`` at a time; a batch gives each image its own result.
        """
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r}: give the number of images per batch, at least 1")
        stacked = isinstance(images, np.ndarray) and images.ndim == 4
        single = not stacked and not isinstance(images, list | tuple)
        maps: list[np.ndarray] = []
        probabilities: list[np.ndarray] = []
        for run in self._batches([images] if single else images, batch_size):
            batch = torch.stack([self._tensor(pixels) for pixels in run]).to(self.device)
            scores = self.task.predict_probs(batch)
            maps.extend(scores.argmax(1).to(torch.uint8).cpu().numpy())
            if probs:
                probabilities.extend(scores.cpu().numpy())

        def shaped(arrays: list[np.ndarray]) -> Any:
            """The results in the form the images came in: one image's, a list, or one array."""
            return arrays[0] if single else np.stack(arrays) if stacked else arrays

        return (shaped(maps), shaped(probabilities)) if probs else shaped(maps)

    def colorize(self, class_map: np.ndarray) -> np.ndarray:
        """H x W x 3 uint8: each class in its colour (``predict``'s ``color/`` files)."""
        return self.classes.palette[class_map]

    def to_mask(self, class_map: np.ndarray) -> np.ndarray:
        """The class map as the dataset's masks hold it: the values of its class table (each class's first;
        Cityscapes' labelIds) or, with ``mask_format: color``, its colours (``predict``'s mask files)."""
        return self.classes.to_mask(class_map)


def load(
    checkpoint: str | Path,
    crop: int | None = None,
    flip: bool | None = None,
    scales: list[float] | tuple[float, ...] | None = None,
    device: str | torch.device | None = None,
) -> Segmenter:
    """A ``Segmenter`` of a stage-2 checkpoint (of ``make cityscapes`` or ``make segment``), loaded once: read
    weights-only, without the fit's backbone file. ``crop``, ``flip`` and ``scales`` are ``test``'s options
    (default: the checkpoint's); ``device`` defaults to the GPU when there is one. ``ConfigError`` naming the
    file when it is not such a checkpoint."""
    loaded = load_stage2(Path(checkpoint))
    configure(loaded, crop, flip, scales)
    where = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return Segmenter(loaded, where)
