"""How a run's batch and schedule follow its device count: one rule per stage (docs/scaling.md).

- The per-device batch: stage 1 fixes it (32); stage 2 fixes the global batch (16) as a ceiling: each device
  takes the largest whole number of normalization batches that keeps the global batch at most 16, and never fewer
  than one, so beyond 8 devices the global batch grows with the devices (``device_batch``).
- The lr follows the global batch (the linear scaling rule): base_lr x global batch / base batch. Stage 1 warms it
  up linearly over 5 epochs (Goyal et al.) when the global batch exceeds its base batch (``auto_warmup_epochs``).
- The schedule is in epochs: warm-up, poly horizon and lr drops convert to iterations from the iterations per
  epoch the device count gives (``loader_batches``), so a run keeps the recipe's epochs on any number of
  devices. MABN's phase timelines stay in iterations, as in the paper.

``plan_shape`` computes these numbers, as ``RunShape``, for both the dry run (from a configuration) and the fit
(from its Trainer, at the start of ``configure_optimizers``); a task makes its ``RunPlan`` (the lr, the schedule and
the lines that say them) from it, the one the dry run prints and the fit runs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from ..errors import ConfigError


def device_batch(global_batch: int, devices: int, norm_batch: int | None) -> int:
    """The per-device batch of a run whose recipe fixes ``global_batch``: the largest whole number of
    normalization batches of ``norm_batch`` (None: single samples) per device that keeps the global batch at most
    ``global_batch``, and never fewer than one normalization batch, so on more devices than ``global_batch``
    holds normalization batches the global batch exceeds it."""
    unit = norm_batch or 1
    if global_batch < 1 or devices < 1:
        raise ConfigError(f"global_batch_size={global_batch} over {devices} device(s): both must be >= 1")
    if global_batch % unit:
        raise ConfigError(
            f"global_batch_size={global_batch} does not split into normalization batches of "
            f"norm_batch_size={unit}: use a multiple of {unit}"
        )
    return max(1, global_batch // (devices * unit)) * unit


def per_device_batch(
    batch_size: int | None, global_batch_size: int | None, devices: int, norm_batch: int | None
) -> int | None:
    """The per-device batch of a data module: its share of ``global_batch_size`` (``device_batch``) where that is
    set, else its ``batch_size``; what the dry run plans and the data module loads."""
    return device_batch(global_batch_size, devices, norm_batch) if global_batch_size else batch_size


def device_batch_reason(global_batch: int, devices: int, norm_batch: int | None) -> str:
    """Why ``device_batch`` gives the global batch it gives, in words (the dry run's ``global batch:`` line)."""
    unit = norm_batch or 1
    per_device = device_batch(global_batch, devices, norm_batch)
    run = per_device * devices
    what = f"normalization batches of {unit}" if norm_batch else "samples"
    each = f"{per_device // unit} x {unit}" if norm_batch else f"{per_device}"
    if run == global_batch:
        return f"{run}, the recipe's global_batch_size ({each} per device on {devices} device(s))"
    if run < global_batch:
        return (
            f"{run}, below the recipe's global_batch_size {global_batch}: {global_batch} does not split into whole "
            f"{what} over {devices} devices, so each takes the most that keep the global batch at most "
            f"{global_batch} ({each})"
        )
    least = f"one normalization batch of {unit}" if norm_batch else "one sample"
    above = f"above the recipe's global_batch_size {global_batch}"
    return f"{run}, {above}: each of {devices} devices holds at least {least}"


def loader_batches(samples: int, per_device: int, devices: int, limit: float = 1.0) -> int:
    """Training batches per epoch on each device: a distributed sampler gives each device ceil(samples / devices)
    samples (padded by repetition) and the training loader drops its last partial batch; ``limit`` is the Trainer's
    ``limit_train_batches`` (an int: at most that many; a float: that share, rounded down)."""
    batches = math.ceil(samples / devices) // per_device
    return min(batches, limit) if isinstance(limit, int) else int(batches * limit)


def iterations_per_epoch(batches: int, accumulate: int = 1) -> int:
    """Optimizer steps per epoch of ``batches`` loader batches: a step also ends a partial accumulation window
    (as Lightning's fit loop runs them)."""
    return math.ceil(batches / accumulate)


GOYAL_WARMUP_EPOCHS = 5.0  # Goyal et al. (2017): the gradual warm-up that goes with the linear scaling rule


def auto_warmup_epochs(global_batch: int, base_batch: int) -> float:
    """The warm-up of a run whose lr is scaled by the linear scaling rule: ``GOYAL_WARMUP_EPOCHS`` when the global
    batch exceeds ``base_batch`` (the lr is scaled up), none otherwise (the recipe's batch or a smaller one)."""
    return GOYAL_WARMUP_EPOCHS if global_batch > base_batch else 0.0


def linear_lr(base_lr: float, global_batch: int, base_batch: int) -> float:
    """The linear scaling rule: ``base_lr`` belongs to a global batch of ``base_batch``."""
    return base_lr * global_batch / base_batch


@dataclass(frozen=True)
class RunShape:
    """A run's batch over its devices and its length in iterations. ``samples`` and the iteration counts are
    None where they cannot be known before the data is read (a demo set not generated yet)."""

    per_device: int
    devices: int
    accumulate: int
    norm_batch: int | None
    samples: int | None
    iterations_per_epoch: int | None
    total_iterations: int | None

    @property
    def global_batch(self) -> int:
        return self.per_device * self.devices * self.accumulate

    def iterations(self, epochs: float) -> int | None:
        """``epochs`` (a fraction allowed) in optimizer steps."""
        return None if self.iterations_per_epoch is None else round(epochs * self.iterations_per_epoch)

    def lr(self, base_lr: float, base_batch: int) -> float:
        return linear_lr(base_lr, self.global_batch, base_batch)

    def lr_line(self, base_lr: float, base_batch: int, note: str = "") -> str:
        lr = self.lr(base_lr, base_batch)
        return f"lr: {base_lr:g} x {self.global_batch} / {base_batch} = {lr:g}{note} (linear in the global batch)"

    def lines(self, normalized: str | None = "") -> list[str]:
        """The batch line and the length line of a run. ``normalized``: where the network normalizes over the
        normalization batches ("" everywhere; None nowhere, which leaves them out of the line)."""
        accumulate = f" x {self.accumulate} accumulated" if self.accumulate > 1 else ""
        where = f" {normalized}" if normalized else ""
        norm = (
            f", normalization batches of {self.norm_batch}{where}" if self.norm_batch and normalized is not None else ""
        )
        batch = (
            f"batch: {self.per_device} per device x {self.devices} device(s){accumulate} = global batch "
            f"{self.global_batch}{norm}"
        )
        if self.iterations_per_epoch is None:
            return [batch, "iterations: known once the data set exists (it is generated at the start of the run)"]
        length = (
            f"iterations: {self.iterations_per_epoch} per epoch ({self.samples} training samples), "
            f"{self.total_iterations} in total"
        )
        return [batch, length]

    def epochs_text(self, epochs: float) -> str:
        """``epochs`` with its iterations, e.g. "3 epochs (555 iterations)"."""
        steps = self.iterations(epochs)
        return f"{epochs:g} epochs" + ("" if steps is None else f" ({steps} iterations)")


def total_iterations(batches: int, max_epochs: int | None, max_steps: int | None, accumulate: int) -> int:
    """The fit's optimizer steps as Lightning runs and estimates them (``Trainer.estimated_stepping_batches``):
    ``iterations_per_epoch`` in each epoch (each ends its partial accumulation window), at least one epoch."""
    epochs = max_epochs if max_epochs is not None and max_epochs >= 0 else None
    steps = max_steps if max_steps is not None and max_steps >= 0 else None
    if epochs is None and steps is None:
        raise ConfigError("trainer.max_epochs and trainer.max_steps are both unset: the run would never end")
    total = iterations_per_epoch(batches, accumulate) * max(epochs, 1) if epochs is not None else math.inf
    return int(min(total, steps) if steps is not None else total)


def plan_shape(
    per_device: int,
    devices: int,
    accumulate: int,
    norm_batch: int | None,
    samples: int | None,
    max_epochs: int | None,
    max_steps: int | None,
    limit: float = 1.0,
) -> RunShape:
    """The run's batch and length: ``per_device`` samples on each of ``devices`` with ``accumulate`` micro-batches
    a step, over ``samples`` training samples (None: not known yet) for the Trainer's ``max_epochs``,
    ``max_steps`` and ``limit_train_batches`` (``limit``). The one computation of both the dry run and the fit; a
    ``ConfigError`` where the samples fill no batch."""
    per_epoch = steps = None
    if samples is not None:
        batches = loader_batches(samples, per_device, devices, limit)
        if batches == 0:
            raise ConfigError(
                f"the training split holds {samples} samples: too few for one batch of {per_device} on each of "
                f"{devices} devices"
            )
        per_epoch = iterations_per_epoch(batches, accumulate)
        steps = total_iterations(batches, max_epochs, max_steps, accumulate)
    return RunShape(per_device, devices, accumulate, norm_batch, samples, per_epoch, steps)


@dataclass(frozen=True)
class RunPlan:
    """What a task makes of a ``RunShape`` (its ``run_plan``): the lr of the global batch, the factor of it at
    each optimizer step (``LambdaLR``'s), the warm-up in iterations, and the lines that say the batch, the lr and
    the schedule. The dry run prints these lines; the fit says them and sets up its optimizer from the same plan."""

    shape: RunShape
    lr: float
    warmup_steps: int | None
    lines: tuple[str, ...]
    lr_factor: Callable[[int], float] = field(compare=False)
