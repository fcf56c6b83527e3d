"""The two-norm task the DDP tests fit: MABN2d and BatchRenorm2d with short timelines, so that a checkpoint
gathers every device's streams. Apart from ``helpers.ddp_layers``, whose spawned processes need no Lightning."""

from __future__ import annotations

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from helpers.ddp_layers import BRN_KW, MABN_KW
from mabn import BatchRenorm2d, MABN2d
from mabn.callbacks import norm_callbacks


class Tiny(pl.LightningModule):
    """conv -> MABN2d -> conv -> BatchRenorm2d -> dropout -> linear, with short norm timelines."""

    def __init__(self, sync: bool = False, norm_batch_size: int | None = 2, dropout: float = 0.2,
                 loss_scale: float = 1.0, lr: float = 0.05) -> None:  # fmt: skip
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.model = nn.Sequential(
            nn.Conv2d(3, 4, 3, padding=1, bias=False),
            MABN2d(4, norm_batch_size=norm_batch_size, sync_stats=sync, **MABN_KW),
            nn.ReLU(),
            nn.Conv2d(4, 4, 3, padding=1),
            BatchRenorm2d(4, norm_batch_size=norm_batch_size, sync_stats=sync, **BRN_KW),
            nn.ReLU(), nn.Dropout(dropout), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3),
        )  # fmt: skip

    def configure_callbacks(self):
        return norm_callbacks(self.model, None)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.hparams.loss_scale * F.cross_entropy(self.model(x), y)

    def training_step(self, batch, batch_idx):
        return self.loss(*batch)

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", self.loss(*batch), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


def tiny_dataset(n: int, dtype=torch.float32, seed: int = 0) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    x = 2.0 * torch.randn(n, 3, 6, 6, generator=gen, dtype=torch.float64) + 0.5
    return TensorDataset(x.to(dtype), torch.randint(0, 3, (n,), generator=gen))
