"""A small generated street-scene set in the official Cityscapes layout, for demos and tests.

Each image is a perspective street: sky on top, buildings and trees along a random horizon, a road
narrowing towards a vanishing point with sidewalks beside it, cars (rounded boxes) on the road, thin poles
and small upright persons on the sidewalks, and a few unlabeled (labelId 0) patches. Labels are real
Cityscapes labelIds written to ``*_gtFine_labelIds.png``.

The classes are learnable but colour alone is ambiguous: class colours are drawn per image around nearby,
greyish means with a large jitter (cars take any colour), under a random illumination gain, colour cast
and vertical shading. What separates the classes is position (sky high, road low and central, sidewalks
at the sides), shape (boxes, thin verticals, small blobs) and texture (window grids on buildings, paving
lines on sidewalks, blotchy foliage, smooth sky, lane marks on the road).

``python -m mabn demo-data cityscapes`` writes the set the demo profile uses.
"""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
from PIL import Image

from ..cityscapes import LABEL_IDS
from ..once import MARKER as MARKER  # the marker launch waits for on other nodes
from ..once import write_marked

CITIES = {"train": ("demoburg", "synthville"), "val": ("mockton", "fakeford")}
FRAME = 19  # Cityscapes annotates frame 19 of each 30-frame snippet
GENERATOR = "mabn.data.synthetic.cityscapes/1"  # bump when the rendering changes, so old sets are rewritten

# Mean RGB (0..1) per class: close to each other and greyish, so colour alone is ambiguous.
_MEAN_COLOR = {
    "unlabeled": (0.45, 0.45, 0.45),
    "road": (0.42, 0.40, 0.44),
    "sidewalk": (0.52, 0.48, 0.50),
    "building": (0.46, 0.44, 0.42),
    "pole": (0.48, 0.48, 0.50),
    "vegetation": (0.36, 0.46, 0.32),
    "sky": (0.56, 0.62, 0.70),
    "person": (0.44, 0.38, 0.40),
    "car": (0.50, 0.50, 0.50),
}


def _smooth_noise(rng: np.random.Generator, shape: tuple[int, int], scale: float) -> np.ndarray:
    """Zero-mean, unit-ish noise with blobs about ``scale`` pixels wide."""
    h, w = shape
    small = rng.normal(size=(max(2, round(h / scale)), max(2, round(w / scale)))).astype(np.float32)
    return cv2.resize(small, (w, h), interpolation=cv2.INTER_CUBIC)


def _color(rng: np.random.Generator, name: str, jitter: float = 0.12) -> np.ndarray:
    return np.asarray(_MEAN_COLOR[name], np.float32) + rng.normal(0.0, jitter, 3).astype(np.float32)


class _Scene:
    """Paints one image and its labelIds; later paints occlude earlier ones, like depth order."""

    def __init__(self, rng: np.random.Generator, height: int, width: int) -> None:
        self.rng = rng
        self.h, self.w = height, width
        self.y, self.x = np.mgrid[0:height, 0:width].astype(np.float32)
        self.image = np.zeros((height, width, 3), np.float32)
        self.label = np.zeros((height, width), np.uint8)

    def paint(self, mask: np.ndarray, name: str, texture: np.ndarray) -> None:
        """Label ``mask`` as ``name`` and fill it with the HxWx3 ``texture``."""
        self.image[mask] = texture[mask]
        self.label[mask] = LABEL_IDS[name]

    def flat(self, name: str, contrast: float, scale: float, jitter: float = 0.12) -> np.ndarray:
        """A class colour modulated by smooth noise of ``contrast`` and blob size ``scale``."""
        base = _color(self.rng, name, jitter)
        return base + contrast * _smooth_noise(self.rng, (self.h, self.w), scale)[..., None]


def _sky(s: _Scene) -> np.ndarray:
    # A smooth vertical gradient with faint clouds: the one class with almost no texture.
    top, bottom = _color(s.rng, "sky"), _color(s.rng, "sky")
    t = (s.y / s.h)[..., None]
    return top * (1 - t) + bottom * t + 0.03 * _smooth_noise(s.rng, (s.h, s.w), 24.0)[..., None]


def _building(s: _Scene) -> np.ndarray:
    # Facade with a grid of darker (or lighter) windows.
    base = s.flat("building", 0.04, 10.0)
    px, py = s.rng.uniform(7, 12), s.rng.uniform(8, 14)
    windows = ((s.x % px) < px * 0.55) & ((s.y % py) < py * 0.5)
    return base + s.rng.choice([-1.0, 1.0]) * s.rng.uniform(0.12, 0.22) * windows[..., None]


def _vegetation(s: _Scene) -> np.ndarray:
    # Blotchy, high-contrast foliage.
    return s.flat("vegetation", 0.10, 2.0) + 0.05 * _smooth_noise(s.rng, (s.h, s.w), 6.0)[..., None]


def _road(s: _Scene, vx: float, horizon: float) -> np.ndarray:
    # Fine grain plus dashed lane marks converging to the vanishing point.
    base = s.flat("road", 0.03, 1.5)
    depth = np.maximum(s.y - horizon, 1.0)
    lateral = (s.x - vx) / depth  # constant along lines through the vanishing point
    dashes = (np.abs(lateral) < 0.035) & ((np.log(depth) * 6.0) % 2.0 < 1.0)
    return base + s.rng.uniform(0.15, 0.3) * dashes[..., None]


def _sidewalk(s: _Scene) -> np.ndarray:
    # Paving slabs: a grid of thin joints.
    base = s.flat("sidewalk", 0.03, 3.0)
    p = s.rng.uniform(5, 9)
    joints = ((s.x % p) < 1.0) | ((s.y % (p * 0.6)) < 1.0)
    return base - s.rng.uniform(0.08, 0.16) * joints[..., None]


def _car(s: _Scene, mask_top: float, height: float) -> np.ndarray:
    # Any body colour, a dark window band in the upper part, smooth paint.
    body = s.rng.uniform(0.1, 0.9, 3).astype(np.float32)
    window = (s.y > mask_top + 0.12 * height) & (s.y < mask_top + 0.42 * height)
    image = np.broadcast_to(body, (s.h, s.w, 3)) + 0.02 * _smooth_noise(s.rng, (s.h, s.w), 4.0)[..., None]
    return np.where(window[..., None], image * 0.35, image)


def _person(s: _Scene, top: float, height: float) -> np.ndarray:
    # Two-tone: upper body and legs in different clothes colours.
    upper, lower = _color(s.rng, "person", 0.2), _color(s.rng, "person", 0.2)
    return np.where((s.y < top + 0.55 * height)[..., None], upper, lower) + np.zeros((s.h, s.w, 3), np.float32)


def render(rng: np.random.Generator, height: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """One scene: uint8 RGB image HxWx3 and uint8 Cityscapes labelIds HxW."""
    s = _Scene(rng, height, width)
    h, w, y, x = height, width, s.y, s.x
    horizon = h * rng.uniform(0.38, 0.5)
    vx = w * rng.uniform(0.35, 0.65)

    s.paint(np.ones((h, w), bool), "sky", _sky(s))

    # Buildings: a row of blocks with random widths and heights standing on the horizon.
    edges = np.cumsum(rng.uniform(0.08, 0.25, 12) * w)
    tops = horizon - rng.uniform(0.15, 0.85, 12) * horizon
    starts = np.concatenate([[0.0], edges[:-1]])
    gaps = rng.random(12) < 0.2  # open sky between some blocks
    facade = np.zeros((h, w), bool)
    for x0, x1, top, gap in zip(starts, edges, tops, gaps):
        if not gap:
            facade |= (x >= x0) & (x < x1) & (y >= top) & (y < horizon + 1)
    s.paint(facade, "building", _building(s))

    # Trees: clusters of discs in front of the facades.
    trees = np.zeros((h, w), bool)
    for _ in range(rng.integers(1, 5)):
        cx, cy, r = rng.uniform(0, w), horizon - rng.uniform(0.05, 0.4) * h, rng.uniform(0.06, 0.14) * h
        for _ in range(4):
            ox, oy = rng.normal(0, r * 0.6, 2)
            trees |= (x - cx - ox) ** 2 + (y - cy - oy) ** 2 < (r * rng.uniform(0.6, 1.0)) ** 2
    s.paint(trees & (y < horizon + 2), "vegetation", _vegetation(s))

    # Ground: road between two lines through the vanishing point, sidewalks outside them.
    depth = y - horizon
    ground = depth > 0
    road_slope = rng.uniform(1.4, 2.2)  # road half-width per row below the horizon
    road = ground & (np.abs(x - vx) < road_slope * depth)
    s.paint(ground & ~road, "sidewalk", _sidewalk(s))
    s.paint(road, "road", _road(s, vx, horizon))

    # Things standing on the ground, painted far to near. Their size grows with distance below the horizon.
    things = [("car", rng.uniform(0.15, 1.0)) for _ in range(rng.integers(0, 4))]
    things += [("pole", rng.uniform(0.2, 1.0)) for _ in range(rng.integers(1, 4))]
    things += [("person", rng.uniform(0.15, 1.0)) for _ in range(rng.integers(0, 5))]
    for name, t in sorted(things, key=lambda item: item[1]):
        base_y = horizon + t * (h - horizon)
        d = base_y - horizon
        if name == "car":
            cw, ch = d * rng.uniform(1.0, 1.4), d * rng.uniform(0.45, 0.6)
            cx = vx + rng.uniform(-0.5, 0.5) * road_slope * d
            u, v = (x - cx) / (cw / 2), (y - (base_y - ch / 2)) / (ch / 2)
            top = base_y - ch
            s.paint(u**4 + v**4 < 1.0, "car", _car(s, top, ch))
        elif name == "pole":
            side = rng.choice([-1.0, 1.0])
            px = vx + side * d * (road_slope + rng.uniform(0.15, 0.6))
            half = max(0.6, d * 0.02)
            pole = (np.abs(x - px) < half) & (y <= base_y) & (y > base_y - d * rng.uniform(2.5, 4.0))
            s.paint(pole, "pole", s.flat("pole", 0.02, 8.0))
        else:
            side = rng.choice([-1.0, 1.0])
            px = vx + side * d * (road_slope + rng.uniform(0.2, 0.9))
            ph = d * rng.uniform(0.35, 0.5)
            top = base_y - ph
            body = ((x - px) / (ph * 0.17)) ** 2 + ((y - (base_y - ph * 0.42)) / (ph * 0.42)) ** 2 < 1.0
            head = (x - px) ** 2 + (y - (top + ph * 0.08)) ** 2 < (ph * 0.1) ** 2
            s.paint(body | head, "person", _person(s, top, ph))

    # Unlabeled clutter: a few small noisy patches anywhere.
    for _ in range(rng.integers(1, 4)):
        cx, cy, rx, ry = rng.uniform(0, w), rng.uniform(0, h), rng.uniform(2, 8), rng.uniform(2, 8)
        s.paint(((x - cx) / rx) ** 2 + ((y - cy) / ry) ** 2 < 1.0, "unlabeled", s.flat("unlabeled", 0.15, 1.5))

    # Per-image illumination: gain, colour cast and vertical shading act on every class alike.
    gain = rng.uniform(0.65, 1.3)
    cast = rng.normal(0.0, 0.05, 3).astype(np.float32)
    shade = 1.0 + rng.uniform(-0.25, 0.25) * (y / h - 0.5)
    image = (s.image * gain + cast) * shade[..., None] + rng.normal(0.0, 0.02, (h, w, 3))
    return (np.clip(image, 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8), s.label


def _demo_files(root: Path) -> list[Path]:
    """Files an earlier generation may have written: only the demo cities' image and label PNGs."""
    found: list[Path] = []
    for split, cities in CITIES.items():
        for city in cities:
            found += (root / "leftImg8bit" / split / city).glob(f"{city}_??????_??????_leftImg8bit.png")
            found += (root / "gtFine" / split / city).glob(f"{city}_??????_??????_gtFine_labelIds.png")
    return found


def generate(
    root: str | Path, n_train: int = 48, n_val: int = 12, size: tuple[int, int] = (128, 256), seed: int = 0
) -> Path:
    """Write the demo set under ``root`` (``size`` is (height, width)) and return ``root``.

    Deterministic in its arguments. The marker ``root/.complete`` (the parameters as JSON) is written
    last, so a second call with the same parameters returns at once; an interrupted generation (marked
    by ``root/.generating``) or one with other parameters is rewritten, deleting only the demo's own files.
    A non-empty ``root`` without either marker is refused with a ``DatasetError``.
    """
    height, width = size
    params = {"generator": GENERATOR, "n_train": n_train, "n_val": n_val, "size": [height, width], "seed": seed}

    def write(root: Path) -> None:
        for split_index, (split, count) in enumerate((("train", n_train), ("val", n_val))):
            cities = CITIES[split]
            for i in range(count):
                city = cities[i % len(cities)]
                image, label = render(np.random.default_rng([seed, split_index, i]), height, width)
                stem = f"{city}_{i:06d}_{FRAME:06d}"
                image_dir = root / "leftImg8bit" / split / city
                label_dir = root / "gtFine" / split / city
                image_dir.mkdir(parents=True, exist_ok=True)
                label_dir.mkdir(parents=True, exist_ok=True)
                Image.fromarray(image).save(image_dir / f"{stem}_leftImg8bit.png")
                Image.fromarray(label).save(label_dir / f"{stem}_gtFine_labelIds.png")
        print(f"Wrote the demo Cityscapes set ({n_train} train + {n_val} val images, {height}x{width})")

    return write_marked(root, params, _demo_files, write, "Demo Cityscapes set")
