"""A seconds-long task for the CLI's run-folder tests, run in subprocesses (``PYTHONPATH`` includes tests/).

``TinyTask`` trains a linear classifier on 32 fixed samples; every epoch ends with a validation whose
``val/acc`` ModelCheckpoint monitors. ``$TINY_KILL_AT_STEP`` kills the process at that step, as an
out-of-memory kill or a node failure would. ``SlowCheckpointIO`` stops inside the write of the checkpoint
at ``$TINY_SLOW_SAVE_AT_STEP``, after the bytes are in the temporary file and before the rename, and touches
``$TINY_SAVING_MARKER`` so a test can kill the process exactly then.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from mabn.files import AtomicCheckpointIO, write_atomic


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 4, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


class TinyTask(pl.LightningModule):
    def __init__(self, norm: str = "bn", num_classes: int = 2, lr: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = torch.nn.Linear(4, num_classes)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.model(x), y)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/acc", (self.model(x).argmax(1) == y).float().mean())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.global_step == int(os.environ.get("TINY_KILL_AT_STEP", "-1")):
            os.kill(os.getpid(), signal.SIGKILL)


class TinyData(pl.LightningDataModule):
    num_classes = 2

    def __init__(self, data_dir: str = "unused") -> None:
        super().__init__()

    def train_dataloader(self):
        return DataLoader(_data(), batch_size=8, shuffle=True)

    def val_dataloader(self):
        return DataLoader(_data(), batch_size=8)


class SlowCheckpointIO(AtomicCheckpointIO):
    def save_checkpoint(self, checkpoint, path, storage_options=None):
        if checkpoint.get("global_step") != int(os.environ.get("TINY_SLOW_SAVE_AT_STEP", "-1")):
            return super().save_checkpoint(checkpoint, path, storage_options)

        def write_then_hang(tmp: Path) -> None:
            torch.save(checkpoint, tmp)
            Path(os.environ["TINY_SAVING_MARKER"]).touch()
            time.sleep(120)  # killed here by the test

        write_atomic(path, write_then_hang)


CONFIG = """
seed_everything: 0
trainer:
  max_epochs: 4
  default_root_dir: {root}
  enable_progress_bar: false
  enable_model_summary: false
  log_every_n_steps: 1
  logger:
    - class_path: mabn.loggers.CSVLogger
      init_args: {{save_dir: unused, flush_logs_every_n_steps: 1}}
    - class_path: mabn.loggers.WandbLogger
      init_args: {{save_dir: unused, project: tiny}}
  callbacks:
    - class_path: pytorch_lightning.callbacks.ModelCheckpoint
      init_args: {{monitor: val/acc, mode: max, save_last: true, filename: "{{step}}", save_top_k: 2}}
model:
  class_path: cli_tiny.TinyTask
data:
  class_path: cli_tiny.TinyData
"""
