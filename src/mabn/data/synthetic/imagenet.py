"""A small generated classification set in the ImageNet folder layout, for the demo profile.

Ten classes, one per shape: disk, ring, square, diamond, triangle, cross, horizontal bar, vertical bar,
L and T. Position, size (overlapping ranges across classes), a small rotation and every colour are
random and independent of the class (light-on-dark or dark-on-light), and the background carries faint
stripes of random orientation, so no pixel statistic (mean colour, contrast, area) gives the class away: a
network has to see the outline.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
from PIL import Image

from ..errors import DatasetError

SHAPES = ("disk", "ring", "square", "diamond", "triangle", "cross", "hbar", "vbar", "ell", "tee")
CLASSES = [f"{i:02d}_{shape}" for i, shape in enumerate(SHAPES)]
MARKER = ".complete"


def _shape_mask(shape: str, u: np.ndarray, v: np.ndarray, radius: float) -> np.ndarray:
    """Mask of a shape of size ``radius`` centred at the origin of coordinates u (right), v (down)."""
    au, av = abs(u), abs(v)
    arm = radius * 0.4
    masks = {
        "disk": lambda: np.hypot(u, v) < radius,
        "ring": lambda: (np.hypot(u, v) < radius) & (np.hypot(u, v) > radius * 0.55),
        "square": lambda: np.maximum(au, av) < radius * 0.8,
        "diamond": lambda: au + av < radius * 1.1,
        "triangle": lambda: (v < radius * 0.6) & (v > 2.0 * au - radius),
        "cross": lambda: ((au < arm) & (av < radius)) | ((av < arm) & (au < radius)),
        "hbar": lambda: (au < radius) & (av < arm),
        "vbar": lambda: (av < radius) & (au < arm),
        "ell": lambda: (
            ((u > -radius) & (u < -radius + 2 * arm) & (av < radius))
            | ((v < radius) & (v > radius - 2 * arm) & (au < radius))
        ),
        "tee": lambda: ((au < arm) & (av < radius)) | ((v > -radius) & (v < -radius + 2 * arm) & (au < radius)),
    }
    return masks[shape]()


def render(label: int, size: int, rng: np.random.Generator) -> np.ndarray:
    """One HxWx3 uint8 image of class ``label``."""
    return render_with_mask(label, size, rng)[0]


def render_with_mask(label: int, size: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """One HxWx3 uint8 image of class ``label`` and the HxW bool mask of its shape's pixels (the ablation's
    segmentation set, ``mabn.tools.ablation.segment``)."""
    y, x = np.mgrid[0:size, 0:size].astype(np.float32)
    radius = rng.uniform(0.22, 0.36) * size
    cx, cy = rng.uniform(radius + 1, size - radius - 1, 2)
    rot = rng.uniform(-0.25, 0.25)  # small: a square must stay a square, not a diamond
    u = (x - cx) * np.cos(rot) + (y - cy) * np.sin(rot)
    v = -(x - cx) * np.sin(rot) + (y - cy) * np.cos(rot)
    mask = _shape_mask(SHAPES[label], u, v, radius)[..., None]

    # Light shape on dark ground or the reverse, in random hues: the outline is always clear, while
    # colour and brightness say nothing about the class.
    light, dark = rng.uniform(0.65, 1.0, 3), rng.uniform(0.0, 0.35, 3)
    fg, bg = (light, dark) if rng.random() < 0.5 else (dark, light)
    angle, period = rng.uniform(0, np.pi), rng.uniform(5.0, 9.0)
    stripes = (np.sin(2 * np.pi * (x * np.cos(angle) + y * np.sin(angle)) / period) > 0)[..., None]
    background = bg + rng.uniform(0.0, 0.15) * (stripes - 0.5)
    image = np.where(mask, fg, background) + rng.normal(0, 0.04, (size, size, 3))
    return (np.clip(image, 0, 1) * 255).astype(np.uint8), mask[..., 0]


def generate(root: str | Path, n_train: int = 200, n_val: int = 30, size: int = 36, seed: int = 0) -> Path:
    """Write ``root/{train,val}/<class>/*.png`` once; later calls with the same parameters return at once."""
    root = Path(root)
    params = {"n_train": n_train, "n_val": n_val, "size": size, "seed": seed, "classes": CLASSES}
    marker = root / MARKER
    if marker.is_file() and json.loads(marker.read_text()) == params:
        return root
    if root.exists() and any(root.iterdir()):
        if not marker.is_file():
            raise DatasetError(f"{root} exists and is not a generated demo set; refusing to write into it")
        for split in ("train", "val"):  # our own earlier generation, with other parameters
            shutil.rmtree(root / split, ignore_errors=True)
        marker.unlink()
    print(f"Generating the demo classification set ({len(CLASSES)} classes, {n_train}+{n_val} per class)")
    rng = np.random.default_rng(seed)
    for split, count in (("train", n_train), ("val", n_val)):
        for label, name in enumerate(CLASSES):
            folder = root / split / name
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                Image.fromarray(render(label, size, rng)).save(folder / f"{name}_{i:04d}.png")
    marker.write_text(json.dumps(params))
    return root
