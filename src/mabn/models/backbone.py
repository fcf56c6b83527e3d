"""The stage 1 -> stage 2 hand-off: a backbone file in ``pretrain/`` (format documented in pretrain/README.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..files import load_weights_file, write_atomic
from ..norm import NORM_PRESETS

FORMAT = "mabn-backbone"
VERSION = 1


class BackboneError(ValueError):
    """A backbone file that is missing, malformed, or does not fit the requested model."""


def backbone_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """A ResNet's weights under torchvision's keys, without the classifier (``fc``)."""
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items() if not k.startswith("fc.")}


def save_backbone(
    path: str | Path, model: nn.Module, norm: str, config: dict[str, Any], val_top1: float | None
) -> Path:
    """Write ``model``'s backbone with what stage 2 needs to trust it."""
    payload = {
        "format": FORMAT,
        "version": VERSION,
        "arch": "resnet101",
        "norm": norm,
        "centralized": NORM_PRESETS[norm].centralize_weights,
        "state_dict": backbone_state(model),
        "config": config,
        "val_top1": val_top1,
    }
    return write_atomic(path, lambda tmp: torch.save(payload, tmp))


def load_backbone(path: str | Path, norm: str) -> dict[str, Any]:
    """Read a backbone file and check that it was trained with ``norm``; returns the payload."""
    path = Path(path)
    payload = load_weights_file(path, "backbone file", BackboneError)
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise BackboneError(f"{path} is not a {FORMAT} file (see pretrain/README.md for the format)")
    if payload.get("version") != VERSION:
        raise BackboneError(f"{path} has format version {payload.get('version')}, this code reads {VERSION}")
    if payload["norm"] != norm:
        raise BackboneError(
            f"norm mismatch: backbone {path} was pre-trained with norm {payload['norm']!r}, "
            f"but the model asks for norm {norm!r}; pre-train with that norm or pick a matching backbone"
        )
    return payload


def load_backbone_into(encoder: nn.Module, path: str | Path, norm: str) -> dict[str, Any]:
    """Load a backbone file into a ResNet-101 encoder built with ``norm``, with strict key checking.

    Returns the payload (without weights) so callers can report where the backbone came from.
    """
    payload = load_backbone(path, norm)
    try:
        encoder.load_state_dict(payload["state_dict"], strict=True)
    except RuntimeError as err:  # missing, unexpected or mis-shaped keys
        raise BackboneError(f"{path} does not fit the {norm} encoder: {err}") from err
    return {k: v for k, v in payload.items() if k != "state_dict"}
