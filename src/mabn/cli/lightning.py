"""The LightningCLI that drives both stages (``python -m mabn fit|validate --config ...``, and the stage launches).

Beyond LightningCLI:
- a mistake in an argument (an unknown name, a value of the wrong type) is one ``error:`` line naming the
  argument, with the closest known name when there is one, and help texts are plain text;

For ``fit``:
- the configuration is checked before anything is read or written (``check_fit_config``: the model built without
  weights on the meta device and checked as the fit's setup checks it, ``build_task``), and a mistake stops
  with one ``error:`` line naming the value;
- the run lives in one experiment folder, the Trainer's ``default_root_dir`` (``mabn.run.folder``), which one run at a
  time holds (``mabn.run.lock``: a second run on it stops before anything is built, naming the holder); the loggers'
  ``save_dir`` and ModelCheckpoint's ``dirpath`` (when the config leaves it unset) point into it, and a ``dirpath``
  the config names must be inside it (``checkpoint_dirs``);
  ``--ckpt_path auto`` resumes from the checkpoint of that folder with the highest step, or starts a new run when
  there is none, so a killed or requeued job restarts with the very same command;
- checkpoints and the saved config are written atomically and loaded weights-only (``AtomicCheckpointIO``); a
  full disk, a quota or a read-only folder is one line naming the file (``mabn.errors.WriteError``);
- a dry run (``check``) stops after the checks, before the data and the weights are built, with the run's plan (the
  checkpoint's size among its lines);
- every trainer gets ``RandomStateCallback`` (exact resume needs the generators' states), ``FailFast`` (a
  failing DDP process stops every process, naming its error), ``LastCheckpoint`` (``checkpoints/last.ckpt``
  the latest state at every end of a fit and every 30 minutes; SLURM's requeue signal and SIGTERM saved at a
  step every process agrees on) and ``OutOfMemoryReport`` (CUDA out of memory in a training
  step is one line naming the per-device batch, the crop or image size, and what to lower), with their default
  settings unless ``trainer.callbacks`` lists one of them with its own, e.g.
  ``--trainer.callbacks+ "{class_path: mabn.run.LastCheckpoint, init_args: {every_minutes: 10}}"``.
- ``validate`` (``test``, ``predict``) with a run's config writes into ``<run>/eval/<subcommand>-<time>/``, never
  into the training run's files (``place_evaluation``), and without ``--ckpt_path`` evaluates the run's
  ``last.ckpt`` or stops (``take_run_checkpoint``);
- where stdout or stderr is not a terminal (SLURM, CI, a pipe), Lightning's progress bar gives way to
  ``LineProgress``: one line every 50 steps (``enable_progress_bar: false`` silences it too).
"""

from __future__ import annotations

import difflib
import itertools
import json
import re
import sys
import time
import warnings
from argparse import ArgumentError
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from jsonargparse import ArgumentParser, DefaultHelpFormatter, Namespace
from pytorch_lightning.cli import LightningArgumentParser, SaveConfigCallback

from ..compat import (
    argument_error_text,
    hold_resumed_epochs,
    lightning_cli,
    option_strings,
    record_trained_batches,
    subcommand_parsers,
)
from ..data.classes import CLASSES_FILE, ClassTable
from ..data.errors import DatasetError
from ..data.loading import DataPlan, workers_line
from ..distributed import first_process
from ..errors import ConfigError, UserError, UserErrors
from ..inference.checkpoint import task_hparams
from ..models import DEFAULT_ARCH
from ..recipes import class_at
from ..run import (
    AtomicCheckpointIO,
    FailFast,
    LastCheckpoint,
    LogCadence,
    OutOfMemoryReport,
    RandomStateCallback,
    RunShape,
    WandbLogger,
    load_weights_file,
    per_device_batch,
    plan_shape,
    use_line_progress,
    write_text_atomic,
)
from ..run import folder as runs
from ..run import lock as runlock
from ..tasks.base import NormTask
from ..tasks.classification import backbone_path
from ..tasks.losses import MOVED
from ..tasks.memory import MemoryPlan
from .help import PROG, PlainTextHelp

CHECKPOINT_CALLBACK = "pytorch_lightning.callbacks.ModelCheckpoint"
LOGGERS_HINT = (
    "the product's loggers: mabn.run.loggers.CSVLogger, mabn.run.loggers.WandbLogger, "
    "mabn.run.loggers.TensorBoardLogger; false for none"
)


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
    (``mabn.run.scaling.per_device_batch``, as the data module takes it)."""
    data, model = config.data.get("init_args") or Namespace(), config.model.get("init_args") or Namespace()
    devices, norm_batch = _devices(config.trainer) or 1, model.get("norm_batch_size")
    return per_device_batch(data.get("batch_size"), data.get("global_batch_size"), devices, norm_batch)


def check_batch(config: Namespace) -> None:
    """The per-device batch must split into whole normalization (ghost) batches."""
    size = (config.model.get("init_args") or Namespace()).get("norm_batch_size")
    per_device = _device_batch(config)
    if size and per_device and per_device % size:
        raise ConfigError(
            f"the per-device batch of {per_device} does not split into normalization batches of "
            f"norm_batch_size={size}: use a per-device batch that is a multiple of {size}"
        )


def data_plan(config: Namespace) -> DataPlan | None:
    """The data module's ``plan`` of its data set (its training samples, its lines), when it has one and the data
    set exists."""
    data, module = config.data.get("init_args") or Namespace(), class_at(config.data.class_path)
    planner = getattr(module, "plan", None)
    return planner(data) if planner is not None and Path(data.get("data_dir") or "").is_dir() else None


def run_shape(config: Namespace, samples: int | None, memory: MemoryPlan | None = None) -> RunShape | None:
    """The run's batch and length from ``config`` and the training ``samples`` (None: unknown) by ``plan_shape``,
    the computation the fit makes from its Trainer; None without a per-device batch. ``memory``: the task's
    ``memory_plan``, whose per-device batch the run takes, with its factor on the gradient accumulation."""
    trainer = config.trainer
    per_device = _device_batch(config)
    if not per_device:
        return None
    accumulate = trainer.get("accumulate_grad_batches") or 1
    if memory is not None:
        per_device, accumulate = memory.per_device, accumulate * memory.accumulate
    norm_batch = (config.model.get("init_args") or Namespace()).get("norm_batch_size")
    limit = trainer.get("limit_train_batches")
    return plan_shape(
        per_device,
        _devices(trainer) or 1,
        accumulate,
        norm_batch,
        samples,
        trainer.get("max_epochs"),
        trainer.get("max_steps"),
        1.0 if limit is None else limit,
    )


def plan_lines(config: Namespace) -> list[str]:
    """What the run's task says at the start of fit (its ``run_plan``'s batch, lr and schedule, and what its
    ``memory_plan`` estimates of the memory per device, where it estimates it), computed from ``config``, then what
    the data module's ``plan`` says of the data set (checked once for both), then what the task's loss takes from it
    (``loss_lines``: the class weights, the crop). The three are the planning contract of ``NormTask``."""
    planned = data_plan(config)
    task, per_device, trainer = class_at(config.model.class_path), _device_batch(config), config.trainer
    if not issubclass(task, NormTask):  # a LightningModule of one's own plans nothing
        return planned.lines if planned else []
    memory = None
    if per_device:  # on the devices the run asks for, at its crop
        accelerator = str(trainer.get("accelerator") or "auto")
        cuda = accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())
        devices = _devices(trainer) or 1
        global_batch = per_device * devices * (trainer.get("accumulate_grad_batches") or 1)
        per_node = max(1, devices // int(trainer.get("num_nodes") or 1))
        crop = planned.crop if planned and planned.crop else (config.data.get("init_args") or {}).get("crop_size")
        memory = task.memory_plan(dict(config.model.init_args), per_device, global_batch, cuda, per_node, crop)
    shape = run_shape(config, planned and planned.train_samples, memory)
    lines = list(task.run_plan(dict(config.model.init_args), shape).lines) if shape is not None else []
    # What the loss takes from the data (its class table's weights, its training pixels', its crop), after the
    # data's lines.
    weights = task.loss_lines(dict(config.model.init_args), planned) if planned is not None else []
    data_args = config.data.get("init_args") or Namespace()
    node = max(1, (_devices(trainer) or 1) // int(trainer.get("num_nodes") or 1))
    workers = [workers_line(data_args.get("num_workers"), node)] if "num_workers" in data_args else []
    return lines + (memory.lines if memory else []) + (planned.lines if planned else []) + weights + workers


def _plain_args(entry: Namespace) -> dict[str, Any]:
    """A class's init arguments in ``entry`` as plain values, a nested class's (``norm_policy``) as one mapping."""
    return runs.plain((entry.get("init_args") or Namespace()).as_dict())


def run_settings(class_path: str) -> frozenset[str]:
    """The init arguments of the class at ``class_path`` that change how its run runs, not what it trains (its
    ``run_settings``; none where it names none): a resume takes them as given."""
    return frozenset(getattr(class_at(class_path), "run_settings", ()))


def experiment(config: Namespace) -> dict[str, Any]:
    """What makes the fit of ``config`` its experiment, each argument named as on the command line: the model's
    and the data's class paths and init arguments (the data folder resolved), less their ``run_settings`` and the
    model's ``num_classes``, which the data decides (``add_arguments_to_parser``); and the data folder's class
    table (``classes.yaml``) where it has one. The trainer's settings (how long, on which devices) are not."""
    found: dict[str, Any] = {}
    for section in ("model", "data"):
        entry = config.get(section)
        if not isinstance(entry, Namespace) or "class_path" not in entry:
            continue
        found[f"--{section}"] = entry.class_path
        left_out = run_settings(entry.class_path) | ({"num_classes"} if section == "model" else set())
        for key, value in _plain_args(entry).items():
            if key not in left_out:
                found[f"--{section}.init_args.{key}"] = value
    data_dir = found.get("--data.init_args.data_dir")
    if isinstance(data_dir, str):
        found["--data.init_args.data_dir"] = str(Path(data_dir).resolve())
        table = Path(data_dir) / CLASSES_FILE
        try:
            found["the class table"] = {k: v for k, v in ClassTable.read(table).as_dict().items() if k != "source"}
        except DatasetError:  # none, or one the data's own checks refuse, naming the file
            pass
    return found


def checkpoint_experiment(hparams: dict[str, Any]) -> dict[str, Any]:
    """The model's part of ``experiment`` from a checkpoint's hyperparameters (``task_hparams``'s, as the task
    takes them): what a run that recorded no experiment is compared with."""
    found: dict[str, Any] = {"--model": hparams["_class_path"]} if "_class_path" in hparams else {}
    left_out = run_settings(hparams["_class_path"]) if "_class_path" in hparams else frozenset()
    for key, value in hparams.items():
        if not key.startswith("_") and key not in left_out | {"num_classes"}:
            found[f"--model.init_args.{key}"] = value
    return found


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
        owner = load_weights_file(target, "backbone", ConfigError, mmap=True).get("config", {}).get("run_dir")
    except ConfigError:  # unreadable: still not this run's to replace
        owner = None
    if owner is None or Path(owner).resolve() != Path(config.trainer.default_root_dir).resolve():
        raise ConfigError(
            f"{target} holds the backbone of another run ({owner or 'unknown'}) and this run would replace it at "
            "its end: move that file, or export elsewhere with --model.init_args.export_dir"
        )


def check_loggers(config: Namespace) -> None:
    """Each logger class that says whether it can run here (``check_installed``: a package it needs) is asked."""
    for logger in _entries(config.trainer.get("logger")):
        check = getattr(class_at(logger.class_path), "check_installed", None)
        if check is not None:
            check()


def accelerator_problem(config: Namespace) -> str | None:
    """Why the Trainer's ``accelerator`` cannot run on this machine: a GPU asked for where CUDA is not there."""
    accelerator = str(config.trainer.get("accelerator") or "")
    if accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
        return (
            f"--trainer.accelerator {accelerator}: this machine has no CUDA device (torch.cuda.is_available() is "
            "False): run on a machine with a GPU, or train on the CPU (--gpus 0, --trainer.accelerator cpu)"
        )
    return None


def check_fit_config(config: Namespace) -> NormTask | None:
    """Every check that needs no data and no weights: the task's arguments, the model the fit builds and the checks
    its setup runs on it (``build_task``), the batch layout, the loggers, the run's folder and its artefacts.
    Returns a ``NormTask`` built without weights; None for a LightningModule of one's own."""
    task = class_at(config.model.class_path)
    if not issubclass(task, NormTask):  # a LightningModule of one's own: built and checked by its fit alone
        built = None
    else:
        task.check_hparams(dict(config.model.init_args))
        built = build_task(config)
    check_batch(config)
    check_loggers(config)
    if not config.trainer.get("default_root_dir"):
        raise ConfigError("trainer.default_root_dir is not set: the run needs a folder of its own")
    if "export_dir" in config.model.init_args:
        check_export(config)
    return built


def build_task(config: Namespace) -> NormTask:
    """The fit's task built by its own constructor on the meta device and checked as the fit's setup checks it
    (its ``build_unweighted``), so that a choice of encoder, decoder, norm and norm policy that cannot train stops
    the dry run and the fit alike, before anything is read or written."""
    hp = _plain_args(config.model)
    # The data module decides the model's classes (the link that instantiation applies): the build takes them as
    # the fit's does. A data folder that cannot say them is the data check's to name; the build keeps the config's.
    try:
        hp["num_classes"] = class_at(config.data.class_path)(**_plain_args(config.data)).num_classes
    except (DatasetError, ConfigError, OSError):
        pass
    return class_at(config.model.class_path).build_unweighted(hp)


def checkpoint_line(task: NormTask | None) -> list[str]:
    """The plan's line on the size of a checkpoint of ``task`` (its ``checkpoint_bytes``: weights and buffers, and
    the optimizer's state that a resume needs); none for a LightningModule of one's own."""
    if task is None:
        return []
    weights, optimizer = task.checkpoint_bytes()

    def mb(size: int) -> str:  # three significant digits, or whole megabytes
        return f"{size / 1e6:.0f}" if size >= 1e8 else f"{size / 1e6:.3g}"

    return [
        f"checkpoint: {mb(weights + optimizer)} MB a file (weights and buffers {mb(weights)} MB, optimizer state "
        f"{mb(optimizer)} MB); a best checkpoint that holds last.ckpt's state is the same file"
    ]


def checkpoint_dirs(config: Namespace, folder: Path) -> list[Path]:
    """The folders the run's checkpoints go to (``mabn.run.folder.checkpoint_dirs``): each ModelCheckpoint's
    ``dirpath``, ``<folder>/checkpoints`` where it names none, spelt from ``folder``. A ``dirpath`` outside the run's
    folder is a ``ConfigError``: a resume, the check that a new run's folder is free and ``last.ckpt`` look for the
    run's checkpoints inside its folder."""
    dirs = []
    for callback in _entries(config.trainer.get("callbacks")):
        if callback.class_path != CHECKPOINT_CALLBACK:
            continue
        given = callback.init_args.get("dirpath")
        if not given:
            dirs.append(folder / runs.CHECKPOINTS)
            continue
        try:
            dirs.append(folder / Path(given).resolve().relative_to(folder.resolve()))
        except ValueError:
            raise ConfigError(
                f"ModelCheckpoint's dirpath {given} is outside the run's folder {folder}: a resume and last.ckpt look "
                f"for the run's checkpoints inside it; leave dirpath unset ({folder / runs.CHECKPOINTS}) or name a "
                "folder inside the run"
            ) from None
    return list(dict.fromkeys(dirs))


def place_run(config: Namespace, folder: Path) -> None:
    """Point the loggers and the checkpoint callbacks of ``config`` into the run's ``folder``."""
    for logger in _entries(config.trainer.get("logger")):
        if "save_dir" in logger.init_args:
            logger.init_args.save_dir = str(folder)
    for callback in _entries(config.trainer.get("callbacks")):
        if callback.class_path == CHECKPOINT_CALLBACK and not callback.init_args.get("dirpath"):
            callback.init_args.dirpath = str(folder / runs.CHECKPOINTS)


def name_wandb_runs(config: Namespace) -> None:
    """Give each ``WandbLogger`` of ``config`` what names, groups and tags its run (``mabn.run.loggers``): the
    task's ``norm`` and ``decoder``, and where no ``dataset`` is given, the name of the data's ``data_dir``; a
    value the logger's entry sets itself is kept."""
    model = config.model.get("init_args") or Namespace()
    data = config.get("data")
    data_dir = (data.get("init_args") or Namespace()).get("data_dir") if isinstance(data, Namespace) else None
    facts = {"norm": model.get("norm"), "decoder": model.get("decoder")}
    facts["dataset"] = Path(str(data_dir)).name if data_dir else None
    for logger in _entries(config.trainer.get("logger")):
        if issubclass(class_at(logger.class_path), WandbLogger):
            for key, value in facts.items():
                if logger.init_args.get(key) is None and isinstance(value, str):
                    logger.init_args[key] = value


def place_evaluation(config: Namespace, subcommand: str) -> None:
    """A ``validate``, ``test`` or ``predict`` with a run's config writes into a folder of its own under the run's,
    ``<run>/eval/<subcommand>-<time>/`` (its metrics, config and wandb run), never into the training run's
    ``metrics.csv``, ``config.yaml`` or wandb run."""
    root = config.trainer.get("default_root_dir")
    if not root:
        return
    stamp = time.strftime("%Y%m%d-%H%M%S")
    folder = Path(root) / "eval" / f"{subcommand}-{stamp}"
    for n in itertools.count(2):
        if not folder.exists():
            break
        folder = folder.with_name(f"{subcommand}-{stamp}-{n}")
    config.trainer.default_root_dir = str(folder)
    place_run(config, folder)


class AtomicSaveConfig(SaveConfigCallback):
    """The resolved config saved as ``config.yaml`` in the run's folder through a temporary file, replacing the
    one of the run it resumes. A resume's records the checkpoint it resumed from: ``ckpt_path`` its file, which
    the same config resumes from again, and a first comment line its epoch and step (``resumed``), which the file
    no longer holds once the run saves to it again (``last.ckpt``)."""

    resumed: runs.Checkpoint | None = None  # set by MabnCLI.instantiate_trainer

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.already_saved:
            return
        log_dir = trainer.log_dir  # a broadcast: every process takes part
        if trainer.is_global_zero and log_dir is not None:
            text = self.parser.dump(self.config, skip_none=False)
            if self.resumed is not None:
                text = f"# resumed from {self.resumed}\n{text}"
            write_text_atomic(Path(log_dir) / self.config_filename, text)
        self.already_saved = True


class ArgumentMistake(UserError):
    """An argument the LightningCLI's parser refused: an unknown name or a value of the wrong type."""


class PlainHelpFormatter(PlainTextHelp, DefaultHelpFormatter):
    """jsonargparse's help (types, defaults) in plain text: the help of Lightning's and the tasks' arguments comes
    from their docstrings."""


class MabnArgumentParser(LightningArgumentParser):
    """The LightningCLI's parsers, and the ones jsonargparse makes for a class's help (``--model.help``): named
    ``python -m mabn``, help in plain text, and a parse error raised (``MabnCLI.parse_arguments`` turns it into
    one line) instead of printing the whole usage."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("prog", PROG)
        kwargs.setdefault("formatter_class", PlainHelpFormatter)
        kwargs.setdefault("exit_on_error", False)
        super().__init__(*args, **kwargs)


def _type_names(text: str) -> str:
    """``[<class 'int'>, <class 'NoneType'>]`` as ``int or null``."""
    names = re.findall(r"<class '(?:[\w.]*\.)?(\w+)'>|((?:[\w.]+\[[^\]]*\]+)|[\w.]+)", text)
    shown = [(cls or other).replace("typing.", "") for cls, other in names]
    return " or ".join("null" if name == "NoneType" else name for name in shown if name)


def _init_options(class_path: str) -> list[str]:
    """The init arguments of the class at ``class_path`` as jsonargparse resolves them (``**kwargs`` passed on
    to a base class included): a misspelt name's candidates; none when the class cannot be read."""
    parser = ArgumentParser(exit_on_error=False)
    try:
        parser.add_class_arguments(class_at(class_path), fail_untyped=False)
    except (ImportError, AttributeError, ValueError):
        return []
    return list(parser.get_defaults().keys())


def _close(name: str, known: list[str]) -> str:
    """`` (did you mean X?)`` for the ``known`` name closest to ``name``: among those of its group (the same
    dotted prefix) by the last part, else among all; where a loss's option was an argument of the task
    (``mabn.tasks.losses.MOVED``), `` (moved: <where it is>)``."""
    group, _, last = name.rpartition(".")
    if last in MOVED:  # an argument that is now an option of its loss: where it is
        return f" (moved: {MOVED[last]})"
    same = {k.rpartition(".")[2]: k for k in known if k.rpartition(".")[0] == group}
    match = [same[m] for m in difflib.get_close_matches(last, same, n=1)] or difflib.get_close_matches(
        name, known, n=1, cutoff=0.8
    )
    return f" (did you mean {match[0]}?)" if match else ""


def argument_mistake(message: str, options: list[str], program: str) -> str:
    """One line for jsonargparse's error ``message``: the argument at fault, the closest of ``options`` (the
    parser's option strings) to an unknown name, and the ``program`` whose ``--help`` lists the arguments."""
    help_line = f"; {program} --help lists the arguments"
    said = argument_error_text(message)
    if said.unknown is not None:
        names = [w.split("=")[0] for w in said.unknown.split() if w.startswith("-")] or said.unknown.split()
        what = "unrecognized argument" + ("s " if len(names) > 1 else " ")
        return what + ", ".join(f"{name}{_close(name, options)}" for name in names) + help_line
    keys, classes, refused = said.keys, said.class_paths, said.refused
    # The model's and the data's own arguments are under init_args; deeper ones (norm_policy's) by their names.
    name = "--" + keys[0] + (".init_args." + ".".join(keys[1:]) if classes and keys[1:] else "") if keys else ""
    if keys and classes and refused:
        prefix = name + (".init_args." if len(keys) == 1 else ".")
        known = [prefix + option for option in _init_options(classes[-1])]
        return f"unrecognized argument {prefix}{refused}{_close(prefix + refused, known)}{help_line}"
    if keys and said.given is not None:
        # The first reason, when there is one, says what to write better than the types do.
        reason = f": {said.reasons[0]}" if said.reasons else ""
        wanted = f"expected {_type_names(said.expected)}, " if said.expected and not reason else ""
        if name == "--trainer.logger":
            reason += f" ({LOGGERS_HINT})"
        return f"{name}: {wanted}got {said.given!r}{reason}{help_line}"
    return message.splitlines()[0] + help_line


class MabnCLI(lightning_cli()):
    """LightningCLI with the product's checks, run folder and callbacks (see the module's doc).

    ``dry_run``: stop after the checks and the plan (``plan_lines``), before the data and weights are built; it takes
    no lock, it says whether another run holds the folder, and it names every problem the run would stop at, all
    at once (``UserErrors``). ``prepare``: called after the checks and the lock, before the classes are
    instantiated (a stage launch generates its demo set there). ``gpus_planned``: a dry run of a launch for
    GPUs, which may be checked on a machine without one (a login node)."""

    def __init__(
        self,
        *args: Any,
        dry_run: bool = False,
        prepare: Callable[[], object] | None = None,
        gpus_planned: bool = False,
        **kwargs: Any,
    ):
        self.dry_run, self.prepare, self.gpus_planned = dry_run, prepare, gpus_planned
        self.plan_lines: list[str] = []
        self.notes: list[str] = []
        self.problems: list[str] = []  # a dry run's, each a line; a run stops at its first
        self.experiment: dict[str, Any] = {}  # a fit's, as given (``experiment``)
        self.dirs: list[Path] = []  # a fit's checkpoint folders (``checkpoint_dirs``); none: the default
        self.task: NormTask | None = None  # a fit's task as built without weights (``build_task``)
        # The parser of the subcommand asked for alone: LightningCLI builds one per subcommand (fit, validate, test,
        # predict), each from the trainer's, model's and data's signatures, a third of a dry run's time for three
        # parsers that are never used. Without a known subcommand first (the command line's own, --help), all four.
        given = kwargs.get("args")
        everything = super().subcommands()
        self.asked = given[0] if isinstance(given, list) and given and given[0] in everything else None
        super().__init__(*args, **kwargs)

    def subcommands(self) -> dict[str, set[str]]:
        everything = super().subcommands()
        return {self.asked: everything[self.asked]} if self.asked else everything

    def problem(self, message: str) -> None:
        """A run stops at ``message``; a dry run notes it and checks on."""
        if not self.dry_run:
            raise ConfigError(message)
        self.problems.append(message)

    def setup_parser(self, add_subcommands: bool, main_kwargs: dict[str, Any], subparser_kwargs: dict[str, Any]):
        super().setup_parser(add_subcommands, main_kwargs, subparser_kwargs)
        # jsonargparse names a subcommand's program "<prog> [options] <subcommand>"; its help and errors name the
        # command as it is typed.
        for name, parser in subcommand_parsers(self).items():
            parser.prog = f"{self.parser.prog} {name}"

    def parse_arguments(self, parser, args) -> None:
        try:
            super().parse_arguments(parser, args)
        except ArgumentError as err:
            words = sys.argv[1:] if args is None else list(args)
            command = next((w for w in words if w in subcommand_parsers(self)), None)
            target = subcommand_parsers(self)[command] if command else parser
            raise ArgumentMistake(argument_mistake(str(err), option_strings(target), target.prog)) from err

    def add_arguments_to_parser(self, parser) -> None:
        # The number of classes is a property of the data, never set twice by hand.
        parser.link_arguments("data.num_classes", "model.init_args.num_classes", apply_on="instantiate")

    def parse_ckpt_path(self) -> None:
        # Lightning reads an explicit --ckpt_path here (and merges its hyperparameters into the config): first
        # make sure it is a readable checkpoint of this experiment, so a wrong file is one line, not a traceback.
        if self.config.get("subcommand") == "fit":
            config = self.config.fit
            identity = runs.Identity(config.model.class_path, config.model.init_args.get("norm"))
            folder = Path(config.trainer.get("default_root_dir") or ".")
            # Every check that needs no data comes first: a mistake stops before anything, the lock included, is
            # written.
            self.task = check_fit_config(config)
            try:
                self.dirs = checkpoint_dirs(config, folder)
            except ConfigError as err:
                self.problem(str(err))
            accelerator = accelerator_problem(config)
            if accelerator and not (self.dry_run and self.gpus_planned):
                self.problem(accelerator)
            # Before the plan: while a run holds the folder, what it holds is no plan's to judge. Only the launch's
            # first process locks; the others are the same run.
            if config.trainer.get("default_root_dir") and first_process():
                if not self.dry_run:
                    runlock.lock(folder)
                else:
                    busy = runlock.in_use(folder)
                    if busy:
                        self.notes.append(f"{busy}: a run of this command started now would stop with exit code 2")
            report = (lambda _: None) if self.dry_run else runs.say_once  # a dry run's plan is printed whole
            try:
                self.plan = runs.plan(folder, config.get("ckpt_path"), identity, first_process(), report, self.dirs)
            except ConfigError as err:  # a dry run goes on to check the data
                self.problem(str(err))
                self.plan = runs.Plan(folder, None)
            config.ckpt_path = None if self.plan.resume is None else str(self.plan.resume.path)
            # As given, before a checkpoint's hyperparameters are merged in: what the run is recorded as.
            self.experiment = experiment(config)
            if self.plan.resume is not None:
                self.check_experiment(config, self.plan.resume)
                reached = self.plan.resume.finished(config.trainer.get("max_epochs"), config.trainer.get("max_steps"))
                if reached:  # Lightning then returns at once: say why nothing trains
                    line = (
                        f"{folder}'s run is finished ({reached}): nothing to train; raise --trainer.max_epochs "
                        "or --trainer.max_steps to train on"
                    )
                    if self.dry_run:
                        self.notes.append(line)
                    else:
                        runs.say_once(line)
        subcommand = self.config.get("subcommand")
        if subcommand in ("validate", "test", "predict") and not self.config[subcommand].get("ckpt_path"):
            self.take_run_checkpoint(self.config[subcommand], subcommand)
        # Lightning's own merge of the checkpoint's hyperparameters into the config, with the task's settings
        # under the keys the task takes (task_hparams translates those of older checkpoints).
        ckpt_path = subcommand and self.config[subcommand].get("ckpt_path")
        if not (ckpt_path and Path(ckpt_path).is_file()):
            return
        # Memory-mapped: only the hyperparameters are read here.
        hparams = load_weights_file(Path(ckpt_path), "checkpoint", ConfigError, mmap=True).get("hyper_parameters") or {}
        hparams = task_hparams(hparams)
        hparams.pop("_instantiator", None)
        if not hparams:
            return
        if subcommand == "fit":  # a run setting given for the resume is taken, and said, not the checkpoint's
            given = self.config.fit.model.get("init_args") or Namespace()
            for key in sorted(run_settings(self.config.fit.model.class_path) & set(hparams)):
                saved = hparams.pop(key)
                if key in given and runs.plain(given[key]) != runs.plain(saved):
                    shown = [json.dumps(runs.plain(value)) for value in (given[key], saved)]
                    runs.say_once(f"Resuming with --model.init_args.{key} {shown[0]} (the checkpoint's: {shown[1]})")
        if "_class_path" in hparams:
            hparams = {"class_path": hparams.pop("_class_path"), "dict_kwargs": hparams}
        try:
            self.config = self.parser.parse_object({subcommand: {"model": hparams}}, self.config)
        except ArgumentError as err:
            raise ArgumentMistake(f"--ckpt_path {ckpt_path}: its hyperparameters do not fit: {err}") from err

    def take_run_checkpoint(self, config: Namespace, subcommand: str) -> None:
        """An evaluation without ``--ckpt_path`` evaluates its run's ``last.ckpt`` (the run of the config's
        ``default_root_dir``), and says so; where there is none it stops: a freshly built model's scores filed
        under a run would pass for the run's."""
        refused = f"{subcommand} without --ckpt_path evaluates the run's last checkpoint, and"
        how = "give the checkpoint to evaluate with --ckpt_path <file>"
        root = config.trainer.get("default_root_dir")
        if not root:
            self.problem(f"{refused} the config names no run folder (trainer.default_root_dir): {how}")
            return
        folder = Path(root)
        try:
            last = runs.checkpoint_dirs(folder, checkpoint_dirs(config, folder))[0] / runs.LAST
        except ConfigError as err:
            self.problem(str(err))
            return
        if not last.is_file():
            self.problem(f"{refused} {folder} holds no {last.relative_to(folder)}: {how}")
            return
        config.ckpt_path = str(last)
        runs.say_once(f"{subcommand.capitalize()}: {last}, the run's latest state (--ckpt_path <file> picks another)")

    def check_experiment(self, config: Namespace, resume: runs.Checkpoint) -> None:
        """A resume continues the experiment its folder recorded (or, where it recorded none, the one its checkpoint
        was trained as), or stops at one line naming each argument that differs and the two ways on."""
        folder = Path(config.trainer.default_root_dir)
        try:
            recorded = runs.read_experiment(folder)
        except ConfigError as err:
            self.problem(str(err))
            return
        where = f"{folder} holds the run of another experiment"
        if recorded is None:
            recorded = checkpoint_experiment(task_hparams(resume.hparams))
            where = f"{resume.path} was trained as another experiment"
        changed = runs.experiment_differences(recorded, self.experiment)
        if changed:
            self.problem(
                f"{where}: {'; '.join(changed)}. Start this one in a folder of its own (--run-dir, or "
                "--trainer.default_root_dir) without --resume (--ckpt_path), or resume with the recorded values"
            )

    def before_instantiate_classes(self) -> None:
        if self.dry_run:
            if self.subcommand == "fit":
                try:
                    built = checkpoint_line(self.task)
                    self.plan_lines = plan_lines(self.config.fit) + built + self.notes
                except UserError as err:
                    self.problems += err.messages if isinstance(err, UserErrors) else [str(err)]
            if self.problems:
                raise UserErrors(self.problems)
            return
        if self.subcommand is not None:
            name_wandb_runs(self.config[self.subcommand])
        if self.prepare is not None:
            self.prepare()
        if self.subcommand in ("validate", "test", "predict"):
            place_evaluation(self.config[self.subcommand], self.subcommand)
        if self.subcommand != "fit":
            return
        place_run(self.config.fit, self.plan.folder)
        if first_process():
            runs.remove_stale_temporaries(self.plan.folder, self.dirs)
            runs.record_experiment(self.plan.folder, self.experiment)
            # A resume logs again from its checkpoint's step on; a new run (--ckpt_path auto where the run died
            # before its first checkpoint) from step 0: the rows the run logged from there on go. A NormTask's rows
            # carry the optimizer steps done (``NormTask._log_step``): its resume logs first at the checkpoint's
            # global step + 1; Lightning's own rows carry the batches stepped before theirs (``logged_step``).
            resume, step = self.plan.resume, 0
            if resume is not None:
                own_steps = issubclass(class_at(self.config.fit.model.class_path), NormTask)
                step = (None if resume.step is None else resume.step + 1) if own_steps else resume.logged_step
            if step is not None:
                runs.cut_metrics(self.plan.folder / runs.METRICS, step)

    def instantiate_classes(self) -> None:
        if not self.dry_run:
            super().instantiate_classes()

    def run_subcommand(self, subcommand: str) -> None:
        if not self.dry_run:
            super().run_subcommand(subcommand)

    def instantiate_trainer(self, **kwargs: Any) -> pl.Trainer:
        config = self.config_init[self.subcommand] if self.subcommand else self.config_init
        plugins = config.get("trainer", {}).get("plugins") or []
        plugins = plugins if isinstance(plugins, list) else [plugins]
        if not any(isinstance(p, pl.plugins.CheckpointIO) for p in plugins):
            kwargs.setdefault("plugins", [*plugins, AtomicCheckpointIO()])
        trainer = super().instantiate_trainer(**kwargs)
        hold_resumed_epochs(trainer)  # a resume with max_steps counts its epochs and logged steps rightly
        plan = getattr(self, "plan", None)  # a fit's
        for callback in trainer.callbacks:
            if isinstance(callback, AtomicSaveConfig) and plan is not None:
                callback.resumed = plan.resume
        record_trained_batches(trainer)  # a resume inside an epoch trains the rest of its batches
        # Exact resume; CUDA out of memory in a training step as one line (before FailFast, which passes that line
        # to the other processes); a failing DDP process stops all; last.ckpt the latest state at every end, SLURM's
        # requeue signal and SIGTERM (scancel, preemption, kill) included. A trainer without checkpointing
        # (enable_checkpointing: false) writes no last.ckpt either.
        guards = [RandomStateCallback(), OutOfMemoryReport(), FailFast()]
        if trainer.checkpoint_callback is not None:
            guards.append(LastCheckpoint())
            # last.ckpt is LastCheckpoint's: ModelCheckpoint's own would be the last improvement only, and
            # beside ours it would write last-v1.ckpt.
            for callback in trainer.checkpoint_callbacks:
                if isinstance(callback, pl.callbacks.ModelCheckpoint):
                    callback.save_last = False
        for callback in guards:
            if not any(isinstance(c, type(callback)) for c in trainer.callbacks):
                trainer.callbacks.append(callback)
        if not trainer.loggers:  # --trainer.logger false: the recipes' lr monitor has nowhere to log, and refuses
            trainer.callbacks = [c for c in trainer.callbacks if not isinstance(c, pl.callbacks.LearningRateMonitor)]
        if config.get("trainer", {}).get("log_every_n_steps") is None:  # unset: at most an epoch's steps
            trainer.callbacks.append(LogCadence())
        use_line_progress(trainer)  # where the output is a file, ~20 lines a run instead of a redrawn bar
        return trainer


def run_cli(
    args: list[str] | None = None,
    run: bool = True,
    dry_run: bool = False,
    prepare: Callable[[], object] | None = None,
    gpus_planned: bool = False,
) -> MabnCLI:
    """The ``MabnCLI`` of ``args`` (default: the command line's); ``run=False`` builds without a subcommand."""
    # python -m mabn <stage> passes its own arguments and keeps sys.argv as it was: Lightning's DDP launcher
    # re-runs sys.argv in the further processes, so the warning about both being given does not apply.
    warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
    return MabnCLI(
        pl.LightningModule,
        pl.LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_callback=AtomicSaveConfig,
        save_config_kwargs={"overwrite": True},
        parser_class=MabnArgumentParser,
        args=args,
        run=run,
        dry_run=dry_run,
        prepare=prepare,
        gpus_planned=gpus_planned,
    )


def check(args: list[str]) -> list[str]:
    """Parse and check a ``fit`` command line without building anything or reading more than file names, and
    take no lock; a ``UserError`` on a mistake. Returns the run's plan: its batch, lr and schedule, and whether
    another run holds the folder. A configuration for GPUs is checked as planned for them: it may be checked on a
    machine without one."""
    return run_cli(args, dry_run=True, gpus_planned=True).plan_lines
