"""PerDeviceState: the base of callbacks whose state differs between devices, saved for every device in each
checkpoint and given back to the same rank at a resume."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import pytorch_lightning as pl
from pytorch_lightning.utilities import rank_zero_warn

from ..distributed import rank, world_size


class PerDeviceState(pl.Callback, ABC):
    """Keeps one state per device in the checkpoint under ``key``: ``{"world_size": W, "ranks": [state of rank r]}``.

    Saving is collective: Lightning saves on every device and device 0 writes the file, so ``gather_states`` runs
    on all of them. The states of another number of devices cannot be matched to ranks: a resume from such a
    checkpoint restores nothing and warns that ``otherwise`` happens instead.
    """

    key: str  # the checkpoint's key
    what: str  # the state, as the warning names it
    otherwise: str  # what a resume on another number of devices gets instead

    @abstractmethod
    def gather_states(self) -> list[Any]:
        """Every device's state, by rank (a collective)."""

    @abstractmethod
    def restore_state(self, state: Any) -> None:
        """Continue from this device's saved ``state``."""

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        checkpoint[self.key] = {"world_size": world_size(), "ranks": self.gather_states()}

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        saved = checkpoint.get(self.key)
        if saved is None:
            return
        if saved["world_size"] != world_size():
            rank_zero_warn(
                f"{type(self).__name__}: the checkpoint holds the {self.what} of {saved['world_size']} devices, this "
                f"run has {world_size()}: {self.otherwise}"
            )
            return
        self.restore_state(saved["ranks"][rank()])
