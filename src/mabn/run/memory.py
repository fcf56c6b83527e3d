"""A training step's peak memory per device: the estimate a run plans with, the memory its device offers, and the
per-device batch that fits (docs/scaling.md, "Memory per device").

The estimate is a fixed part, ``BYTES_PER_PARAMETER`` per trainable parameter (float32 weights, their gradients and
SGD's momentum) and the buffers, plus the activations: ``ACTIVATION_BYTES`` per pixel of the training crop and per
image, measured per encoder and norm family, times crop x crop x the per-device batch. The budget is the GPU's free
memory where the run trains on a GPU, else the RAM available (``MemAvailable``) shared by this node's processes,
each less a margin, and at most ``MABN_MEMORY_BUDGET_GB``. Where the recipe's per-device batch does not fit, the
run takes the largest that does among the whole numbers of normalization batches that divide it, and accumulates
gradients over the rest, so the global batch (and with it the lr and the schedule) stays the recipe's; where one
normalization batch does not fit, the run is refused before it starts.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import ConfigError

GB = 10**9
BUDGET_ENV = "MABN_MEMORY_BUDGET_GB"  # GB (10^9 bytes) per device, at most: lowers whatever the device offers
BYTES_PER_PARAMETER = 12  # float32 weights, gradients and SGD's momentum, all held through a step
# What the step may take of what the device offers: on a GPU the rest is for cuDNN's workspaces and the caching
# allocator's slack; on the CPU for the loader workers' batches, the allocator's slack and the rest of the machine.
GPU_SHARE = 0.9
CPU_SHARE = 0.8

# Activations of stage 2's training step (PSPNet, the recipe's norm options, normalization batches of 2), in bytes
# per pixel of the training crop and per image, by (encoder, norm family): the rise of the step's peak resident set
# on the CPU from 128 x 128 crops of 2 images to 192 x 192 crops of 4 (mabn.tools.bench.memory), measured by
#   python -m mabn bench memory --table --archs resnet18 resnet34 resnet50 resnet101 resnet152 resnext50_32x4d \
#       efficientnet-b0 mobilenet_v2
# (the peaks at both points beside each value). docs/bench-memory-cpu.md holds the estimate against measured peaks.
ACTIVATION_BYTES: dict[tuple[str, str], int] = {
    ("resnet18", "bn"): 1822,  # peaks 352 and 561 MB
    ("resnet18", "gn"): 1268,  # peaks 359 and 505 MB
    ("resnet18", "brn"): 1890,  # peaks 350 and 567 MB
    ("resnet18", "mabn"): 1192,  # peaks 348 and 485 MB
    ("resnet34", "bn"): 2592,  # peaks 481 and 778 MB
    ("resnet34", "gn"): 2128,  # peaks 477 and 721 MB
    ("resnet34", "brn"): 2320,  # peaks 502 and 768 MB
    ("resnet34", "mabn"): 1654,  # peaks 475 and 664 MB
    ("resnet50", "bn"): 7837,  # peaks 923 and 1821 MB
    ("resnet50", "gn"): 4649,  # peaks 914 and 1448 MB
    ("resnet50", "brn"): 7006,  # peaks 903 and 1707 MB
    ("resnet50", "mabn"): 4933,  # peaks 885 and 1451 MB
    ("resnet101", "bn"): 11593,  # peaks 1183 and 2512 MB
    ("resnet101", "gn"): 9178,  # peaks 1185 and 2238 MB
    ("resnet101", "brn"): 11165,  # peaks 1197 and 2477 MB
    ("resnet101", "mabn"): 8690,  # peaks 1167 and 2163 MB
    ("resnet152", "bn"): 15371,  # peaks 1446 and 3209 MB
    ("resnet152", "gn"): 11777,  # peaks 1429 and 2779 MB
    ("resnet152", "brn"): 16517,  # peaks 1412 and 3306 MB
    ("resnet152", "mabn"): 12020,  # peaks 1413 and 2791 MB
    ("resnext50_32x4d", "bn"): 9048,  # peaks 985 and 2023 MB
    ("resnext50_32x4d", "gn"): 7003,  # peaks 944 and 1747 MB
    ("resnext50_32x4d", "brn"): 9473,  # peaks 933 and 2019 MB
    ("resnext50_32x4d", "mabn"): 6337,  # peaks 954 and 1681 MB
    ("efficientnet-b0", "bn"): 7614,  # peaks 370 and 1243 MB
    ("efficientnet-b0", "gn"): 7456,  # peaks 342 and 1197 MB
    ("efficientnet-b0", "brn"): 7600,  # peaks 357 and 1229 MB
    ("efficientnet-b0", "mabn"): 6778,  # peaks 365 and 1142 MB
    ("mobilenet_v2", "bn"): 6771,  # peaks 460 and 1237 MB
    ("mobilenet_v2", "gn"): 5896,  # peaks 455 and 1131 MB
    ("mobilenet_v2", "brn"): 6927,  # peaks 462 and 1256 MB
    ("mobilenet_v2", "mabn"): 5943,  # peaks 466 and 1147 MB
}


def activation_bytes(arch: str, family: str) -> int | None:
    """Bytes per pixel and image of encoder ``arch`` with a norm of ``family`` (a norm entry's ``family``: syncbn's
    is bn); None where the table has no such entry."""
    return ACTIVATION_BYTES.get((arch, family))


@dataclass(frozen=True)
class Estimate:
    """A training step's peak bytes per device: ``fixed`` (parameters, gradients, momentum, buffers) and
    ``activations`` (of ``images`` crops of ``crop`` x ``crop``)."""

    fixed: int
    activations: int
    crop: int
    images: int

    @property
    def total(self) -> int:
        return self.fixed + self.activations


def estimate(params: int, buffer_bytes: int, per_pixel: int, crop: int, images: int) -> Estimate:
    """The estimate of a step of ``images`` crops of ``crop`` px of a network of ``params`` trainable parameters and
    ``buffer_bytes`` of buffers, whose activations take ``per_pixel`` bytes per pixel and image."""
    return Estimate(params * BYTES_PER_PARAMETER + buffer_bytes, per_pixel * crop * crop * images, crop, images)


def gb(n: int) -> str:
    """``n`` bytes in GB, to a tenth, and below 1 GB to a hundredth (a small network's budget and estimate)."""
    return f"{n / GB:.{1 if n >= GB else 2}f} GB"


@dataclass(frozen=True)
class Budget:
    """The bytes a training step may take on each device (None: not known on this machine), and where they come
    from, in words."""

    bytes: int | None
    source: str


def budget_setting() -> float | None:
    """``MABN_MEMORY_BUDGET_GB`` in GB, None where unset; a ``ConfigError`` where it is no positive number."""
    text = os.environ.get(BUDGET_ENV, "").strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (value > 0 and math.isfinite(value)):
        raise ConfigError(f"{BUDGET_ENV}={text!r}: give the memory per device in GB, a number above 0 (e.g. 8)")
    return value


def mem_available() -> int | None:
    """The RAM the kernel can give new allocations without swapping (``MemAvailable``), None where unknown."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def device_budget(cuda: bool, processes: int = 1, device: object = None) -> Budget:
    """The budget of one device: ``GPU_SHARE`` of the free memory of the CUDA ``device`` (``cuda``; unknown where
    CUDA is not available here, as a GPU run planned on a login node), else ``CPU_SHARE`` of the RAM available over
    the node's ``processes``; at most ``MABN_MEMORY_BUDGET_GB``."""
    import torch

    setting = budget_setting()
    found, source = None, "the GPU's memory, read when the run starts (no CUDA device here)"
    if cuda and torch.cuda.is_available():
        free = torch.cuda.mem_get_info(device)[0]
        found, source = int(free * GPU_SHARE), f"{GPU_SHARE:.0%} of the GPU's {gb(free)} free"
    elif not cuda:
        available = mem_available()
        if available is not None:
            found = int(available * CPU_SHARE / processes)
            over = f" over {processes} processes" if processes > 1 else ""
            source = f"{CPU_SHARE:.0%} of the {gb(available)} of RAM available{over}"
    if setting is not None and (found is None or setting * GB < found):
        return Budget(int(setting * GB), f"{BUDGET_ENV}={setting:g}")
    return Budget(found, source)


@dataclass(frozen=True)
class Fit:
    """The per-device batch a run takes (``per_device``, with ``accumulate`` times the gradient accumulation it was
    given) for the ``recipe`` per-device batch, and the estimate of each."""

    per_device: int
    accumulate: int
    recipe: int
    estimate: Estimate
    recipe_estimate: Estimate
    budget: Budget

    def line(self, network: str, global_batch: int) -> str:
        """The one line that says the estimate, the budget and, where the batch was lowered, what keeps the
        global batch (``global_batch``); ``network``: the encoder and norm, in words."""
        step = self.recipe_estimate
        parts = (
            f"{gb(step.fixed)} parameters, gradients and momentum + {gb(step.activations)} activations of "
            f"{step.images} crops of {step.crop}x{step.crop}, {network}"
        )
        head = f"memory: about {gb(step.total)} per device ({parts})"
        if self.budget.bytes is None:
            return f"{head}; the budget is {self.budget.source}"
        if self.per_device == self.recipe:
            return f"{head}, within the budget of {gb(self.budget.bytes)} ({self.budget.source})"
        return (
            f"{head}, above the budget of {gb(self.budget.bytes)} ({self.budget.source}): {self.per_device} images "
            f"per device (about {gb(self.estimate.total)}) with accumulate_grad_batches {self.accumulate} keep the "
            f"global batch {global_batch}"
        )


def fit_batch(
    per_device: int, norm_batch: int | None, estimate_at: Callable[[int], Estimate], budget: Budget, network: str
) -> Fit:
    """The largest per-device batch that fits ``budget`` by ``estimate_at`` (the estimate at a per-device batch):
    among the divisors of ``per_device`` that are whole numbers of normalization batches (``norm_batch``; None:
    single images), so that accumulating ``per_device / it`` micro-batches keeps the global batch. The recipe's
    where the budget is unknown. A ``ConfigError`` naming what to lower where not even one normalization batch
    fits; ``network``, the encoder and norm in words, for it."""
    unit = norm_batch or 1
    recipe = estimate_at(per_device)
    if budget.bytes is None or recipe.total <= budget.bytes:
        return Fit(per_device, 1, per_device, recipe, recipe, budget)
    for images in range(per_device - unit, 0, -unit):
        if per_device % images == 0 and estimate_at(images).total <= budget.bytes:
            return Fit(images, per_device // images, per_device, estimate_at(images), recipe, budget)
    least = estimate_at(unit)
    what = f"one normalization batch of {unit}" if norm_batch else "one image"
    raise ConfigError(
        f"{what} ({unit} crop(s) of {least.crop}x{least.crop}, {network}) needs about {gb(least.total)} per device, "
        f"above the budget of {gb(budget.bytes)} ({budget.source}): lower --data.init_args.crop_size, take a smaller "
        "encoder (--model.init_args.arch), or train on a device with more memory"
    )
