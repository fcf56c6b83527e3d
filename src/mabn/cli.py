"""``python -m mabn fit|validate --config ...``: the LightningCLI that drives both stages.

Beyond LightningCLI, for ``fit``:
- the configuration is checked before anything is built or read (``check_fit_config``), and a mistake stops
  with one ``error:`` line naming the value;
- the run lives in one experiment folder, the Trainer's ``default_root_dir`` (``mabn.runs``), which one run at a
  time holds (``mabn.runlock``: a second run on it stops before anything is built, naming the holder); the loggers'
  ``save_dir`` and ModelCheckpoint's ``dirpath`` (when the config leaves it unset) point into it;
  ``--ckpt_path auto`` resumes from the newest checkpoint of that folder, or starts a new run when there is
  none, so a killed or requeued job restarts with the very same command;
- checkpoints and the saved config are written atomically and loaded weights-only (``AtomicCheckpointIO``); a
  full disk, a quota or a read-only folder is one line naming the file (``mabn.errors.WriteError``);
- every trainer gets ``RandomStateCallback`` (exact resume needs the generators' states), ``FailFast`` (a
  failing DDP process stops every process, naming its error), ``AgreedRequeue`` (SLURM's requeue
  checkpoint at a step every process agrees on) and ``OutOfMemoryReport`` (CUDA out of memory in a training
  step is one line naming the per-device batch, the crop or image size, and what to lower).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from jsonargparse import Namespace
from pytorch_lightning.cli import LightningCLI, SaveConfigCallback

from . import runlock, runs
from .callbacks import AgreedRequeue, FailFast, OutOfMemoryReport, RandomStateCallback
from .data.errors import DatasetError
from .errors import ConfigError, explained, own_message
from .files import AtomicCheckpointIO, write_text_atomic
from .models import DEFAULT_ARCH, BackboneError
from .process import end_process_group_at_exit, first_process
from .scaling import RunShape, device_batch, iterations_per_epoch, loader_batches, total_iterations
from .tasks.classification import backbone_path
from .tasks.restore import task_hparams

CHECKPOINT_CALLBACK = "pytorch_lightning.callbacks.ModelCheckpoint"


def _import(class_path: str) -> type:
    module, _, name = class_path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _entries(value: Any) -> list[Namespace]:
    """A logger or callbacks entry of the config as a list of ``class_path``/``init_args`` namespaces."""
    items = value if isinstance(value, list) else [value]
    return [item for item in items if isinstance(item, Namespace) and "class_path" in item]


def _devices(trainer: Namespace) -> int | None:
    """Processes of the run from the Trainer's devices and num_nodes; None when only Lightning can tell ("auto")."""
    devices = trainer.get("devices")
    if isinstance(devices, list | tuple):
        count = len(devices)
    elif isinstance(devices, int) or (isinstance(devices, str) and devices.isdigit()):
        count = int(devices)
    else:
        return None
    return count * int(trainer.get("num_nodes") or 1) if count > 0 else None


def _device_batch(config: Namespace) -> int | None:
    """The per-device batch: the data's ``batch_size``, or its share of ``global_batch_size`` over the devices
    (``mabn.scaling.device_batch``)."""
    data, model = config.data.get("init_args") or Namespace(), config.model.get("init_args") or Namespace()
    if data.get("global_batch_size"):
        return device_batch(data.global_batch_size, _devices(config.trainer) or 1, model.get("norm_batch_size"))
    return data.get("batch_size")


def check_batch(config: Namespace) -> None:
    """The per-device batch must split into whole normalization (ghost) batches."""
    size = (config.model.get("init_args") or Namespace()).get("norm_batch_size")
    per_device = _device_batch(config)
    if size and per_device and per_device % size:
        raise ConfigError(
            f"the per-device batch of {per_device} does not split into normalization batches of "
            f"norm_batch_size={size}: use a per-device batch that is a multiple of {size}"
        )


def run_shape(config: Namespace) -> RunShape | None:
    """The run's batch and length computed from ``config`` as the Trainer will run them (None without a
    per-device batch); the training samples are counted by file name when the data set exists."""
    data, trainer = config.data.get("init_args") or Namespace(), config.trainer
    per_device = _device_batch(config)
    if not per_device:
        return None
    devices = _devices(trainer) or 1
    accumulate = trainer.get("accumulate_grad_batches") or 1
    counter = getattr(_import(config.data.class_path), "train_samples", None)
    samples = counter(data) if counter is not None and Path(data.get("data_dir") or "").is_dir() else None
    per_epoch = steps = None
    if samples is not None:
        batches = loader_batches(samples, per_device, devices)
        if batches == 0:
            raise ConfigError(
                f"the training split holds {samples} samples: too few for one batch of {per_device} on each of "
                f"{devices} devices"
            )
        per_epoch = iterations_per_epoch(batches, accumulate)
        steps = total_iterations(batches, trainer.get("max_epochs"), trainer.get("max_steps"), accumulate)
    norm_batch = (config.model.get("init_args") or Namespace()).get("norm_batch_size")
    return RunShape(per_device, devices, accumulate, norm_batch, samples, per_epoch, steps)


def plan_lines(config: Namespace) -> list[str]:
    """What the run's task says at the start of fit (batch, lr, schedule), computed from ``config``."""
    task, shape = _import(config.model.class_path), run_shape(config)
    if shape is None or not hasattr(task, "plan_lines"):
        return []
    return task.plan_lines(dict(config.model.init_args), shape)


def check_export(config: Namespace) -> None:
    """Stage 1 exports its backbone at the end: refuse, before training, to replace one that another run wrote
    (a backbone records its run's folder)."""
    init_args = config.model.init_args
    export_dir, norm = init_args.get("export_dir"), init_args.get("norm")
    if not export_dir:
        return
    target = backbone_path(export_dir, norm, init_args.get("arch") or DEFAULT_ARCH)
    if not target.is_file():
        return
    try:
        owner = torch.load(target, map_location="cpu", mmap=True, weights_only=True).get("config", {}).get("run_dir")
    except Exception:  # unreadable: still not this run's to replace
        owner = None
    if owner is None or Path(owner).resolve() != Path(config.trainer.default_root_dir).resolve():
        raise ConfigError(
            f"{target} holds the backbone of another run ({owner or 'unknown'}) and this run would replace it at "
            "its end: move that file, or export elsewhere with --model.init_args.export_dir"
        )


def check_fit_config(config: Namespace) -> None:
    """Every check that needs no data and no weights: the task's arguments, the batch layout, the run's folder
    and its artefacts."""
    task = _import(config.model.class_path)
    if hasattr(task, "check_hparams"):
        task.check_hparams(dict(config.model.init_args))
    check_batch(config)
    if not config.trainer.get("default_root_dir"):
        raise ConfigError("trainer.default_root_dir is not set: the run needs a folder of its own")
    if "export_dir" in config.model.init_args:
        check_export(config)


def place_run(config: Namespace, folder: Path) -> None:
    """Point the loggers and the checkpoint callbacks of ``config`` into the run's ``folder``."""
    for logger in _entries(config.trainer.get("logger")):
        if "save_dir" in logger.init_args:
            logger.init_args.save_dir = str(folder)
    for callback in _entries(config.trainer.get("callbacks")):
        if callback.class_path == CHECKPOINT_CALLBACK and not callback.init_args.get("dirpath"):
            callback.init_args.dirpath = str(folder / runs.CHECKPOINTS)


class AtomicSaveConfig(SaveConfigCallback):
    """The resolved config saved as ``config.yaml`` in the run's folder through a temporary file, replacing the
    one of the run it resumes."""

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.already_saved:
            return
        log_dir = trainer.log_dir  # a broadcast: every process takes part
        if trainer.is_global_zero and log_dir is not None:
            text = self.parser.dump(self.config, skip_none=False)
            write_text_atomic(Path(log_dir) / self.config_filename, text)
        self.already_saved = True


class _Checked(Exception):
    """Raised by ``check`` once the configuration passed, to stop before anything is built; carries the run's
    plan (``plan_lines``)."""

    def __init__(self, plan: list[str]) -> None:
        super().__init__("checked")
        self.plan = plan


class MabnCLI(LightningCLI):
    check_only = False
    take_lock = True  # a run holds its folder (mabn.runlock); a dry run only says whether another run does

    def add_arguments_to_parser(self, parser) -> None:
        # The number of classes is a property of the data, never set twice by hand.
        parser.link_arguments("data.num_classes", "model.init_args.num_classes", apply_on="instantiate")

    def _parse_ckpt_path(self) -> None:
        # Lightning reads an explicit --ckpt_path here (and merges its hyperparameters into the config): first
        # make sure it is a readable checkpoint of this experiment, so a wrong file is one line, not a traceback.
        if self.config.get("subcommand") == "fit":
            config = self.config.fit
            identity = runs.Identity(config.model.class_path, config.model.init_args.get("norm"))
            folder = Path(config.trainer.get("default_root_dir") or ".")
            self.notes: list[str] = []
            # Every check that needs no data comes first: a mistake stops before anything, the lock included, is
            # written.
            check_fit_config(config)
            # Before the plan: while a run holds the folder, what it holds is no plan's to judge. Only the launch's
            # first process locks; the others are the same run.
            if config.trainer.get("default_root_dir") and first_process():
                if self.take_lock:
                    runlock.lock(folder)
                else:
                    busy = runlock.in_use(folder)
                    if busy:
                        self.notes.append(f"{busy}: a run of this command started now would stop with exit code 2")
            quiet = self.check_only  # the run after the check reports the same choice
            report = (lambda _: None) if quiet else runs.say_once
            self.plan = runs.plan(folder, config.get("ckpt_path"), identity, first_process(), report)
            config.ckpt_path = None if self.plan.resume is None else str(self.plan.resume.path)
        # Lightning's own merge, with the task's settings under the keys the task takes (task_hparams).
        subcommand = self.config.get("subcommand")
        ckpt_path = subcommand and self.config[subcommand].get("ckpt_path")
        if ckpt_path and Path(ckpt_path).is_file():
            hparams = task_hparams(torch.load(ckpt_path, weights_only=True, map_location="cpu")["hyper_parameters"])
            hparams.pop("_instantiator", None)
            if "_class_path" in hparams:
                hparams = {"class_path": hparams.pop("_class_path"), "dict_kwargs": hparams}
            self.config = self.parser.parse_object({subcommand: {"model": hparams}}, self.config)

    def before_instantiate_classes(self) -> None:
        if self.subcommand != "fit":
            return
        config = self.config.fit
        if self.check_only:
            raise _Checked(plan_lines(config) + self.notes)
        place_run(config, self.plan.folder)
        if first_process():
            runs.remove_stale_temporaries(self.plan.folder)
            if self.plan.resume is not None and self.plan.resume.step is not None:
                runs.cut_metrics(self.plan.folder / runs.METRICS, self.plan.resume.step)

    def instantiate_trainer(self, **kwargs: Any) -> pl.Trainer:
        plugins = self._get(self.config_init, "trainer", default={}).get("plugins") or []
        plugins = plugins if isinstance(plugins, list) else [plugins]
        if not any(isinstance(p, pl.plugins.CheckpointIO) for p in plugins):
            kwargs.setdefault("plugins", [*plugins, AtomicCheckpointIO()])
        trainer = super().instantiate_trainer(**kwargs)
        # Exact resume; CUDA out of memory in a training step as one line (before FailFast, which passes that line
        # to the other processes); a failing DDP process stops all; SLURM's requeue checkpoint at an agreed step.
        for callback in (RandomStateCallback(), OutOfMemoryReport(), FailFast(), AgreedRequeue()):
            if not any(isinstance(c, type(callback)) for c in trainer.callbacks):
                trainer.callbacks.append(callback)
        return trainer


def run_cli(args: list[str] | None = None, run: bool = True, cli_class: type[MabnCLI] = MabnCLI) -> MabnCLI:
    # python -m mabn <stage> passes its own arguments and keeps sys.argv as it was: Lightning's DDP launcher
    # re-runs sys.argv in the further processes, so the warning about both being given does not apply.
    warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
    return cli_class(
        pl.LightningModule,
        pl.LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_callback=AtomicSaveConfig,
        save_config_kwargs={"overwrite": True},
        args=args,
        run=run,
    )


class _CheckCLI(MabnCLI):
    check_only = True
    take_lock = False


class _LockingCheckCLI(_CheckCLI):
    take_lock = True


def check(args: list[str], lock: bool = False) -> list[str]:
    """Parse and check a ``fit`` command line without building anything or reading more than file names;
    ``ConfigError`` or jsonargparse's own exit on a mistake. Returns the run's plan: its batch, lr and schedule,
    and whether another run holds the folder. ``lock``: the check before this process's own run, which takes
    the folder's lock now (a second launch then stops before it generates any data); else nothing is written."""
    try:
        run_cli(args, cli_class=_LockingCheckCLI if lock else _CheckCLI)
    except _Checked as checked:
        return checked.plan
    return []


def user_error(err: BaseException) -> str | None:
    """The message of the dataset, backbone or configuration error (``WriteError``: a full disk, a quota, a
    read-only folder) behind ``err``, or the line ``mabn.errors.explain`` gave a library's error (CUDA out of
    memory in a training step), if there is one.

    jsonargparse wraps errors raised while it instantiates the data module, and a DataLoader worker
    re-raises with its traceback in the message: dig out the original, one-line message.
    """
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, DatasetError | BackboneError | ConfigError):
            return own_message(err)
        if explained(err) is not None:
            return explained(err)
        err = err.__cause__ or err.__context__
    return None


def exit_on_user_error(err: BaseException) -> None:
    """Print a user error as one ``error:`` line and exit with status 2; anything else is re-raised."""
    message = user_error(err)
    if message is None:
        raise err
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def run_command(
    parser: argparse.ArgumentParser, run: Callable[[argparse.Namespace], object], argv: list[str] | None
) -> None:
    """``run`` the arguments ``parser`` reads from ``argv`` (default: the command line's), a user error as one
    ``error:`` line and exit status 2: the ``main`` of ``python -m mabn test`` and ``predict``."""
    ns = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        run(ns)
    except Exception as err:
        exit_on_user_error(err)


def main(args: list[str] | None = None) -> None:
    end_process_group_at_exit()  # every run, whatever its norm: a DDP worker must exit cleanly
    try:
        run_cli(args)
    except Exception as err:
        exit_on_user_error(err)
