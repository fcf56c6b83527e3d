"""One folder per experiment, and which checkpoint a restarted fit continues from.

A fit writes everything into its experiment folder, the Trainer's ``default_root_dir`` (``python -m mabn
<stage>`` makes it ``runs/<stage>/<norm>``, or ``runs/demo/<stage>/<norm>`` for the demo profile):
``checkpoints/`` (best-k and ``last.ckpt``), ``metrics.csv``, ``config.yaml``, ``wandb/`` with the run's id in
``wandb-id``; a resume also reads Lightning's SLURM checkpoints ``hpc_ckpt_<n>.ckpt``. A restart continues in the same
folder: the same checkpoint folder (so ModelCheckpoint keeps its best across restarts), the same CSV file
(cut back to the resumed step) and the same wandb run. One run at a time holds the folder (``mabn.run.lock``).

``--ckpt_path`` decides which checkpoint the fit starts from:
- none: a new run, refused in a folder that already holds one (it would overwrite its checkpoints);
- ``auto``: the readable, intact checkpoint of the folder written by the same task and norm with the highest global
  step (a tie goes to ``last.ckpt``), or a new run when there is none (a killed or requeued job restarts with
  the very same command). The step, not the file's time, which a copy of the folder (``cp -r``) changes;
- ``last``: the folder's ``checkpoints/last.ckpt`` (Lightning's word for the latest checkpoint);
- a path: that checkpoint, checked to be readable, intact and of the same task and norm.
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..compat import epochs_trained, resumed_logging_step
from ..distributed import say as say_once
from ..errors import ConfigError
from .files import TMP_SUFFIX, intact, load_weights_file, write_atomic, write_text_atomic

AUTO = "auto"
LAST_PATH = "last"  # Lightning's name for the latest checkpoint: here the run's own checkpoints/last.ckpt
CHECKPOINTS = "checkpoints"
LAST = "last.ckpt"  # in CHECKPOINTS: the run's latest state (mabn.run.last.LastCheckpoint)
METRICS = "metrics.csv"
EXPERIMENT = "experiment.json"  # what makes the folder's run its experiment (``record_experiment``)


@dataclass(frozen=True)
class Identity:
    """What makes a checkpoint one of this experiment's: the task's class path and its norm."""

    class_path: str
    norm: str | None

    def differs(self, hparams: dict[str, Any]) -> str | None:
        """Why a checkpoint with ``hparams`` is not this experiment's, or None when it is."""
        saved_class = hparams.get("_class_path")
        if saved_class is not None and saved_class != self.class_path:
            return f"it was written by {saved_class}, this run trains {self.class_path}"
        if hparams.get("norm") != self.norm:
            return f"it was trained with norm {hparams.get('norm')!r}, this run uses {self.norm!r}"
        return None


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint's counters: ``step`` its global step, ``logged_step`` the step under which a fit resumed from
    it logs its first row (the counter the rows of ``metrics.csv`` carry), ``epochs`` the epochs it trained to
    their end (as ``max_epochs`` counts them)."""

    path: Path
    epoch: int | None
    step: int | None
    hparams: dict[str, Any]
    logged_step: int | None = None
    epochs: int | None = None

    def finished(self, max_epochs: int | None, max_steps: int | None) -> str | None:
        """Which of the Trainer's limits (``-1`` or None: none) this checkpoint's fit has reached, as a phrase; None
        when a resume trains on. Lightning's own default, 1000 epochs without ``max_steps``, counts."""
        max_steps = -1 if max_steps is None else max_steps
        if max_epochs is None and max_steps == -1:
            max_epochs = 1000
        if max_steps != -1 and self.step is not None and self.step >= max_steps:
            return f"max_steps={max_steps} reached at step {self.step}"
        if max_epochs not in (None, -1) and self.epochs is not None and self.epochs >= max_epochs:
            return f"max_epochs={max_epochs} reached, {self.epochs} trained"
        return None

    def __str__(self) -> str:
        return f"{self.path} (epoch {self.epoch}, step {self.step})"


def read_checkpoint(path: Path) -> Checkpoint:
    """The checkpoint's counters and hyperparameters (its tensors stay mapped, not read); ``ConfigError``
    naming the file when it is missing, cut short or not a checkpoint."""
    ckpt = load_weights_file(Path(path), "checkpoint", ConfigError, mmap=True)
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt and "hyper_parameters" not in ckpt:
        raise ConfigError(f"{path} is not a Lightning checkpoint (no state_dict)")
    hparams = dict(ckpt.get("hyper_parameters") or {})
    counters = ckpt.get("epoch"), ckpt.get("global_step")
    return Checkpoint(path, *counters, hparams, resumed_logging_step(ckpt), epochs_trained(ckpt))


def checkpoint_dirs(folder: Path, dirs: Sequence[Path] = ()) -> list[Path]:
    """The folders of ``folder``'s checkpoints: ``dirs`` (the ModelCheckpoints' ``dirpath``, folders inside
    ``folder`` and spelt from it; the first the one of ``last.ckpt``), else ``checkpoints/``."""
    return list(dirs) or [folder / CHECKPOINTS]


def checkpoint_files(folder: Path, say: Callable[[str], None] = say_once, dirs: Sequence[Path] = ()) -> list[Path]:
    """The folder's checkpoints, newest first: ``*.ckpt`` in its checkpoint folders (``checkpoint_dirs``) and
    Lightning's ``hpc_ckpt_*.ckpt``. A link whose target is gone is reported and left out."""
    found = []
    ckpts = [path for where in checkpoint_dirs(folder, dirs) for path in where.glob("*.ckpt")]
    for path in [*dict.fromkeys(ckpts), *folder.glob("hpc_ckpt_*.ckpt")]:
        try:
            found.append((path.stat().st_mtime, path))
        except OSError:  # a dangling link, or a file removed while we looked
            say(f"Skipping {path}: the link's target is gone")
    return [path for _, path in sorted(found, key=lambda item: item[0], reverse=True)]


def newest_checkpoint(
    folder: Path, identity: Identity, say: Callable[[str], None] = say_once, dirs: Sequence[Path] = ()
) -> Checkpoint | None:
    """The readable checkpoint of ``folder`` (its checkpoint folders ``dirs``, ``checkpoint_dirs``) that belongs to
    ``identity`` with the highest global step, of those whose content is what was saved (``damage``); of equal
    steps ``last.ckpt``, then the newer file. Others are skipped with a message saying why."""
    found = []
    for path in checkpoint_files(folder, say, dirs):
        try:
            ckpt = read_checkpoint(path)
        except ConfigError as err:
            say(f"Skipping {err}")
            continue
        reason = identity.differs(ckpt.hparams)
        if reason is None:
            found.append(ckpt)
        else:
            say(f"Skipping {path}: {reason}")
    # sorted keeps the order of equal keys: checkpoint_files lists the newer file first.
    ranked = sorted(found, key=lambda c: (c.step if c.step is not None else -1, c.path.name == LAST), reverse=True)
    for ckpt in ranked:  # the newest whose content is what was saved
        reason = damage(ckpt.path)
        if reason is None:
            return ckpt
        say(f"Skipping {ckpt.path}: {reason}")
    return None


def damage(path: Path) -> str | None:
    """Why the checkpoint at ``path`` does not hold what was saved, or None when it does (or records no digest):
    its values are read in full and their digest compared with the one recorded at the save."""
    try:
        verdict = intact(load_weights_file(path, "checkpoint", ConfigError, mmap=True))
    except ConfigError as err:
        return str(err)
    if verdict is False:
        return "its content is not what was saved (its digest differs from the one recorded at the save): damaged"
    return None


def holds_a_run(folder: Path, dirs: Sequence[Path] = ()) -> bool:
    """Whether ``folder`` holds another run's checkpoints (in its checkpoint folders ``dirs``) or metrics, which a
    new run would overwrite."""
    return bool(checkpoint_files(folder, lambda _: None, dirs)) or (folder / METRICS).is_file()


@dataclass(frozen=True)
class Plan:
    """Where a fit writes and what it starts from."""

    folder: Path
    resume: Checkpoint | None


def plan(
    folder: Path,
    ckpt_path: str | None,
    identity: Identity,
    first_process: bool = True,
    say: Callable[[str], None] = say_once,
    dirs: Sequence[Path] = (),
) -> Plan:
    """The fit's plan for ``--ckpt_path`` (see the module doc), the run's checkpoints in ``dirs``
    (``checkpoint_dirs``); ``ConfigError`` when it cannot work.

    Only the first process of a launch checks that a new run's folder is free: the other processes start
    after it has begun writing there. ``say`` reports the checkpoints skipped and the one chosen."""
    if ckpt_path is None:
        if first_process and holds_a_run(folder, dirs):
            raise ConfigError(
                f"{folder} already holds a run: continue it with --resume auto (--ckpt_path auto), or start a new "
                "one in another folder (--run-dir, or --trainer.default_root_dir)"
            )
        return Plan(folder, None)
    if ckpt_path == AUTO:
        found = newest_checkpoint(folder, identity, say, dirs)
        if found is None:
            say(f"No checkpoint to resume in {folder}: starting a new run.")
        else:
            say(f"Resuming from {found}.")
        return Plan(folder, found)
    if ckpt_path == LAST_PATH:
        ckpt_path = checkpoint_dirs(folder, dirs)[0] / LAST
        if not ckpt_path.is_file():
            raise ConfigError(
                f"--ckpt_path last: {folder} holds no {ckpt_path.relative_to(folder)}; --ckpt_path auto resumes the "
                "latest checkpoint there, or starts a new run when there is none"
            )
        say(f"Resuming from {ckpt_path} (--ckpt_path last).")
    ckpt = read_checkpoint(Path(ckpt_path))
    reason = identity.differs(ckpt.hparams) or damage(ckpt.path)
    if reason is not None:
        raise ConfigError(f"cannot resume from {ckpt.path}: {reason}")
    return Plan(folder, ckpt)


def plain(value: Any) -> Any:
    """``value`` as the JSON value it is recorded as (tuples as lists, keys as text), so that a value read back
    from ``experiment.json`` and the same value parsed from a command line compare equal."""
    return json.loads(json.dumps(value, sort_keys=True, default=str))


def read_experiment(folder: Path) -> dict[str, Any] | None:
    """The experiment ``folder``'s run recorded (``record_experiment``), or None where it recorded none; a
    ``ConfigError`` naming the file when it does not read."""
    path = folder / EXPERIMENT
    if not path.is_file():
        return None
    try:
        recorded = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"{path} does not read as the run's experiment ({err}): remove it to record it anew") from err
    if not isinstance(recorded, dict):
        raise ConfigError(f"{path} does not read as the run's experiment (not a mapping): remove it to record it anew")
    return recorded


def record_experiment(folder: Path, experiment: dict[str, Any]) -> None:
    """Record in ``folder`` what makes its run this experiment: ``experiment`` maps each argument (named as on the
    command line) to its value."""
    write_text_atomic(folder / EXPERIMENT, json.dumps(plain(experiment), indent=1, sort_keys=True) + "\n")


def experiment_differences(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """One phrase per argument both name with different values: ``--name value (recorded: value)``."""

    def shown(value: Any) -> str:
        return json.dumps(value) if not isinstance(value, str) else value

    found = []
    for name in sorted(set(recorded) & set(current)):
        if plain(recorded[name]) != plain(current[name]):
            if isinstance(current[name], dict) and isinstance(recorded[name], dict) and not name.startswith("--"):
                found.append(f"{name} (not the recorded one)")  # a table: its difference, not its whole text
            else:
                found.append(f"{name} {shown(current[name])} (recorded: {shown(recorded[name])})")
    return found


def cut_metrics(path: Path, step: int) -> None:
    """Keep the rows of a resumed run's CSV log from before ``step``, the step under which the resumed run logs
    its first row (``Checkpoint.logged_step``, the counter the rows carry): rows at ``step`` and after come from
    batches the resumed run trains again."""
    if not path.is_file():
        return
    with open(path, newline="") as file:
        reader = csv.DictReader(file)
        fields = reader.fieldnames or []
        rows = [row for row in reader if not row.get("step") or int(float(row["step"])) < step]

    def write(tmp: Path) -> None:
        with open(tmp, "w", newline="") as file:
            writer = csv.DictWriter(file, fieldnames=fields)
            writer.writeheader()
            writer.writerows(rows)

    write_atomic(path, write)


def stale_temporaries(folder: Path, dirs: Sequence[Path] = ()) -> list[Path]:
    """Files a killed write left behind (``.<name>.<random>.tmp``) in the folder and its checkpoint folders
    (``checkpoint_dirs``)."""
    where = dict.fromkeys([folder, *checkpoint_dirs(folder, dirs)])
    return [p for d in where for p in d.glob(f".*{TMP_SUFFIX}") if p.is_file()]


def remove_stale_temporaries(folder: Path, dirs: Sequence[Path] = ()) -> None:
    for path in stale_temporaries(folder, dirs):
        say_once(f"Removing {path}, left by a write that did not finish")
        os.unlink(path)
