"""What a fit's configuration plans, computed from the configuration alone (no data read but file names, no
weights): the task built without weights and checked as the fit's setup checks it, the batch layout, and the
plan's lines that ``--dry-run`` prints (the task's batch, lr and schedule, its memory estimate, the data set, the
loss's weights, the loader workers, the checkpoint's size). The planning contract is ``NormTask``'s
(``run_plan``, ``memory_plan``, ``loss_lines``) and the data module's (``mabn.data.loading.PlannedData``)."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

import torch
from jsonargparse import Namespace

from ..data.errors import DatasetError
from ..data.loading import DataPlan, PlannedData, workers_line
from ..errors import ConfigError
from ..recipes import class_at
from ..run import RunShape, plan_shape
from ..tasks.base import NetworkSizes, NormTask
from ..tasks.memory import MemoryPlan
from .config import device_batch, devices, init_args, per_node, plain_args


@runtime_checkable
class HasRunSettings(Protocol):
    """A model or data class that names its init arguments that change how its run runs, not what it trains (the
    loader workers, CUDA graphs, where a backbone goes): a resume takes them as given, and they are no part of the
    experiment. The product's tasks and data modules have them; a class of one's own may."""

    run_settings: frozenset[str]


def run_settings(class_path: str) -> frozenset[str]:
    """The ``run_settings`` of the model or data class at ``class_path``; none for a class that names none."""
    cls = class_at(class_path)
    return frozenset(cls.run_settings) if isinstance(cls, HasRunSettings) else frozenset()


def check_batch(config: Namespace) -> None:
    """The per-device batch must split into whole normalization (ghost) batches."""
    size = init_args(config, "model").get("norm_batch_size")
    per_device = device_batch(config)
    if size and per_device and per_device % size:
        raise ConfigError(
            f"the per-device batch of {per_device} does not split into normalization batches of "
            f"norm_batch_size={size}: use a per-device batch that is a multiple of {size}"
        )


def build_task(config: Namespace) -> NetworkSizes:
    """The fit's task built by its own constructor on the meta device and checked as the fit's setup checks it
    (its ``planned_sizes``), so that a choice of encoder, decoder, norm and norm policy that cannot train stops
    the dry run and the fit alike, before anything is read or written; the sizes of its network, which the plan
    takes."""
    hp = plain_args(config.model)
    # The data module decides the model's classes (the link that instantiation applies): the build takes them as
    # the fit's does. A data folder that cannot say them is the data check's to name; the build keeps the config's.
    try:
        hp["num_classes"] = class_at(config.data.class_path)(**plain_args(config.data)).num_classes
    except (DatasetError, ConfigError, OSError):
        pass
    return class_at(config.model.class_path).planned_sizes(hp)


def data_plan(config: Namespace) -> DataPlan | None:
    """The data module's ``plan`` of its data set (its training samples, its lines), when it has one and the data
    set exists."""
    data, module = init_args(config, "data"), class_at(config.data.class_path)
    if not isinstance(module, PlannedData) or not Path(data.get("data_dir") or "").is_dir():
        return None
    return module.plan(data)


def run_shape(config: Namespace, samples: int | None, memory: MemoryPlan | None = None) -> RunShape | None:
    """The run's batch and length from ``config`` and the training ``samples`` (None: unknown) by ``plan_shape``,
    the computation the fit makes from its Trainer; None without a per-device batch. ``memory``: the task's
    ``memory_plan``, whose per-device batch the run takes, with its factor on the gradient accumulation."""
    trainer = config.trainer
    per_device = device_batch(config)
    if not per_device:
        return None
    accumulate = trainer.get("accumulate_grad_batches") or 1
    if memory is not None:
        per_device, accumulate = memory.per_device, accumulate * memory.accumulate
    limit = trainer.get("limit_train_batches")
    return plan_shape(
        per_device,
        devices(trainer) or 1,
        accumulate,
        init_args(config, "model").get("norm_batch_size"),
        samples,
        trainer.get("max_epochs"),
        trainer.get("max_steps"),
        1.0 if limit is None else limit,
    )


def memory_plan(
    config: Namespace, task: type[NormTask], network: NetworkSizes, planned: DataPlan | None
) -> MemoryPlan | None:
    """The task's ``memory_plan`` of its ``network`` on the devices the run asks for, at its crop (the data's,
    else the config's); None without a per-device batch."""
    per_device, trainer = device_batch(config), config.trainer
    if not per_device:
        return None
    accelerator = str(trainer.get("accelerator") or "auto")
    cuda = accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())
    global_batch = per_device * (devices(trainer) or 1) * (trainer.get("accumulate_grad_batches") or 1)
    crop = planned.crop if planned and planned.crop else init_args(config, "data").get("crop_size")
    hp = dict(config.model.init_args)
    return task.memory_plan(hp, network, per_device, global_batch, cuda, per_node(trainer), crop)


def plan_lines(config: Namespace, network: NetworkSizes | None) -> list[str]:
    """What the run's task says at the start of fit (its ``run_plan``'s batch, lr and schedule, and what its
    ``memory_plan`` estimates of the memory per device of its ``network``, where it estimates it; None: a
    LightningModule of one's own), computed from ``config``, then what the data module's ``plan`` says of the data
    set (checked once for both), then what the task's loss takes from it (``loss_lines``: the class weights, the
    crop), then the loader workers."""
    planned = data_plan(config)
    task = class_at(config.model.class_path)
    if network is None or not issubclass(task, NormTask):  # a LightningModule of one's own plans nothing
        return planned.lines if planned else []
    memory = memory_plan(config, task, network, planned)
    shape = run_shape(config, planned and planned.train_samples, memory)
    hp = dict(config.model.init_args)
    lines = list(task.run_plan(hp, shape).lines) if shape is not None else []
    lines += memory.lines if memory else []
    if planned is not None:  # what the loss takes from the data (its class table's weights, its pixels', its crop)
        lines += planned.lines + task.loss_lines(hp, planned)
    data = init_args(config, "data")
    if "num_workers" in data:
        lines.append(workers_line(data.get("num_workers"), per_node(config.trainer)))
    return lines


def checkpoint_line(network: NetworkSizes | None) -> list[str]:
    """The plan's line on the size of a checkpoint of the task's ``network`` (``checkpoint_bytes``: weights and
    buffers, and the optimizer's state that a resume needs); none for a LightningModule of one's own."""
    if network is None:
        return []
    weights, optimizer = network.weights, network.optimizer

    def mb(size: int) -> str:  # three significant digits, or whole megabytes
        return f"{size / 1e6:.0f}" if size >= 1e8 else f"{size / 1e6:.3g}"

    return [
        f"checkpoint: {mb(weights + optimizer)} MB a file (weights and buffers {mb(weights)} MB, optimizer state "
        f"{mb(optimizer)} MB); a best checkpoint that holds last.ckpt's state is the same file"
    ]
