"""Reading the weight files the stages hand each other (checkpoints, backbone files), with errors naming them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def first_line(err: BaseException) -> str:
    """The first line of an exception's message (its type when the message is empty)."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def load_weights_file(path: Path, what: str, error: type[Exception]) -> Any:
    """``torch.load`` of ``path`` on the CPU, weights only; ``error`` naming ``what`` and the path when the file
    is missing or unreadable."""
    if not path.is_file():
        raise error(f"{what} not found: {path}")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises several types for a corrupt or foreign file
        raise error(f"{path} is not a readable {what}: {first_line(err)}") from err
