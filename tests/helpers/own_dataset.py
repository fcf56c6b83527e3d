"""A dataset of one's own (docs/your-data.md) made with PIL, and ``python -m mabn segment`` run on it in this process:
the issue's new user's dataset of 32 training images of 96x128 with 3 classes by default."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from helpers.commands import run_mabn

TRAIN, VAL, HEIGHT, WIDTH = 32, 4, 96, 128


def bands(root: Path, size: tuple[int, int] = (HEIGHT, WIDTH), train: int = TRAIN) -> Path:
    """Write ``train`` training and ``VAL`` validation pairs of ``size`` (height, width) under ``root``: random
    images, masks of three vertical bands of classes 0, 1 and 2; returns ``root``."""
    rng = np.random.default_rng(0)
    height, width = size
    for split, count in (("train", train), ("val", VAL)):
        for kind in ("images", "masks"):
            (root / kind / split).mkdir(parents=True)
        for i in range(count):
            image = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
            Image.fromarray(image).save(root / "images" / split / f"{i:03d}.png")
            mask = np.zeros((height, width), np.uint8)
            mask[:, width // 3 :] = 1
            mask[:, 2 * width // 3 :] = 2
            Image.fromarray(mask).save(root / "masks" / split / f"{i:03d}.png")
    (root / "classes.yaml").write_text("classes: [sky, grass, road]\n")
    return root


def segment(
    data: Path, run: Path, capsys: pytest.CaptureFixture[str], *extra: str, dry_run: bool = True
) -> tuple[int, list[str], str]:
    """(exit status, stdout lines, stderr) of ``python -m mabn segment --norm mabn --backbone none`` on ``data``
    into ``run``, with ``extra`` LightningCLI arguments."""
    argv = ["segment", "--data", str(data), "--norm", "mabn", "--backbone", "none", "--run-dir", str(run)]
    code, out, err = run_mabn([*argv, *(["--dry-run"] if dry_run else []), "--", *extra], capsys)
    return code, out.splitlines(), err


def line(lines: list[str], prefix: str) -> str:
    """The one line of ``lines`` that starts with ``prefix``."""
    found = [text for text in lines if text.startswith(prefix)]
    assert len(found) == 1, lines
    return found[0]
