"""A generated example of a dataset of the user's own, in the layout ``python -m mabn segment --data DIR`` reads
(``mabn.data.folder``, docs/your-data.md): the demo street scenes of ``demo_cityscapes`` as

    DIR/images/{train,val}/scene<i>.jpg     the images, as JPEG
    DIR/masks/{train,val}/scene<i>.png      their masks, holding the scenes' Cityscapes labelIds (0 unlabelled)
    DIR/classes.yaml                        8 classes, their colours, ignore_index 0 and the labelId -> class map

so the example uses every part of ``classes.yaml``. With ``mask_format="color"`` the masks are RGB images of the
class colours instead, unlabelled pixels black, and ``classes.yaml`` says ``mask_format: color`` and
``ignore_color: [0, 0, 0]``: the same classes per pixel as the index masks. ``python -m mabn demo-data segment``
writes the set the demo profile of ``make segment`` (no ``DATA``) uses; the tests write small ones.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from ..cityscapes import LABEL_IDS
from ..classes import CLASSES_FILE, COLOR, INDEX
from ..once import MARKER as MARKER  # the marker launch waits for on other nodes
from ..once import write_marked
from ..pairs import IMAGES, MASKS
from .cityscapes import render

GENERATOR = "mabn.data.synthetic.segment/1"  # bump when the files change, so old sets are rewritten
JPEG_QUALITY = 95
# The example's classes, their Cityscapes colours; the masks hold their Cityscapes labelIds (cityscapes.LABEL_IDS).
COLORS = {
    "road": (128, 64, 128),
    "sidewalk": (244, 35, 232),
    "building": (70, 70, 70),
    "pole": (153, 153, 153),
    "vegetation": (107, 142, 35),
    "sky": (70, 130, 180),
    "person": (220, 20, 60),
    "car": (0, 0, 142),
}
UNLABELLED = (0, 0, 0)  # the colour of unlabelled pixels in colour masks


def classes_yaml(mask_format: str = INDEX) -> str:
    """The example's ``classes.yaml`` for masks of ``mask_format`` (``index``: Cityscapes labelIds; ``color``)."""
    names = list(COLORS)
    colors = ", ".join(f"[{r}, {g}, {b}]" for r, g, b in COLORS.values())
    head = f"classes: [{', '.join(names)}]\ncolors: [{colors}]\n"
    if mask_format == COLOR:
        return (
            "# The generated example's classes (mabn.data.synthetic.segment): each mask pixel is its class's colour.\n"
            f"{head}mask_format: color\nignore_color: [{', '.join(map(str, UNLABELLED))}]   # unlabelled\n"
        )
    values = ", ".join(f"{LABEL_IDS[name]}: {name}" for name in names)
    return (
        "# The generated example's classes (mabn.data.synthetic.segment): the masks hold Cityscapes labelIds.\n"
        f"{head}ignore_index: 0   # unlabelled\nmask_values: {{{values}}}\n"
    )


def _label_colors() -> np.ndarray:
    """labelId -> the colour of its class, for every uint8 labelId (``UNLABELLED`` where no class of the example)."""
    lut = np.tile(np.asarray(UNLABELLED, dtype=np.uint8), (256, 1))
    for name, color in COLORS.items():
        lut[LABEL_IDS[name]] = color
    return lut


def generate(
    root: str | Path,
    n_train: int = 48,
    n_val: int = 12,
    size: tuple[int, int] = (128, 256),
    seed: int = 0,
    mask_format: str = INDEX,
) -> Path:
    """Write the example under ``root`` (``size`` is (height, width)), its masks as ``mask_format`` (``index``:
    labelIds, ``color``: class colours), and return ``root``.

    Deterministic in its arguments; written under the markers of ``once.write_marked``: a second call with the
    same parameters returns at once, an interrupted one or one with others rewrites the set, and a non-empty
    ``root`` without a marker of this generator is refused with a ``DatasetError``.
    """
    height, width = size
    if mask_format not in (INDEX, COLOR):
        raise ValueError(f"mask_format={mask_format!r}: {INDEX} or {COLOR}")
    params = {"generator": GENERATOR, "n_train": n_train, "n_val": n_val, "size": [height, width], "seed": seed}
    if mask_format == COLOR:  # index sets keep the parameters (and so the markers) they were written with
        params["mask_format"] = COLOR
    colors = _label_colors() if mask_format == COLOR else None

    def own_files(root: Path) -> list[Path]:
        scenes = [p for part in (IMAGES, MASKS) for p in (root / part).glob("*/scene[0-9][0-9][0-9].*")]
        return scenes + [p for p in (root / CLASSES_FILE,) if p.is_file()]

    def write(root: Path) -> None:
        for split_index, (split, count) in enumerate((("train", n_train), ("val", n_val))):
            (root / IMAGES / split).mkdir(parents=True, exist_ok=True)
            (root / MASKS / split).mkdir(parents=True, exist_ok=True)
            for i in range(count):
                image, label = render(np.random.default_rng([seed, split_index, i]), height, width)
                Image.fromarray(image).save(root / IMAGES / split / f"scene{i:03d}.jpg", quality=JPEG_QUALITY)
                mask = label if colors is None else colors[label]
                Image.fromarray(mask).save(root / MASKS / split / f"scene{i:03d}.png")
        (root / CLASSES_FILE).write_text(classes_yaml(mask_format))
        print(f"Wrote the example data set ({n_train} train + {n_val} val images, {height}x{width})")

    return write_marked(root, params, own_files, write, "Example data set")
