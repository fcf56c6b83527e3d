"""MABNCallback: the phase policy of MABN2d/BatchRenorm2d per module group, stream resets, statistics logging,
the loss scale and the non-finite check, one optimizer step late.

The official layer keeps its own forward counter, which breaks in known ways: fine-tuning from a checkpoint
with a large counter skips warm-up, and the paper keeps the heads on batch statistics for their first
10,000 iterations while the backbone is already on moving averages. This callback sets each layer's phase
from the optimizer step (``trainer.global_step``, so gradient accumulation counts once per update), restarts
the streams when a fit starts from a pre-trained backbone, and logs the batch statistics every k steps.

Under a loss scaler (``precision="16-mixed"``) the callback hands the scale of every backward to the MABN2d
layers (``MABN2d.loss_scale``), so psi's moving average stays in the loss's units when the scaler changes the
scale, and an overflowing backward is skipped by the scaler as with any other layer rather than refused.

On CUDA the layers keep their non-finite verdicts in device flags (``mabn.norm.managed``): reading them at every
step would stall the GPU. At each optimizer step the callback raises what the previous step's copy of every
layer's flags holds, then starts the copy of this step's (``LateNonfiniteCheck``), so the host never waits for the
device. A non-finite statistic of step s thus stops the fit at step s + 1, before that step's update: the update of
step s may have taken its NaN gradient, which is why the pending copy is also read before a checkpoint is saved,
before validation and at the end of training, so that no NaN weights are validated or saved and a NaN of the last
step is not lost.

The layers' state on several devices is PerDeviceStreams' (``mabn.callbacks.streams``); ``norm_callbacks``
gives a model both.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytorch_lightning as pl
import torch
from torch import Tensor, nn

from ..compat import scale_on_device
from ..errors import ConfigError
from ..models import logged_norms
from ..norm import MABN2d
from ..norm.managed import LateNonfiniteCheck, ManagedNorm, managed_norms
from ..run.progress import epoch_cadence
from .policy import NormPolicy, PhaseRule
from .streams import PerDeviceStreams
from .syncbn import SyncBatchNormCheck, has_sync_batchnorm


class MABNCallback(pl.Callback):
    """Warm-up policy per module group, stream resets, batch-statistics logging, the loss scale and the
    non-finite check of the callback-managed norms, as ``policy`` (a ``NormPolicy``) sets them."""

    def __init__(self, policy: NormPolicy | None = None, steps_done: bool = False) -> None:
        self.policy = policy or NormPolicy()
        # The step a batch's statistics are logged at: that of the module's training row of the batch, the
        # optimizer steps done after it (a NormTask's rows) or, as Lightning counts its rows, those before it. A
        # resume cuts metrics.csv by that count: a row of another count would be cut with the wrong batches.
        self._row_offset = int(steps_done)
        self.resets: list[int] = []  # optimizer steps at which the streams were restarted (checkpointed)
        self._layers: dict[str, ManagedNorm] = {}
        self._rules: dict[str, PhaseRule] = {}
        self._logging: list[str] = []
        self._step, self._log_now, self._graphed = 0, False, False
        self._every = self.policy.log_every_n_steps  # that of the fit where the policy leaves it to the run
        self._scaler: torch.amp.GradScaler | None = None  # the fit's loss scaler, and its scale on the device
        self._loss_scale: Tensor | None = None
        self._nonfinite = LateNonfiniteCheck({})

    # -- setup -------------------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.bind(pl_module)

    def bind(self, pl_module: nn.Module) -> None:
        """Take ``pl_module``'s managed norms and the policy's rule of each (the fit's setup; a dry run's check on
        the model it builds): a ``ConfigError`` naming the policy's setting when a group or a logged layer names
        nothing of the model."""
        self._layers = managed_norms(pl_module)
        groups = self.policy.groups
        self._rules = {}
        for name in self._layers:
            for rule in groups.values():
                if any(name.startswith(p) for p in rule.prefixes):
                    self._rules[name] = rule
                    break
        # A group over a part whose norms are not managed (frozenbn's encoder, its heads' BN managed) has nothing to
        # drive; a prefix that names no module at all is a mistake.
        modules = [name for name, _ in pl_module.named_modules()]
        unmatched = [
            g for g, r in groups.items()
            if not any(name.startswith(p) for name in modules for p in r.prefixes)
        ]  # fmt: skip
        if self._layers and unmatched:
            raise ConfigError(
                f"norm_policy: groups {unmatched} match no module of the model by name prefix: give each group "
                f"prefixes of the model's modules (its top-level ones: {', '.join(top_level(modules))})"
            )
        logged = self.policy.log_layers
        self._logging = logged if logged is not None else logged_norms(list(self._layers))
        self._nonfinite = LateNonfiniteCheck(self._layers)
        missing = [n for n in self._logging if n not in self._layers]
        if missing:
            raise ConfigError(
                f"norm_policy: log_layers {missing} are not MABN2d/BatchRenorm2d layers of the model: name some of "
                f"{', '.join(list(self._layers)[:3])}, ... or leave log_layers null"
            )

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        every = self.policy.log_every_n_steps
        self._every = epoch_cadence(trainer) if every is None else every

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        resuming = trainer.ckpt_path is not None
        if self.policy.reset_from_pretrained and not resuming and pl_module.hparams.get("backbone"):
            self._reset(trainer.global_step)
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self._scaler = scaler if scaler is not None and scaler.is_enabled() else None
        # One tensor for the whole fit: a captured CUDA graph reads the scale from its address. It dies with this
        # callback, so graphs captured in one fit must not replay in the next (a NormTask captures at each fit).
        self._loss_scale = None if self._scaler is None else torch.ones((), device=pl_module.device)
        self._set_loss_scale(self._loss_scale)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._set_loss_scale(None)  # the model's later backward passes (outside this fit) are unscaled

    def _set_loss_scale(self, scale: Tensor | None) -> None:
        for layer in self._layers.values():
            if isinstance(layer, MABN2d):
                layer.loss_scale = scale

    def _reset(self, step: int) -> None:
        for layer in self._layers.values():
            layer.reset_stream(self.policy.reset_ema)
        self.resets.append(step)

    # -- every step --------------------------------------------------------------------------------
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        step, every, reset_at = trainer.global_step, self._every or 0, self.policy.reset_at_step
        if reset_at is not None and step == reset_at and step not in self.resets:
            self._reset(step)
        for name, rule in self._rules.items():
            self._layers[name].policy = rule.phase(step)
        log_now = every > 0 and step % every == 0
        self._step, self._log_now = step, log_now
        # A CUDA-graphed model runs the layers' Python forward once, at capture: the logged layers track from
        # then on, and every replay refreshes the statistics tensors they captured. A compiled one tracks at every
        # step too: switching tracking would compile a second graph. A NormTask's ``cuda_graph`` is its decision for
        # this fit, not the hyperparameter (which may be "auto").
        graphed = getattr(pl_module, "cuda_graph", False) or getattr(pl_module, "compile_mode", None) is not None
        self._graphed = graphed and every > 0
        for name in self._logging:
            self._layers[name].track_stats = log_now or self._graphed
            if not self._graphed:
                self._layers[name].last_stats = None

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        if self._scaler is not None:
            # The scale this backward's gradients carry, copied on the device: the scaler's public get_scale()
            # would wait for the GPU at every step.
            self._loss_scale.copy_(scale_on_device(self._scaler))

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        # After the backward, so the copy holds every verdict of this step's forwards and backwards.
        self._nonfinite.step(trainer.global_step)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        metrics = {}
        for name in self._logging:
            layer = self._layers[name]
            if self._log_now and layer.last_stats is not None:
                metrics.update({f"norm/{name}/{k}": v for k, v in layer.summary().items()})
            layer.track_stats = self._graphed
        if metrics:  # straight to the loggers: the trainer's log_every_n_steps must not thin these out
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=self._step + self._row_offset)  # the batch's training row

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._nonfinite.check()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._nonfinite.check()

    # -- checkpoint --------------------------------------------------------------------------------
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self._nonfinite.check()  # before the file is written: weights that took a NaN gradient are not saved

    def state_dict(self) -> dict[str, Any]:
        return {"resets": list(self.resets), "groups": self.policy.as_dict()["groups"]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.resets = list(state_dict["resets"])


def top_level(modules: list[str]) -> list[str]:
    """The names of ``modules`` (``named_modules()``'s) one or two levels down (``model.encoder``), in order."""
    return list(dict.fromkeys(".".join(n.split(".")[:2]) for n in modules if n))


def norm_callbacks(
    module: nn.Module, policy: NormPolicy | Mapping[str, Any] | None, steps_done: bool = False
) -> list[pl.Callback]:
    """MABNCallback following ``policy`` (``NormPolicy.parse`` checks a mapping; ``steps_done`` where the module's
    training rows carry the optimizer steps done after their batch) and PerDeviceStreams when ``module`` holds
    callback-managed norms, the SyncBatchNorm check when it holds SyncBatchNorm, else nothing."""
    if managed_norms(module):
        return [MABNCallback(NormPolicy.parse(policy), steps_done), PerDeviceStreams()]
    if has_sync_batchnorm(module):
        return [SyncBatchNormCheck()]
    return []
