"""Backbone files for tests that need one to exist and be read, not trained from: every key and shape of the
real file, a few hundred kB (the ``backbones`` fixture of conftest.py)."""

from __future__ import annotations

import os
from pathlib import Path
from unittest import mock

import torch


class Backbones:
    """Backbone files as stage 1 writes them (``save_backbone``), and torchvision state dicts, built once per
    session on the meta device with zero-strided tensors: every key and shape of the real file, a few hundred kB."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.built: dict[tuple, Path] = {}

    @staticmethod
    def _light(model: torch.nn.Module) -> dict[str, torch.Tensor]:
        return {
            k: torch.zeros((), dtype=v.dtype).expand(v.shape)
            for k, v in model.state_dict().items()
            if not k.startswith("fc.")
        }

    def stage1(self, norm: str, arch: str = "resnet101", norm_batch_size: int | None = 2) -> Path:
        from mabn.models import backbone, resnet, save_backbone

        key = ("stage1", norm, arch, norm_batch_size)
        if key not in self.built:
            with torch.device("meta"):
                model = resnet(norm, norm_batch_size=norm_batch_size if norm != "gn" else None, arch=arch)
            config = {
                "model": {"norm": norm, "arch": arch, "norm_batch_size": norm_batch_size},
                "data": {},
                "run_dir": f"runs/pretrain/{norm}",
            }
            path = self.folder / f"{len(self.built)}-{arch}-{norm}.pt"
            with mock.patch.object(backbone, "backbone_state", self._light):
                save_backbone(path, model, norm, config, None, arch)
            self.built[key] = path
        return self.built[key]

    def torchvision(self, arch: str = "resnet101") -> Path:
        import torchvision

        key = ("torchvision", arch)
        if key not in self.built:
            with torch.device("meta"):
                model = getattr(torchvision.models, arch)()
            path = self.folder / f"{len(self.built)}-{arch}-torchvision.pth"
            torch.save({k: torch.zeros((), dtype=v.dtype).expand(v.shape) for k, v in model.state_dict().items()}, path)
            self.built[key] = path
        return self.built[key]

    def place(self, source: Path, target: Path) -> Path:
        target.parent.mkdir(parents=True, exist_ok=True)
        os.link(source, target)
        return target


def trained_like(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with every BatchNorm's affine and running statistics away from their initial values, as after
    training (the same draw every call)."""
    generator = torch.Generator().manual_seed(3)
    for layer in model.modules():
        if isinstance(layer, torch.nn.BatchNorm2d):
            c = layer.num_features
            layer.weight.data = torch.rand(c, generator=generator) + 0.5
            layer.bias.data = torch.randn(c, generator=generator) * 0.1
            layer.running_mean = torch.randn(c, generator=generator) * 0.2
            layer.running_var = torch.rand(c, generator=generator) * 2 + 0.1
    return model
