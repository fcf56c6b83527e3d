"""``fit``: a training run of a parsed configuration, its steps in order (``fit``), and the checks that need no
data and no weights (``check_fit_config``).

A dry run (``python -m mabn <stage> --dry-run``, ``mabn.cli.lightning.check``) runs the same steps up to the plan and
stops there: it takes no lock and says whether another run holds the folder, builds nothing, and names every
problem the run would stop at, all at once (``UserErrors``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
from jsonargparse import Namespace

from ..data.classes import CLASSES_FILE, ClassTable
from ..data.errors import DatasetError
from ..distributed import first_process
from ..errors import ConfigError, UserError, UserErrors
from ..inference.checkpoint import task_hparams
from ..models import DEFAULT_ARCH
from ..recipes import class_at
from ..run import folder as runs
from ..run import load_weights_file
from ..run import lock as runlock
from ..tasks.base import NetworkSizes, NormTask
from ..tasks.classification import backbone_path
from .config import checkpoint_dirs, entries, name_wandb_runs, place_run, plain_args
from .plan import build_task, check_batch, checkpoint_line, plan_lines, run_settings


class ParsedFit(Protocol):
    """What ``fit`` takes: a parsed configuration and the ways to merge a checkpoint's hyperparameters into it, to
    build its task, data module and Trainer, and to read the Trainer method's arguments (``MabnCLI``)."""

    config: Namespace

    def take_hparams(self, hparams: dict[str, Any], ckpt_path: str | Path, resume: bool = False) -> Namespace: ...

    def build(self, resumed: runs.Checkpoint | None = None) -> tuple[Any, Any, Any]: ...

    def method_arguments(self) -> dict[str, Any]: ...


class Problems:
    """Where a check's ``problem`` goes: a run stops at its first (a ``ConfigError``), a dry run notes each and
    checks on, and ``stop`` raises them all."""

    def __init__(self, dry_run: bool) -> None:
        self.dry_run, self.found = dry_run, []

    def __call__(self, message: str) -> None:
        if not self.dry_run:
            raise ConfigError(message)
        self.found.append(message)

    def attempt(self, check: Callable[[], Any], stand_in: Any) -> Any:
        """``check()``, or its ``UserError`` noted and ``stand_in`` returned."""
        try:
            return check()
        except UserError as err:
            if not self.dry_run:
                raise
            self.found += err.messages if isinstance(err, UserErrors) else [str(err)]
            return stand_in

    def stop(self) -> None:
        if self.found:
            raise UserErrors(self.found)


def fit(cli: ParsedFit, dry_run: bool = False, prepare: Callable[[], object] | None = None, gpus: bool = False):
    """Train the configuration ``cli`` parsed (``cli.config``), in these steps:

    1. check everything that needs no data and no weights (``check_fit_config``): the task built without weights
       and checked as its setup checks it, the batch layout, the loggers, the run's folder and checkpoint folders,
       the accelerator (``gpus``: a dry run of a launch for GPUs, perhaps on a login node without one);
    2. take the run folder's lock (the launch's first process; the others are the same run);
    3. plan the resume: the checkpoint ``--ckpt_path`` names (``auto``: the folder's latest, or a new run), the
       experiment it continues, and its hyperparameters under the task's arguments;
    4. a dry run stops here, with the run's plan (``plan_lines`` and the checkpoint's size);
    5. point the loggers and checkpoints into the run's folder, record its experiment, and cut the metrics logged
       after the checkpoint's step;
    6. ``prepare`` the data (a launch's demo set);
    7. build the task, the data module and the Trainer, with the product's guards (``MabnCLI.build``);
    8. train.

    Returns the plan's lines (a dry run's) or none."""
    config, problem = cli.config, Problems(dry_run)
    folder = Path(config.trainer.get("default_root_dir") or ".")
    # 1. A mistake stops before anything, the lock included, is written.
    network = check_fit_config(config)
    dirs = problem.attempt(lambda: checkpoint_dirs(config, folder), [])
    accelerator = accelerator_problem(config)
    if accelerator and not (dry_run and gpus):
        problem(accelerator)
    # 2. Before the plan: while a run holds the folder, what it holds is no plan's to judge.
    notes = []
    if config.trainer.get("default_root_dir") and first_process():
        if not dry_run:
            runlock.lock(folder)
        elif busy := runlock.in_use(folder):
            notes.append(f"{busy}: a run of this command started now would stop with exit code 2")
    # 3. The checkpoint to resume, the experiment: as given, before the checkpoint's hyperparameters are merged in.
    report = (lambda _: None) if dry_run else runs.say_once  # a dry run's plan is printed whole
    identity = runs.Identity(config.model.class_path, config.model.init_args.get("norm"))
    plan = problem.attempt(
        lambda: runs.plan(folder, config.get("ckpt_path"), identity, first_process(), report, dirs),
        runs.Plan(folder, None),
    )
    config.ckpt_path = None if plan.resume is None else str(plan.resume.path)
    given = experiment(config)
    if plan.resume is not None:
        check_experiment(config, given, plan.resume, problem)
        reached = plan.resume.finished(config.trainer.get("max_epochs"), config.trainer.get("max_steps"))
        if reached:  # Lightning then returns at once: say why nothing trains
            line = (
                f"{folder}'s run is finished ({reached}): nothing to train; raise --trainer.max_epochs or "
                "--trainer.max_steps to train on"
            )
            if dry_run:
                notes.append(line)
            else:
                runs.say_once(line)
        config = cli.take_hparams(plan.resume.hparams, plan.resume.path, resume=True)  # as read for the plan
    # 4.
    if dry_run:
        lines = problem.attempt(lambda: plan_lines(config, network) + checkpoint_line(network), [])
        problem.stop()
        return lines + notes
    # 5.
    name_wandb_runs(config)
    place_run(config, folder)
    if first_process():
        runs.remove_stale_temporaries(folder, dirs)
        runs.record_experiment(folder, given)
        cut_logged_rows(config, folder, plan.resume)
    # 6.
    if prepare is not None:
        prepare()
    # 7.
    model, data, trainer = cli.build(resumed=plan.resume)
    # 8.
    trainer.fit(model, datamodule=data, **cli.method_arguments())
    return []


def cut_logged_rows(config: Namespace, folder: Path, resume: runs.Checkpoint | None) -> None:
    """A resume logs again from its checkpoint's step on; a new run (--ckpt_path auto where the run died before
    its first checkpoint) from step 0: the rows the run logged from there on go. A NormTask's rows carry the
    optimizer steps done (``NormTask._log_step``): its resume logs first at the checkpoint's global step + 1;
    Lightning's own rows carry the batches stepped before theirs (``logged_step``)."""
    step: int | None = 0
    if resume is not None:
        own_steps = issubclass(class_at(config.model.class_path), NormTask)
        step = (None if resume.step is None else resume.step + 1) if own_steps else resume.logged_step
    if step is not None:
        runs.cut_metrics(folder / runs.METRICS, step)


def check_fit_config(config: Namespace) -> NetworkSizes | None:
    """Every check that needs no data and no weights: the task's arguments, the model the fit builds and the checks
    its setup runs on it (``build_task``), the batch layout, the loggers, the run's folder and its artefacts.
    Returns the sizes of the network, built without weights, that the plan takes; None for a LightningModule of
    one's own."""
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


def check_export(config: Namespace) -> None:
    """Stage 1 exports its backbone at the end: refuse, before training, to replace one that another run wrote
    (a backbone records its run's folder)."""
    model = config.model.init_args
    export_dir, norm = model.get("export_dir"), model.get("norm")
    if not export_dir:
        return
    target = backbone_path(export_dir, norm, model.get("arch") or DEFAULT_ARCH)
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
    for logger in entries(config.trainer.get("logger")):
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


def experiment(config: Namespace) -> dict[str, Any]:
    """What makes the fit of ``config`` its experiment, each argument named as on the command line: the model's
    and the data's class paths and init arguments (the data folder resolved), less their ``run_settings`` and the
    model's ``num_classes``, which the data decides; and the data folder's class table (``classes.yaml``) where it
    has one. The trainer's settings (how long, on which devices) are not."""
    found: dict[str, Any] = {}
    for section in ("model", "data"):
        entry = config.get(section)
        if not isinstance(entry, Namespace) or "class_path" not in entry:
            continue
        found[f"--{section}"] = entry.class_path
        left_out = run_settings(entry.class_path) | ({"num_classes"} if section == "model" else set())
        for key, value in plain_args(entry).items():
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


def check_experiment(
    config: Namespace, given: dict[str, Any], resume: runs.Checkpoint, problem: Callable[[str], None]
) -> None:
    """A resume continues the experiment its folder recorded (or, where it recorded none, the one its checkpoint
    was trained as), or stops at one line naming each argument that differs and the two ways on."""
    folder = Path(config.trainer.default_root_dir)
    try:
        recorded = runs.read_experiment(folder)
    except ConfigError as err:
        problem(str(err))
        return
    where = f"{folder} holds the run of another experiment"
    if recorded is None:
        recorded = checkpoint_experiment(task_hparams(resume.hparams))
        where = f"{resume.path} was trained as another experiment"
    changed = runs.experiment_differences(recorded, given)
    if changed:
        problem(
            f"{where}: {'; '.join(changed)}. Start this one in a folder of its own (--run-dir, or "
            "--trainer.default_root_dir) without --resume (--ckpt_path), or resume with the recorded values"
        )
