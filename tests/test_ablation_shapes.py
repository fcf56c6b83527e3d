"""The ablation's generated set: deterministic, written once, degraded as documented, never over a foreign folder."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from mabn.data.errors import DatasetError
from mabn.tools.ablation import shapes


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*.png"))}


def test_generated_once_and_deterministic(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = shapes.generate(tmp_path / "a", n_train=2, n_val=3, size=16)
    assert "Generating" in capsys.readouterr().out  # into a scratch folder beside a, renamed when complete
    assert len(list((a / "train").rglob("*.png"))) == 20 and len(list((a / "val").rglob("*.png"))) == 30
    first = _files(a)
    assert shapes.generate(tmp_path / "a", n_train=2, n_val=3, size=16) == a
    assert capsys.readouterr().out == ""  # found complete: nothing written again
    assert _files(shapes.generate(tmp_path / "b", n_train=2, n_val=3, size=16)) == first
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".") and p.is_dir()]  # no scratch folder left

    shapes.generate(tmp_path / "a", n_train=2, n_val=3, size=16, noise=0.3)  # other parameters: rewritten
    assert _files(a).keys() == first.keys() and _files(a) != first


def test_degrade_fades_and_adds_noise() -> None:
    image = np.zeros((64, 64, 3), np.uint8)
    image[:, 32:] = 200
    out = shapes.degrade(image, fade=0.5, noise=0.0, rng=np.random.default_rng(0)).astype(float)
    assert out[:, 32:].mean() - out[:, :32].mean() == pytest.approx(100, abs=1)  # contrast halved
    noisy = shapes.degrade(image, fade=0.5, noise=0.1, rng=np.random.default_rng(0)).astype(float)
    assert (noisy - out)[:, :32].std() == pytest.approx(25.5, rel=0.05)  # std 0.1 of the 0-255 range


def test_refuses_a_folder_it_did_not_write(tmp_path: Path) -> None:
    (tmp_path / "mine").mkdir()
    Image.new("RGB", (4, 4)).save(tmp_path / "mine" / "photo.png")
    with pytest.raises(DatasetError, match="is not a generated ablation set"):
        shapes.generate(tmp_path / "mine", n_train=1, n_val=1, size=16)
    assert (tmp_path / "mine" / "photo.png").is_file()
