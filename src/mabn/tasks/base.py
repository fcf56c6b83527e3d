"""What both stages' LightningModules share."""

from __future__ import annotations

import pytorch_lightning as pl
import torch

from ..callbacks import norm_callbacks
from ..cudagraph import check_capturable, training_call


class NormTask(pl.LightningModule):
    """A LightningModule around ``self.model`` whose norms may be callback-managed (MABN2d, BatchRenorm2d).

    With the ``cuda_graph`` hyperparameter set, the model's training forward and backward are captured as
    CUDA graphs at the first training batch and replayed afterwards (``mabn.cudagraph``).
    """

    model: torch.nn.Module

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
