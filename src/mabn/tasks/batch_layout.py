"""The batch a stage-2 fit trains with, decided in one place: the ``BatchLayout`` callback (``SegmentationTask``'s)
takes the data module's per-device batch at the start of the fit, lowers it where it does not fit the device's
memory (``mabn.tasks.memory.fit``) or keeps the one a resumed checkpoint recorded, and hands the result to the data
module (``batch_size``) and the Trainer (``accumulate_grad_batches``), as Lightning's own ``BatchSizeFinder`` and
``GradientAccumulationScheduler`` callbacks hand theirs. Neither the task nor the data module sets the other's."""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
from pytorch_lightning.trainer.states import TrainerFn

from ..distributed import say
from . import memory

LAYOUT_KEY = "batch_layout"  # in a stage-2 checkpoint: the batch the fit trained with (``layout``)


def layout(trainer: pl.Trainer) -> dict[str, int]:
    """The batch a fit trains with: the per-device batch, the gradient accumulation and the processes, which a
    checkpoint records (``LAYOUT_KEY``) and a resume keeps."""
    return {
        "per_device": trainer.datamodule.batch_size,
        "accumulate": trainer.accumulate_grad_batches,
        "processes": trainer.world_size,
    }


class BatchLayout(pl.Callback):
    """Decides the fit's batch layout and hands it to the data module and the Trainer (module docstring)."""

    def __init__(self) -> None:
        self.fitted: memory.Fitted | None = None  # None: no estimate for this network, the batch as the data gives

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # After the data module's setup (its per-device share of the global batch, its crop), before its loaders.
        if stage != "fit":
            return
        self.fitted = memory.fit(trainer, pl_module.hparams, pl_module.model)
        if self.fitted is not None:
            found = self.fitted.found
            self._hand(trainer, found.per_device, trainer.accumulate_grad_batches * found.accumulate)

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """A resume (after ``setup``, before the loaders and the optimizer are made) keeps the layout its checkpoint
        recorded where the run has as many processes: another split of the same global batch draws other batches
        (the loader drops another remainder), so an epoch has other steps and the schedule changes. Where that
        layout does not fit the budget here, a ``ConfigError``."""
        # Lightning calls this hook for a checkpoint that holds callback states: every fit's does (its
        # ModelCheckpoint's), and a resume needs a fit's full checkpoint.
        recorded = checkpoint.get(LAYOUT_KEY)
        if trainer.state.fn != TrainerFn.FITTING or recorded is None or self.fitted is None:
            return
        if recorded["processes"] != trainer.world_size or layout(trainer) == recorded:
            return
        line = memory.keeps(trainer, self.fitted, recorded)
        self._hand(trainer, recorded["per_device"], recorded["accumulate"])
        say(line)

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if hasattr(trainer.datamodule, "batch_size"):
            checkpoint[LAYOUT_KEY] = layout(trainer)

    @staticmethod
    def _hand(trainer: pl.Trainer, per_device: int, accumulate: int) -> None:
        """The one place that sets the data module's per-device batch and the Trainer's accumulation."""
        trainer.datamodule.batch_size = per_device
        trainer.accumulate_grad_batches = accumulate
