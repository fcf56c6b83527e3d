"""The ablation's generated set: the demo's ten shapes, faded and buried in pixel noise, with a large
validation split.

The demo set (``mabn.data.synthetic.imagenet``) is solved to about 1 % error by a few minutes of training, so
rows that differ by a few tenths of a point end at the same handful of wrong images. Here each image is
the demo's rendering pulled towards its mean by ``fade`` and overlaid with Gaussian noise of std
``noise`` (on a 0-1 scale), which keeps the best row well above 0 % error at convergence; 300 validation
images per class resolve 0.033 points per image.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
from PIL import Image

from ...data.errors import DatasetError
from ...data.once import generate_once
from ...data.synthetic.imagenet import CLASSES, render

MARKER = ".complete"
# The set's image size and degradation, which the segmentation set of --segment-start shares.
SIZE, FADE, NOISE = 36, 0.4, 0.2


def degrade(image: np.ndarray, fade: float, noise: float, rng: np.random.Generator) -> np.ndarray:
    """``image`` (HxWx3 uint8) with its contrast scaled by ``1 - fade`` around its mean, plus noise."""
    x = image.astype(np.float32) / 255.0
    x = x.mean() + (1.0 - fade) * (x - x.mean()) + rng.normal(0.0, noise, x.shape)
    return (np.clip(x, 0, 1) * 255).astype(np.uint8)


def generate(
    root: str | Path,
    n_train: int = 300,
    n_val: int = 300,
    size: int = SIZE,
    fade: float = FADE,
    noise: float = NOISE,
    seed: int = 20,
) -> Path:
    """Write ``root/{train,val}/<class>/*.png`` once (``mabn.data.once.generate_once``: under a lock, into a
    scratch folder renamed when complete); later calls with the same parameters return at once, a set of
    this generator with other parameters is rewritten, and a folder it did not write is refused."""
    params = {"n_train": n_train, "n_val": n_val, "size": size, "fade": fade, "noise": noise, "seed": seed}
    params["classes"] = CLASSES

    def write(folder: Path) -> Path:
        if _complete(folder, params):
            return folder
        if any(folder.iterdir()):
            if not (folder / MARKER).is_file():
                raise DatasetError(f"{folder} exists and is not a generated ablation set; refusing to replace it")
            (folder / MARKER).unlink()  # our own generation, with other parameters: rewritten in place
            for split in ("train", "val"):
                shutil.rmtree(folder / split, ignore_errors=True)
        print(f"Generating the ablation shape set ({len(CLASSES)} classes, {n_train}+{n_val} per class)")
        rng = np.random.default_rng(seed)
        for split, count in (("train", n_train), ("val", n_val)):
            for label, name in enumerate(CLASSES):
                (folder / split / name).mkdir(parents=True)
                for i in range(count):
                    image = degrade(render(label, size, rng), fade, noise, rng)
                    Image.fromarray(image).save(folder / split / name / f"{name}_{i:04d}.png")
        (folder / MARKER).write_text(json.dumps(params))
        return folder

    return generate_once(Path(root), write)


def _complete(root: Path, params: dict) -> bool:
    """Whether ``root`` holds a finished generation with exactly these parameters."""
    marker = root / MARKER
    return marker.is_file() and json.loads(marker.read_text()) == params
