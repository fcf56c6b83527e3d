"""SyncBatchNormCheck: stop a run that asks for synchronized BatchNorm where it cannot synchronize."""

from __future__ import annotations

import pytorch_lightning as pl
from torch import nn

from ..norm.factory import layer_classes


class SyncBatchNormCheck(pl.Callback):
    """Fail fast, before the first step, when a model with ``nn.SyncBatchNorm`` runs on one device or on CPUs.

    On one device SyncBatchNorm silently degrades to BatchNorm (the run would be labelled syncbn and be
    plain bn); on CPU processes torch has no kernel for it and the first training forward fails deep in
    the model.
    """

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return  # evaluation does not synchronize: SyncBatchNorm is BatchNorm in eval mode
        if trainer.world_size < 2:
            raise ValueError(
                f"norm 'syncbn' synchronizes BatchNorm across devices, but this run has {trainer.world_size} "
                "device: use norm 'bn' (or run on several GPUs, e.g. GPUS=2)"
            )
        device = trainer.strategy.root_device
        if device.type != "cuda":
            raise ValueError(
                f"norm 'syncbn' needs GPUs (torch's SyncBatchNorm has no {device.type} kernel), but this run's "
                f"{trainer.world_size} processes are on {device.type}: use norm 'bn', 'brn' or 'mabn' "
                "(sync_stats: true shares MABN/BRN statistics across CPU processes)"
            )


def has_sync_batchnorm(module: nn.Module) -> bool:
    """Whether ``module`` holds a layer of a norm that synchronizes across devices (its entry's ``sync``: the
    ``nn.SyncBatchNorm`` of norm "syncbn")."""
    synchronized = layer_classes(lambda entry: entry.sync)
    return any(isinstance(m, synchronized) for m in module.modules())
