"""What both stages' LightningModules share."""

from __future__ import annotations

import pytorch_lightning as pl
import torch

from ..callbacks import norm_callbacks


class NormTask(pl.LightningModule):
    """A LightningModule around ``self.model`` whose norms may be callback-managed (MABN2d, BatchRenorm2d)."""

    model: torch.nn.Module

    def configure_callbacks(self) -> list[pl.Callback]:
        # norm_policy holds the MABNCallback's arguments; models without managed norms get no callback.
        return norm_callbacks(self.model, self.hparams.norm_policy)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)
