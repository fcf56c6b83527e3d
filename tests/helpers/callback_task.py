"""The small two-group MABN task that the callback, loss-scale and CUDA-graph tests fit on a real Trainer."""

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from mabn import convert_norm
from mabn.callbacks import norm_callbacks


class Tiny(pl.LightningModule):
    """An encoder and a head, each with one MABN2d (ghost batches of 2, buffer 4)."""

    def __init__(self, norm_policy=None, backbone=None, record=False):
        super().__init__()
        self.save_hyperparameters()
        self.model = nn.Module()
        self.model.encoder = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.model.head = nn.Sequential(
            nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
            nn.Linear(8, 3),
        )  # fmt: skip
        convert_norm(self.model, "mabn", norm_batch_size=2, buffer_size=4, momentum=0.9)
        self.seen = []  # per micro-batch: (global step, encoder uses moving stats, renormalizes; same for head)

    def norms(self):
        return self.model.encoder[1], self.model.head[1]

    def configure_callbacks(self):
        return norm_callbacks(self.model, self.hparams.norm_policy)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.model.head(self.model.encoder(x)), y)
        if self.hparams.record:
            state = [self.global_step]
            for layer in self.norms():
                s = layer.last_stats
                state += [bool(s["active"].any()), bool((s["r"] != 1).any())]
            self.seen.append(tuple(state))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)


def loader(n=16):
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(n, 3, 8, 8, generator=gen) + 0.5, torch.randint(0, 3, (n,), generator=gen))
    return DataLoader(data, batch_size=4, shuffle=False)


POLICY = {
    "groups": {
        "encoder": {"prefixes": ["model.encoder"], "moving_stats_first_step": 2, "renorm_first_step": 5},
        "head": {"prefixes": ["model.head"], "moving_stats_first_step": 5, "renorm_first_step": 7},
    },
    "log_every_n_steps": 1,
    "log_layers": ["model.encoder.1", "model.head.1"],
}
