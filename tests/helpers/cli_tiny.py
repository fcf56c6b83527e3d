"""A seconds-long task for the CLI's run-folder tests, run in subprocesses (``PYTHONPATH`` includes tests/).

``TinyTask`` trains conv -> MABN2d -> conv -> BatchRenorm2d -> dropout -> linear (short norm timelines, the
norms managed by MABNCallback) on 32 fixed 6x6 images, shuffled, with SGD and a per-step lr schedule: every kind
of state a resume must restore (weights, norm streams, momentum, schedule, random state). Every epoch ends with a
validation whose ``val/acc`` ModelCheckpoint monitors. ``$TINY_KILL_AT_STEP`` kills the process at that step, as
an out-of-memory kill or a node failure would; ``$TINY_TERM_AT_STEP`` sends it SIGTERM there, as ``scancel``
does. ``$TINY_HOLD_AT_STEP`` stops there instead, touches ``$TINY_HOLDING_MARKER`` and waits until
``$TINY_RELEASE_MARKER`` exists (or it is killed), so a test can act while the run holds its folder.
``SlowCheckpointIO`` stops inside the write of the checkpoint at ``$TINY_SLOW_SAVE_AT_STEP``, after the bytes are
in the temporary file and before the rename, and touches
``$TINY_SAVING_MARKER`` so a test can kill the process exactly then. ``FullDiskCheckpointIO`` runs out of
space in the middle of writing the checkpoint of ``$TINY_FULL_AT_STEP`` into its temporary file.
``SettingTask`` takes its lr as a run setting. ``WorseningTask`` scores worse at every validation, so
ModelCheckpoint saves only at the first one; ``StopAt`` raises or sends this process SIGTERM at the start of a
training batch; ``TinyData`` trains through the product's loader (``mabn.data.loading.make_loader``) on images
flipped at random, with worker processes where ``num_workers`` says.
"""

from __future__ import annotations

import errno
import io
import os
import signal
import time
from pathlib import Path

import albumentations as A
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from mabn import BatchRenorm2d, MABN2d
from mabn.callbacks import norm_callbacks
from mabn.data.loading import make_loader
from mabn.run.files import AtomicCheckpointIO, write_atomic


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = 2.0 * torch.randn(32, 3, 6, 6, generator=g) + 0.5
    return TensorDataset(x, (x[:, 0].mean((1, 2)) > 0.5).long())


class _Flipped(Dataset):
    """The 32 images, each flipped at random by an albumentations ``transform`` (the labels do not change): the
    random augmentation a resume must continue as the uninterrupted fit draws it. Seeded as the data modules seed
    their own where nothing else does."""

    def __init__(self) -> None:
        self.images, self.labels = _data().tensors
        self.transform = A.Compose([A.HorizontalFlip(), A.VerticalFlip()], seed=0)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        image = self.transform(image=self.images[index].permute(1, 2, 0).numpy())["image"]
        return torch.from_numpy(image).permute(2, 0, 1).contiguous(), self.labels[index]


class TinyTask(pl.LightningModule):
    def __init__(self, norm: str = "bn", num_classes: int = 2, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = nn.Sequential(
            nn.Conv2d(3, 4, 3, padding=1, bias=False),
            MABN2d(4, norm_batch_size=2, buffer_size=4, warmup_iters=3, renorm_warmup_iters=6, momentum=0.9),
            nn.ReLU(),
            nn.Conv2d(4, 4, 3, padding=1),
            BatchRenorm2d(4, norm_batch_size=2, r_ramp=(2, 8), d_ramp=(2, 6), momentum=0.9),
            nn.ReLU(), nn.Dropout(0.2), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, num_classes),
        )  # fmt: skip

    def configure_callbacks(self):
        return norm_callbacks(self.model, None)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.model(x), y)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/acc", (self.model(x).argmax(1) == y).float().mean())

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.7)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.global_step == int(os.environ.get("TINY_KILL_AT_STEP", "-1")):
            os.kill(os.getpid(), signal.SIGKILL)
        if self.global_step == int(os.environ.get("TINY_TERM_AT_STEP", "-1")):
            os.kill(os.getpid(), signal.SIGTERM)
        if self.global_step == int(os.environ.get("TINY_HOLD_AT_STEP", "-1")):
            Path(os.environ["TINY_HOLDING_MARKER"]).touch()
            deadline = time.monotonic() + 120
            while not Path(os.environ["TINY_RELEASE_MARKER"]).exists() and time.monotonic() < deadline:
                time.sleep(0.1)


class SettingTask(TinyTask):
    """TinyTask whose ``lr`` is a run setting (``mabn.cli.plan.run_settings``): a resume takes it as given."""

    run_settings = frozenset({"lr"})


class WorseningTask(TinyTask):
    def validation_step(self, batch, batch_idx):
        self.log("val/acc", 1.0 / (1 + self.global_step))


class StopAt(pl.Callback):
    """At the start of the training batch at global step ``step``: ``raise`` a RuntimeError, ``interrupt`` as
    Ctrl-C does, or send this process ``sigterm``, ``sighup`` or ``sigusr1`` (recorded by the handler, acted on at
    the end of that batch)."""

    def __init__(self, step: int, how: str = "raise") -> None:
        self.step, self.how = step, how

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step != self.step:
            return
        if self.how == "raise":
            raise RuntimeError(f"stopped at step {self.step}")
        if self.how == "interrupt":
            raise KeyboardInterrupt
        os.kill(os.getpid(), getattr(signal, self.how.upper()))  # sigterm, sighup, sigusr1


class TinyData(pl.LightningDataModule):
    num_classes = 2

    def __init__(self, data_dir: str = "unused", num_workers: int = 0) -> None:
        super().__init__()
        self.num_workers = num_workers

    def train_dataloader(self):
        return make_loader(_Flipped(), 8, train=True, num_workers=self.num_workers)

    def val_dataloader(self):
        if self.num_workers:
            return make_loader(_data(), 8, train=False, num_workers=self.num_workers)
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


def write_until_full(checkpoint: dict, file) -> None:
    """Writes half of ``checkpoint``'s bytes into ``file``, then fails as a full disk does."""
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    file.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
    file.flush()
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


class FullDiskCheckpointIO(AtomicCheckpointIO):
    @staticmethod
    def _write(checkpoint, tmp):
        if checkpoint.get("global_step") != int(os.environ.get("TINY_FULL_AT_STEP", "-1")):
            return AtomicCheckpointIO._write(checkpoint, tmp)
        with open(tmp, "wb") as file:
            write_until_full(checkpoint, file)


CONFIG = """
seed_everything: 0
trainer:
  max_epochs: 4
  default_root_dir: {root}
  enable_progress_bar: false
  enable_model_summary: false
  log_every_n_steps: 1
  logger:
    - class_path: mabn.run.loggers.CSVLogger
      init_args: {{save_dir: unused, flush_logs_every_n_steps: 1}}
    - class_path: mabn.run.loggers.WandbLogger
      init_args: {{save_dir: unused, project: tiny}}
  callbacks:
    - class_path: pytorch_lightning.callbacks.ModelCheckpoint
      init_args: {{monitor: val/acc, mode: max, save_last: true, filename: "{{step}}", save_top_k: 2}}
model:
  class_path: helpers.cli_tiny.TinyTask
data:
  class_path: helpers.cli_tiny.TinyData
"""
