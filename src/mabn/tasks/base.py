"""What both stages' LightningModules share."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytorch_lightning as pl
import torch

from ..callbacks import norm_callbacks
from ..cudagraph import check_capturable, training_call
from ..errors import ConfigError
from ..norm import NORM_PRESETS


def require(ok: bool, name: str, value: Any, wanted: str) -> None:
    """A ``ConfigError`` naming the argument, its value and what would work, unless ``ok``."""
    if not ok:
        raise ConfigError(f"{name}={value!r}: {wanted}")


class NormTask(pl.LightningModule):
    """A LightningModule around ``self.model`` whose norms may be callback-managed (MABN2d, BatchRenorm2d).

    With the ``cuda_graph`` hyperparameter set, the model's training forward and backward are captured as
    CUDA graphs at the first training batch and replayed afterwards (``mabn.cudagraph``).
    """

    model: torch.nn.Module

    @classmethod
    def check_hparams(cls, hp: Mapping[str, Any]) -> None:
        """Refuse arguments that cannot train, before any data or weights are read (the CLI calls this on the
        parsed config; ``__init__`` on its own arguments). Subclasses add their own."""
        norm = hp.get("norm")
        require(norm in NORM_PRESETS, "norm", norm, f"choose one of {', '.join(sorted(NORM_PRESETS))}")
        size = hp.get("norm_batch_size")
        require(size is None or (isinstance(size, int) and size >= 1), "norm_batch_size", size, "must be >= 1")
        require(hp.get("base_lr", 1) > 0, "base_lr", hp.get("base_lr"), "must be > 0")
        require(0 <= hp.get("momentum", 0) < 1, "momentum", hp.get("momentum"), "must be in [0, 1)")
        require(hp.get("weight_decay", 0) >= 0, "weight_decay", hp.get("weight_decay"), "must be >= 0")

    @property
    def cuda_graph(self) -> bool:
        return bool(self.hparams.get("cuda_graph", False))

    def on_fit_start(self) -> None:
        if self.cuda_graph:  # fail before any data is loaded
            check_capturable(self.model, self.device)

    def training_forward(self, images: torch.Tensor) -> object:
        """``self.model(images)`` in a training step: captured at the first call with ``cuda_graph``."""
        return training_call(self.model, images, self.cuda_graph)

    def configure_callbacks(self) -> list[pl.Callback]:
        # norm_policy holds the MABNCallback's arguments; models without managed norms get no callback.
        return norm_callbacks(self.model, self.hparams.norm_policy)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)
