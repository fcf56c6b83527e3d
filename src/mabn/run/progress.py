"""LineProgress: the training's progress as one line every N optimizer steps, for logs that are files (a SLURM
``.out`` file, CI, a pipe), where a redrawn progress bar leaves carriage returns and partial bars behind."""

from __future__ import annotations

import math
import sys
import time
from datetime import timedelta
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ProgressBar, RichProgressBar, TQDMProgressBar

LOG_EVERY_N_STEPS = 50  # Lightning's default cadence of the training rows, on epochs longer than it
PROGRESS_LINES = 20  # the lines LineProgress prints over a run of known length, unless told its cadence


def epoch_cadence(trainer: pl.Trainer, longest: int = LOG_EVERY_N_STEPS) -> int:
    """Every how many optimizer steps to log when the run does not say: ``longest``, but at most the optimizer
    steps of an epoch, so a run of short epochs logs at every epoch at least (40 images in batches of 20 log every
    2 steps). Known from the fit's start (``on_train_start``), when the training batches are counted."""
    batches = trainer.num_training_batches
    if not math.isfinite(batches) or batches < 1:
        return longest
    return max(1, min(longest, math.ceil(batches / trainer.accumulate_grad_batches)))


class LogCadence(pl.Callback):
    """Sets the trainer's ``log_every_n_steps`` to ``epoch_cadence`` at the fit's start: what ``python -m mabn``
    adds where the configuration does not set ``trainer.log_every_n_steps``."""

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Lightning warns when an epoch has fewer batches than the cadence, a check made when it counts them
        # (before on_train_start, as early as the optimizers' schedule asks for the run's steps): the cadence
        # decided at on_train_start is never longer than an epoch.
        trainer.log_every_n_steps = 1

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.log_every_n_steps = epoch_cadence(trainer)


def is_terminal() -> bool:
    """Whether both stdout and stderr are terminals, where a redrawn progress bar belongs."""
    return all(getattr(stream, "isatty", lambda: False)() for stream in (sys.stdout, sys.stderr))


def use_line_progress(trainer: pl.Trainer, every_n_steps: int | None = None) -> None:
    """Replace Lightning's default progress bar of ``trainer`` (tqdm's or rich's) by ``LineProgress`` when the
    output is not a terminal. A progress bar the configuration chose itself, and a disabled one
    (``enable_progress_bar: false``), stay as they are."""
    bar = trainer.progress_bar_callback
    if type(bar) in (TQDMProgressBar, RichProgressBar) and not is_terminal():
        trainer.callbacks[trainer.callbacks.index(bar)] = LineProgress(every_n_steps)


def _duration(seconds: float) -> str:
    return str(timedelta(seconds=round(seconds))) if math.isfinite(seconds) else "?"


class LineProgress(ProgressBar):
    """A progress bar for logs that are files: every ``every_n_steps`` optimizer steps (None: ``PROGRESS_LINES``
    lines over a run whose length is known, every ``LOG_EVERY_N_STEPS`` steps otherwise) one line on stdout
    (process 0 only) with the step, the mean training loss of the steps since the last line, the learning rate
    (the first parameter group's), the mean time per step and the time left to the last step::

        step 50/3700 (epoch 0) | loss 2.3051 | lr 1.00e-02 | 0.82 s/step | ETA 0:49:53

    and after each validation one line with its metrics (``val/...``, the per-class ones left out). Step time and
    ETA leave the validations out. ``python -m mabn`` uses it in place of Lightning's progress bar when stdout or
    stderr is not a terminal; to choose it (or its ``every_n_steps``) anywhere, add it to the trainer's callbacks:
    ``--trainer.callbacks+ "{class_path: mabn.run.LineProgress, init_args: {every_n_steps: 20}}"``."""

    def __init__(self, every_n_steps: int | None = None) -> None:
        super().__init__()
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        self.every_n_steps = every_n_steps
        self._every = every_n_steps or LOG_EVERY_N_STEPS
        self._enabled = True
        self._reset(0)

    def _reset(self, step: int) -> None:
        self._since_step, self._since_time, self._paused_s = step, None, 0.0
        self._loss_sum: torch.Tensor | float = 0.0
        self._loss_count = 0
        self._validation_start: float | None = None

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    @property
    def is_enabled(self) -> bool:
        return self._enabled

    def _say(self, line: str) -> None:
        if self._enabled and self.trainer.is_global_zero:
            print(line, flush=True)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._reset(trainer.global_step)
        total = trainer.estimated_stepping_batches
        if self.every_n_steps is None and math.isfinite(total):
            self._every = max(1, round(total / PROGRESS_LINES))

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if self._since_time is None:
            self._since_time = time.monotonic()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            self._loss_sum = self._loss_sum + loss.detach().float()  # on the device: no wait for it here
            self._loss_count += 1
        step = trainer.global_step
        if step == self._since_step or step % self._every:
            return
        now = time.monotonic()
        per_step = (now - (self._since_time or now) - self._paused_s) / (step - self._since_step)
        total = trainer.estimated_stepping_batches
        of_total = f"/{int(total)}" if math.isfinite(total) else ""
        parts = [f"step {step}{of_total} (epoch {trainer.current_epoch})"]
        if self._loss_count:
            parts.append(f"loss {float(self._loss_sum) / self._loss_count:.4f}")
        if trainer.optimizers:
            parts.append(f"lr {trainer.optimizers[0].param_groups[0]['lr']:.2e}")
        parts += [f"{per_step:.3g} s/step", f"ETA {_duration((total - step) * per_step)}"]
        self._say(" | ".join(parts))
        self._reset(step)
        self._since_time = now

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._validation_start = time.monotonic()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._validation_start is not None:
            self._paused_s += time.monotonic() - self._validation_start
            self._validation_start = None
        if trainer.sanity_checking:
            return
        metrics = {
            name: value
            for name, value in trainer.callback_metrics.items()
            if name.startswith("val/") and name.count("/") == 1 and getattr(value, "numel", lambda: 1)() == 1
        }
        shown = ", ".join(f"{name} {float(value):.4f}" for name, value in sorted(metrics.items()))
        self._say(f"validation at step {trainer.global_step}" + (f": {shown}" if shown else ""))
