"""Stage 2's training memory per device (``mabn.run.memory``) from the task's hyperparameters: the estimate and the
per-device batch a dry run plans (from the sizes of the network built on the meta device, ``planned_sizes``), and
the one a fit finds on the device it runs on (``fit``), which ``mabn.tasks.batch_layout.BatchLayout`` hands to the
data module and the Trainer."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import pytorch_lightning as pl
from torch import nn

from ..distributed import gather_objects, say
from ..errors import ConfigError
from ..models import DEFAULT_DECODER
from ..norm import NORM_PRESETS, norm_entry
from ..run.memory import Budget, Estimate, Fit, activation_bytes, device_budget, estimate, fit_batch, gb


def per_pixel(hp: Mapping[str, Any]) -> int | None:
    """The activations' bytes per pixel and image of the task's network, from the table (PSPNet's alone)."""
    if hp["decoder"] != DEFAULT_DECODER or hp["norm"] not in NORM_PRESETS:
        return None
    return activation_bytes(hp["arch"], norm_entry(hp["norm"]).family)


def network(hp: Mapping[str, Any]) -> str:
    return f"{hp['arch']} with {hp['norm']}"


def network_sizes(model: nn.Module) -> tuple[int, int]:
    """(the trainable parameters, the bytes of the buffers) of ``model``."""
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return params, sum(b.numel() * b.element_size() for b in model.buffers())


@dataclass(frozen=True)
class NetworkSizes:
    """What a plan needs of a task's network (``NormTask.planned_sizes``): its trainable parameters and the bytes of
    its buffers (the memory estimate, ``mabn.run.memory``), and the bytes of a checkpoint's weights and buffers and
    of its optimizer state (``NormTask.checkpoint_bytes``)."""

    params: int
    buffers: int
    weights: int
    optimizer: int


@dataclass(frozen=True)
class MemoryPlan:
    """What a dry run plans: the per-device batch, the factor on the gradient accumulation that keeps the global
    batch, and the line that says so."""

    per_device: int
    accumulate: int
    lines: list[str]


def plan(
    hp: Mapping[str, Any],
    sizes: NetworkSizes,
    per_device: int,
    global_batch: int,
    cuda: bool,
    processes: int,
    crop: int | None,
) -> MemoryPlan:
    """The dry run's plan of the memory of a step of ``per_device`` crops of ``crop`` px (None: the data set does
    not exist yet) on a GPU (``cuda``) or on the CPU shared by ``processes`` of this node, for a run of
    ``global_batch``, with the ``sizes`` of the task's network; a ``ConfigError`` where one normalization batch
    does not fit."""
    bpp = per_pixel(hp)
    if bpp is None:
        decoder = hp["decoder"]
        what = network(hp) if decoder == DEFAULT_DECODER else f"decoder {decoder}"
        line = f"memory: no estimate for {what} (not in mabn.run.memory's table): the per-device batch is the recipe's"
        return MemoryPlan(per_device, 1, [line])
    if crop is None:
        return MemoryPlan(per_device, 1, ["memory: estimated once the data set exists (the crop comes from it)"])
    params, buffers = sizes.params, sizes.buffers
    fit = fit_batch(
        per_device,
        hp["norm_batch_size"],
        lambda n: estimate(params, buffers, bpp, crop, n),
        device_budget(cuda, processes),
        network(hp),
    )
    return MemoryPlan(fit.per_device, fit.accumulate, [fit.line(network(hp), global_batch)])


@dataclass(frozen=True)
class Fitted:
    """A fit's memory at its start (``fit``): the budget of its devices (the least of its processes'), the estimate
    of a step of any per-device batch, and the per-device batch and accumulation factor found for the data module's
    batch."""

    budget: Budget
    estimate_at: Callable[[int], Estimate]
    found: Fit


def fit(trainer: pl.Trainer, hp: Mapping[str, Any], model: nn.Module) -> Fitted | None:
    """At the start of a fit (after the data module's setup): the estimate of the task's ``model`` (arguments
    ``hp``) on the device the run trains on, said in one line, and where the data module's per-device batch does
    not fit, the largest that does with the factor on the gradient accumulation that keeps the global batch. Every
    process takes the smallest budget of all, so that all take one batch; a ``ConfigError`` where one normalization
    batch does not fit. None where nothing is estimated (a network outside the table, a data module without a
    per-device batch and a crop)."""
    data = trainer.datamodule
    bpp = per_pixel(hp)
    if bpp is None or not hasattr(data, "batch_size") or not hasattr(data, "crop_size"):
        return None
    device = trainer.strategy.root_device
    local = device_budget(device.type == "cuda", trainer.num_devices, device)
    least = min(gather_objects(local.bytes), key=lambda n: float("inf") if n is None else n)
    budget = local if least == local.bytes else Budget(least, f"the least of the processes'; here {local.source}")
    params, buffers = network_sizes(model)
    crop = data.crop_size

    def estimate_at(images: int) -> Estimate:
        return estimate(params, buffers, bpp, crop, images)

    found = fit_batch(data.batch_size, hp["norm_batch_size"], estimate_at, budget, network(hp))
    global_batch = data.batch_size * trainer.world_size * trainer.accumulate_grad_batches
    say(found.line(network(hp), global_batch))
    return Fitted(budget, estimate_at, found)


def keeps(trainer: pl.Trainer, fitted: Fitted, recorded: Mapping[str, int]) -> str:
    """On a resume, the line that says the fit keeps the layout its checkpoint ``recorded`` (its per-device batch
    and accumulation); a ``ConfigError`` where that batch does not fit the ``fitted`` budget here."""
    need = fitted.estimate_at(recorded["per_device"]).total
    kept = f"{recorded['per_device']} per device x {recorded['accumulate']} accumulated"
    budget = fitted.budget
    if budget.bytes is not None and need > budget.bytes:
        raise ConfigError(
            f"{trainer.ckpt_path} was trained with a batch of {kept}, which needs ~{gb(need)} per device, more "
            f"than the {gb(budget.bytes)} here ({budget.source}): resume where it fits (a resume keeps its batch "
            "layout; another changes the steps of an epoch and the schedule)"
        )
    return f"batch: {kept}, as {trainer.ckpt_path} was trained (~{gb(need)} per device)"
