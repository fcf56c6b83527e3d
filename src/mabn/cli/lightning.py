"""The LightningCLI of ``python -m mabn fit|validate --config ...`` and of the stage launches: it parses one command's
configuration (``MabnCLI``); ``mabn.cli.fit.fit`` and ``evaluate`` run it, in steps one reads top to bottom.

Beyond LightningCLI:
- a mistake in an argument (an unknown name, a value of the wrong type) is one ``error:`` line naming the
  argument, with the closest known name when there is one, and help texts are plain text (``mabn.cli.arguments``);
- ``fit`` checks the configuration before anything is read or written, holds its run folder (the Trainer's
  ``default_root_dir``, ``mabn.run.folder``) alone (``mabn.run.lock``), resumes with ``--ckpt_path auto`` from the
  folder's checkpoint with the highest step, or starts a new run when there is none, so a killed or requeued job
  restarts with the very same command, and a dry run (``check``) stops after the checks with the run's plan
  (``mabn.cli.fit``);
- the loggers' ``save_dir`` and ModelCheckpoint's ``dirpath`` (when the config leaves it unset) point into the run's
  folder, and a ``dirpath`` the config names must be inside it (``mabn.cli.config.checkpoint_dirs``);
- checkpoints and the saved config are written atomically and loaded weights-only (``AtomicCheckpointIO``); a
  full disk, a quota or a read-only folder is one line naming the file (``mabn.errors.WriteError``);
- every trainer gets ``RandomStateCallback`` (exact resume needs the generators' states), ``FailFast`` (a
  failing DDP process stops every process, naming its error), ``LastCheckpoint`` (``checkpoints/last.ckpt``
  the latest state at every end of a fit and every 30 minutes; SLURM's requeue signal and SIGTERM saved at a
  step every process agrees on) and ``OutOfMemoryReport`` (CUDA out of memory in a training
  step is one line naming the per-device batch, the crop or image size, and what to lower), with their default
  settings unless ``trainer.callbacks`` lists one of them with its own, e.g.
  ``--trainer.callbacks+ "{class_path: mabn.run.LastCheckpoint, init_args: {every_minutes: 10}}"`` (``guard``);
- ``validate`` (``test``, ``predict``) with a run's config writes into ``<run>/eval/<command>-<time>/``, never
  into the training run's files (``place_evaluation``), and without ``--ckpt_path`` evaluates the run's
  ``last.ckpt`` or stops (``run_checkpoint``);
- where stdout or stderr is not a terminal (SLURM, CI, a pipe), Lightning's progress bar gives way to
  ``LineProgress``: about 20 lines a run (``enable_progress_bar: false`` silences it too).
"""

from __future__ import annotations

import inspect
import itertools
import json
import time
import warnings
from argparse import ArgumentError
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
from jsonargparse import Namespace
from pytorch_lightning.cli import LightningCLI, SaveConfigCallback

from ..compat import hold_resumed_epochs, option_strings, record_trained_batches
from ..errors import ConfigError
from ..inference.checkpoint import task_hparams
from ..run import (
    AtomicCheckpointIO,
    FailFast,
    LastCheckpoint,
    LogCadence,
    OutOfMemoryReport,
    RandomStateCallback,
    load_weights_file,
    use_line_progress,
    write_text_atomic,
)
from ..run import folder as runs
from .arguments import ArgumentMistake, MabnArgumentParser, argument_mistake
from .config import checkpoint_dirs, init_args, name_wandb_runs, place_run
from .fit import fit
from .help import PROG
from .plan import run_settings

COMMANDS = tuple(LightningCLI.subcommands())  # fit, validate, test, predict: the Trainer's methods


class MabnCLI(LightningCLI):
    """The parser of one ``command`` (a Trainer method: fit, validate, test, predict) and what it parsed
    (``config``): it builds nothing until ``build`` is called, after the command's checks."""

    def __init__(self, command: str, args: list[str]) -> None:
        self.command = command
        self.plan_lines: list[str] = []  # a dry run's (``mabn.cli.fit.fit``)
        doc = inspect.getdoc(getattr(pl.Trainer, command)) or ""
        super().__init__(
            pl.LightningModule,
            pl.LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            save_config_callback=AtomicSaveConfig,
            save_config_kwargs={"overwrite": True},
            parser_class=MabnArgumentParser,
            parser_kwargs={"prog": f"{PROG} {command}", "description": doc.split("\n\n")[0]},
            args=args,
            run=False,  # the command runs in ``fit`` or ``evaluate``, after its checks
        )

    def add_arguments_to_parser(self, parser: MabnArgumentParser) -> None:
        # The number of classes is a property of the data, never set twice by hand.
        parser.link_arguments("data.num_classes", "model.init_args.num_classes", apply_on="instantiate")
        # The Trainer method's own arguments (ckpt_path, ...), as LightningCLI's parser of the subcommand adds them.
        skip = set(self.subcommands()[self.command])
        self.method_names = parser.add_method_arguments(pl.Trainer, self.command, skip=skip)

    def parse_arguments(self, parser: MabnArgumentParser, args: list[str]) -> None:
        try:
            super().parse_arguments(parser, args)
        except ArgumentError as err:
            raise ArgumentMistake(argument_mistake(str(err), option_strings(parser), parser.prog)) from err

    def instantiate_classes(self) -> None:
        """Nothing while parsing: the command builds after its checks (``build``)."""

    def build(self, resumed: runs.Checkpoint | None = None) -> tuple[pl.LightningModule, Any, pl.Trainer]:
        """The task, the data module and the Trainer of ``config``, with the product's guards; ``resumed``: the
        checkpoint a fit resumes (its saved config records it)."""
        super().instantiate_classes()
        guard(self.trainer, resumed, cadence=self.config.trainer.get("log_every_n_steps") is None)
        return self.model, self.datamodule, self.trainer

    def instantiate_trainer(self, **kwargs: Any) -> pl.Trainer:
        # Every checkpoint written atomically and loaded weights-only, unless the config names its own CheckpointIO.
        plugins = self.config_init.get("trainer", {}).get("plugins") or []
        plugins = plugins if isinstance(plugins, list) else [plugins]
        if not any(isinstance(p, pl.plugins.CheckpointIO) for p in plugins):
            kwargs.setdefault("plugins", [*plugins, AtomicCheckpointIO()])
        return super().instantiate_trainer(**kwargs)

    def method_arguments(self) -> dict[str, Any]:
        """The Trainer method's arguments as parsed (``ckpt_path`` among them)."""
        return {name: self.config.get(name) for name in self.method_names}

    def take_hparams(self, hparams: dict[str, Any], ckpt_path: str | Path, resume: bool = False) -> Namespace:
        """The hyperparameters of the checkpoint at ``ckpt_path`` merged into ``config`` under the task's arguments
        (Lightning's merge, with ``task_hparams`` translating those of older checkpoints), and the merged ``config``.
        A ``resume`` takes a run setting given on its command line, and says so, not the checkpoint's."""
        hparams = task_hparams(hparams)
        hparams.pop("_instantiator", None)
        if not hparams:
            return self.config
        if resume:
            given = init_args(self.config, "model")
            for key in sorted(run_settings(self.config.model.class_path) & set(hparams)):
                saved = hparams.pop(key)
                if key in given and runs.plain(given[key]) != runs.plain(saved):
                    shown = [json.dumps(runs.plain(value)) for value in (given[key], saved)]
                    runs.say_once(f"Resuming with --model.init_args.{key} {shown[0]} (the checkpoint's: {shown[1]})")
        if "_class_path" in hparams:
            hparams = {"class_path": hparams.pop("_class_path"), "dict_kwargs": hparams}
        try:
            self.config = self.parser.parse_object({"model": hparams}, self.config)
        except ArgumentError as err:
            raise ArgumentMistake(f"--ckpt_path {ckpt_path}: its hyperparameters do not fit: {err}") from err
        return self.config


def guard(trainer: pl.Trainer, resumed: runs.Checkpoint | None, cadence: bool) -> None:
    """The product's callbacks and settings on every Trainer: exact resume (its epochs, logged steps and trained
    batches; the generators' states); CUDA out of memory in a training step as one line (before FailFast, which
    passes that line to the other processes); a failing DDP process stops all; last.ckpt the latest state at every
    end, SLURM's requeue signal and SIGTERM (scancel, preemption, kill) included (none where the trainer does not
    checkpoint, ``enable_checkpointing: false``); the line progress; and with ``cadence`` (the config leaves
    ``log_every_n_steps`` unset) a logging cadence of at most an epoch's steps."""
    hold_resumed_epochs(trainer)  # a resume with max_steps counts its epochs and logged steps rightly
    record_trained_batches(trainer)  # a resume inside an epoch trains the rest of its batches
    for callback in trainer.callbacks:
        if isinstance(callback, AtomicSaveConfig):
            callback.resumed = resumed
    guards = [RandomStateCallback(), OutOfMemoryReport(), FailFast()]
    if trainer.checkpoint_callback is not None:
        guards.append(LastCheckpoint())
        # last.ckpt is LastCheckpoint's: ModelCheckpoint's own would be the last improvement only, and beside ours
        # it would write last-v1.ckpt.
        for callback in trainer.checkpoint_callbacks:
            if isinstance(callback, pl.callbacks.ModelCheckpoint):
                callback.save_last = False
    for callback in guards:
        if not any(isinstance(c, type(callback)) for c in trainer.callbacks):
            trainer.callbacks.append(callback)
    if not trainer.loggers:  # --trainer.logger false: the recipes' lr monitor has nowhere to log, and refuses
        trainer.callbacks = [c for c in trainer.callbacks if not isinstance(c, pl.callbacks.LearningRateMonitor)]
    if cadence:
        trainer.callbacks.append(LogCadence())
    use_line_progress(trainer)  # where the output is a file, ~20 lines a run instead of a redrawn bar


def evaluate(cli: MabnCLI) -> None:
    """``validate``, ``test`` or ``predict`` of a checkpoint (``--ckpt_path``; without it the run's ``last.ckpt``):
    its hyperparameters taken, written into a folder of its own under the run's (``place_evaluation``)."""
    config = cli.config
    if not config.get("ckpt_path"):
        config.ckpt_path = str(run_checkpoint(config, cli.command))
    if Path(config.ckpt_path).is_file():
        # Memory-mapped: only the hyperparameters are read here.
        ckpt = load_weights_file(Path(config.ckpt_path), "checkpoint", ConfigError, mmap=True)
        config = cli.take_hparams(ckpt.get("hyper_parameters") or {}, config.ckpt_path)
    name_wandb_runs(config)
    place_evaluation(config, cli.command)
    model, data, trainer = cli.build()
    getattr(trainer, cli.command)(model, datamodule=data, **cli.method_arguments())


def run_checkpoint(config: Namespace, command: str) -> Path:
    """An evaluation without ``--ckpt_path`` evaluates its run's ``last.ckpt`` (the run of the config's
    ``default_root_dir``), and says so; where there is none it stops: a freshly built model's scores filed under a
    run would pass for the run's."""
    refused = f"{command} without --ckpt_path evaluates the run's last checkpoint, and"
    how = "give the checkpoint to evaluate with --ckpt_path <file>"
    root = config.trainer.get("default_root_dir")
    if not root:
        raise ConfigError(f"{refused} the config names no run folder (trainer.default_root_dir): {how}")
    folder = Path(root)
    last = runs.checkpoint_dirs(folder, checkpoint_dirs(config, folder))[0] / runs.LAST
    if not last.is_file():
        raise ConfigError(f"{refused} {folder} holds no {last.relative_to(folder)}: {how}")
    runs.say_once(f"{command.capitalize()}: {last}, the run's latest state (--ckpt_path <file> picks another)")
    return last


def place_evaluation(config: Namespace, command: str) -> None:
    """A ``validate``, ``test`` or ``predict`` with a run's config writes into a folder of its own under the run's,
    ``<run>/eval/<command>-<time>/`` (its metrics, config and wandb run), never into the training run's
    ``metrics.csv``, ``config.yaml`` or wandb run."""
    root = config.trainer.get("default_root_dir")
    if not root:
        return
    stamp = time.strftime("%Y%m%d-%H%M%S")
    folder = Path(root) / "eval" / f"{command}-{stamp}"
    for n in itertools.count(2):
        if not folder.exists():
            break
        folder = folder.with_name(f"{command}-{stamp}-{n}")
    config.trainer.default_root_dir = str(folder)
    place_run(config, folder)


class AtomicSaveConfig(SaveConfigCallback):
    """The resolved config saved as ``config.yaml`` in the run's folder through a temporary file, replacing the
    one of the run it resumes. A resume's records the checkpoint it resumed from: ``ckpt_path`` its file, which
    the same config resumes from again, and a first comment line its epoch and step (``resumed``), which the file
    no longer holds once the run saves to it again (``last.ckpt``)."""

    resumed: runs.Checkpoint | None = None  # set by ``guard``

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.already_saved:
            return
        log_dir = trainer.log_dir  # a broadcast: every process takes part
        if trainer.is_global_zero and log_dir is not None:
            # Validated when parsed; a dump that validates checks every value anew (25 of 40 ms for a stage-2 config).
            text = self.parser.dump(self.config, skip_none=False, skip_validation=True)
            if self.resumed is not None:
                text = f"# resumed from {self.resumed}\n{text}"
            write_text_atomic(Path(log_dir) / self.config_filename, text)
        self.already_saved = True


def run_cli(
    args: list[str],
    run: bool = True,
    dry_run: bool = False,
    prepare: Callable[[], object] | None = None,
    gpus_planned: bool = False,
) -> MabnCLI:
    """Parse ``args`` (a command, fit or validate, and its arguments) and run the command: ``fit`` (``dry_run``,
    ``prepare``, ``gpus_planned``: see ``mabn.cli.fit.fit``) or ``evaluate``. ``run=False``: ``args`` are a fit's
    without the command, parsed and built, not run (its ``model``, ``datamodule`` and ``trainer``)."""
    # python -m mabn <stage> passes its own arguments and keeps sys.argv as it was: Lightning's DDP launcher
    # re-runs sys.argv in the further processes, so the warning about both being given does not apply.
    warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
    if not run:
        cli = MabnCLI("fit", args)
        cli.build()
        return cli
    if not args or args[0] not in COMMANDS:
        given = f"got {args[0]!r}" if args else "got none"
        raise ArgumentMistake(f"expected a command, one of {', '.join(COMMANDS)}; {given}; {PROG} --help lists them")
    cli = MabnCLI(args[0], args[1:])
    if cli.command == "fit":
        cli.plan_lines = fit(cli, dry_run, prepare, gpus_planned)
    else:
        evaluate(cli)
    return cli


def check(args: list[str]) -> list[str]:
    """Parse and check a ``fit`` command line without building anything or reading more than file names, and
    take no lock; a ``UserError`` on a mistake. Returns the run's plan: its batch, lr and schedule, and whether
    another run holds the folder. A configuration for GPUs is checked as planned for them: it may be checked on a
    machine without one."""
    return run_cli(args, dry_run=True, gpus_planned=True).plan_lines
