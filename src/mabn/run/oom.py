"""OutOfMemoryReport: CUDA running out of memory in a training step is one line saying what to lower.

torch's ``OutOfMemoryError`` names the bytes it tried to allocate, not the settings that decide them. At the
moment it is raised the run's data module is at hand, so this callback attaches to the error the line the CLI
prints instead of the traceback (``mabn.errors.explain``): the per-device batch, the crop (stage 2) or image size
(stage 1), and the arguments that make a step smaller, gradient accumulation among them (it keeps the global
batch with fewer images per device). The run's files are untouched by the error: the last
checkpoint resumes with ``--resume auto``.
"""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
import torch

from ..errors import explain
from .scaling import device_batch

CROP = "--data.init_args.crop_size"
BATCH = "--data.init_args.batch_size"
IMAGE = "--data.init_args.image_size"
GLOBAL = "--data.init_args.global_batch_size"
ACCUMULATE = "--trainer.accumulate_grad_batches"


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _accumulation(
    batch: int | None, global_batch: int | None, norm_batch: int | None, devices: int, accumulate: int
) -> str | None:
    """The arguments that halve the images each device holds and accumulate two micro-batches per step instead,
    or None where a device's batch does not halve into whole normalization batches."""
    unit = norm_batch or 1
    if batch is None or batch % (2 * unit):
        return None
    twice = f"{ACCUMULATE} {2 * accumulate}"
    if global_batch is None:
        return f"{BATCH} {batch // 2} {twice} (the same global batch)"
    if global_batch % 2 or (global_batch // 2) % unit:
        return None
    if device_batch(global_batch // 2, devices, norm_batch) >= batch:
        return None
    same = device_batch(global_batch // 2, devices, norm_batch) * 2 == batch
    kept = "the same global batch" if same else "a global batch as close as the split allows"
    return f"{GLOBAL} {global_batch // 2} {twice} ({kept})"


def training_oom_line(datamodule: Any, norm_batch: int | None = None, devices: int = 1, accumulate: int = 1) -> str:
    """The line for an out-of-memory error in a training step of a run on ``datamodule`` (any object: the
    attributes it lacks are left out) over ``devices`` with ``accumulate`` micro-batches per optimizer step."""
    hparams = getattr(datamodule, "hparams", None) or {}
    batch = _int(getattr(datamodule, "batch_size", None))
    crop = _int(getattr(datamodule, "crop_size", None))
    image = _int(hparams.get("image_size")) if crop is None else None
    shape = [f"per-device batch {batch}"] if batch else []
    shape += [f"crop {crop}"] if crop else [f"image size {image}"] if image else []
    global_batch = _int(getattr(datamodule, "global_batch_size", None)) if crop is not None else None
    accumulation = _accumulation(batch, global_batch, norm_batch, devices, accumulate)
    if global_batch:
        # The recipe fixes the global batch; more devices lower each one's share, down to one normalization batch.
        if batch is not None and batch > (norm_batch or 1):
            more = "use more devices so each holds fewer images (global_batch_size splits over them)"
            advice = f"lower {CROP}, {more}" + (f", or accumulate: {accumulation}" if accumulation else "")
        else:
            advice = f"lower {CROP} (more devices would not help: {batch} images is the smallest share of a device)"
    elif crop is not None:
        advice = f"lower {CROP} or {BATCH} (the images each device holds)"
    else:
        advice = f"lower {BATCH} (the images each device holds)" + (f" or {IMAGE}" if image else "")
    if accumulation and not global_batch:
        advice += f", or accumulate: {accumulation}"
    where = f" ({', '.join(shape)})" if shape else ""
    return f"CUDA out of memory in a training step{where}: {advice}"


class OutOfMemoryReport(pl.Callback):
    """Attaches ``training_oom_line`` to an ``OutOfMemoryError`` raised while training (forward, backward,
    optimizer step, CUDA-graph capture); an error of validation keeps its traceback."""

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if not isinstance(exception, torch.OutOfMemoryError) or not trainer.training:
            return
        norm_batch = _int((getattr(pl_module, "hparams", None) or {}).get("norm_batch_size"))
        line = training_oom_line(trainer.datamodule, norm_batch, trainer.world_size, trainer.accumulate_grad_batches)
        explain(exception, line)
