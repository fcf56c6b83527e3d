"""PerDeviceStreams: the statistic streams of MABN2d/BatchRenorm2d on several devices.

Under DDP each device keeps its own streams, as in the paper (layers built with ``sync_stats=True`` share them
instead): this callback stops DDP from overwriting them with device 0's at every forward, validates and saves
the model with the devices' mean EMA, and stores every device's streams in the checkpoint so that a resume on as
many devices continues each one exactly. On one device it does nothing.
"""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.strategies import DDPStrategy
from pytorch_lightning.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor

from ..compat import ddp_kwargs, syncs_batchnorm
from ..distributed import device_mean, end_process_group_at_exit, gather_to_cpu, world_size
from ..norm.managed import ManagedNorm, managed_norms
from ..run import PerDeviceState

# Checkpoint key of every device's statistic streams: {"world_size": W, "ranks": [{buffer key: tensor}] * W}.
STREAMS_KEY = "norm_streams"


class PerDeviceStreams(PerDeviceState):
    """Every device's statistic streams under DDP: kept by DDP, the devices' mean EMA for validation, the model
    left after fit and the checkpoint's weights, and every device's streams in the checkpoint (``norm_streams``),
    back on the same rank at a resume."""

    key = STREAMS_KEY
    what = "statistic streams"
    otherwise = (
        "every device continues from the saved model (device 0's streams, the devices' mean EMA), so the "
        "resumed run is not the continuation of each device's stream"
    )

    def __init__(self) -> None:
        self._layers: dict[str, ManagedNorm] = {}  # the layers whose streams differ between devices
        self._own_ema: dict[str, Tensor] | None = None  # this device's EMAs while validation uses the mean

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        managed = managed_norms(pl_module)
        if managed:
            configure_ddp(trainer)
        self._layers = {name: m for name, m in managed.items() if not m.sync_stats}

    def _ema_tensors(self) -> dict[str, Tensor]:
        """The per-device layers' EMA buffers by state-dict key."""
        return {f"{name}.{buf}": getattr(m, buf) for name, m in self._layers.items() for buf in m.ema_buffers}

    def _stream_tensors(self) -> dict[str, Tensor]:
        """Every buffer of the per-device layers by state-dict key: what a device needs to continue exactly."""
        return {f"{name}.{key}": buf for name, m in self._layers.items() for key, buf in m.named_buffers()}

    def _several(self) -> bool:
        """Whether the devices' streams can differ: several devices and a layer without sync_stats."""
        return world_size() > 1 and bool(self._layers)

    def _use_mean_ema(self) -> None:
        """The devices' mean EMA into the live buffers, this device's own kept aside (``_own_ema``)."""
        if self._several():
            live = self._ema_tensors()
            self._own_ema = {key: t.clone() for key, t in live.items()}
            _copy_into(live, device_mean(live))

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._use_mean_ema()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Training goes on with each device's own EMA, as an uninterrupted per-device stream.
        if self._own_ema is not None:
            _copy_into(self._ema_tensors(), self._own_ema)
            self._own_ema = None

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The model left after fit (tested, exported) is the one the checkpoints hold: the mean EMA everywhere. The
        # fit's last save (mabn.run.LastCheckpoint, at the fit's end) may come after this: it keeps each device's
        # own EMA in the streams, which a resume continues.
        self._use_mean_ema()

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # Runs on every device (Lightning's save is collective; device 0 writes the file).
        if not self._several():
            return
        state = checkpoint["state_dict"]
        for key, mean in device_mean(self._ema_tensors()).items():
            if key in state:
                state[key] = mean  # a new tensor: the live buffer keeps this device's EMA
        super().on_save_checkpoint(trainer, pl_module, checkpoint)

    def gather_states(self) -> list[dict[str, Tensor]]:
        # Where the mean EMA stands in the live buffers (a validation, the fit's end), this device's own.
        return gather_to_cpu({**self._stream_tensors(), **(self._own_ema or {})})

    def restore_state(self, state: dict[str, Tensor]) -> None:
        live = self._stream_tensors()
        if set(state) != set(live):
            raise ValueError(
                "PerDeviceStreams: the checkpoint's per-device streams do not match the model's norm layers: "
                f"only in the checkpoint {sorted(set(state) - set(live))[:5]}, "
                f"only in the model {sorted(set(live) - set(state))[:5]}"
            )
        _copy_into(live, state)


def configure_ddp(trainer: pl.Trainer) -> None:
    """Keep each device's statistic streams under DDP: no buffer broadcast from device 0 at every forward.

    DDP's default (``broadcast_buffers=True``) would overwrite every device's ring buffers and EMA with
    device 0's before each training forward, so the other devices' statistics would be lost each step
    (the official code runs with ``broadcast_buffers=False``). Runs before the strategy wraps the model.
    An explicit ``DDPStrategy(broadcast_buffers=True)`` is kept, with a warning.

    torch warns that ``broadcast_buffers`` is deprecated for ``forward_sync_buffers``; that replacement still
    copies device 0's buffers to every device when DDP wraps the model, which would overwrite the per-device
    streams a resume has just restored, so ``broadcast_buffers=False`` is the one that keeps them.
    """
    strategy = trainer.strategy
    if isinstance(strategy, DDPStrategy):
        end_process_group_at_exit()
        kwargs = ddp_kwargs(strategy)  # passed to DistributedDataParallel when the model is wrapped
        if kwargs.get("broadcast_buffers") is True:
            rank_zero_warn(
                "PerDeviceStreams: DDPStrategy(broadcast_buffers=True) overwrites every device's MABN/BRN statistics "
                "with device 0's at each forward; leave it unset to keep per-device statistics"
            )
        elif "broadcast_buffers" not in kwargs:
            kwargs["broadcast_buffers"] = False
            rank_zero_info("MABN/BRN statistics stay per device: DDP runs with broadcast_buffers=False")
    if syncs_batchnorm(strategy):
        rank_zero_warn(
            "Trainer(sync_batchnorm=True) converts only BatchNorm layers; MABN2d and BatchRenorm2d share "
            "statistics across devices with sync_stats=True (norm_options: {mabn: {sync_stats: true}})"
        )


def _copy_into(live: dict[str, Tensor], values: dict[str, Tensor]) -> None:
    """Write ``values`` into the live buffers of the same keys, in place (DDP and the optimizer hold them)."""
    with torch.no_grad():
        for key, value in values.items():
            live[key].copy_(value)
