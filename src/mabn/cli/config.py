"""Reading a parsed LightningCLI configuration (jsonargparse ``Namespace``): its loggers and callbacks, its devices
and per-device batch, the run's checkpoint folders, and pointing its loggers and checkpoints into a run's folder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jsonargparse import Namespace

from ..errors import ConfigError
from ..recipes import class_at
from ..run import WandbLogger, per_device_batch
from ..run import folder as runs

CHECKPOINT_CALLBACK = "pytorch_lightning.callbacks.ModelCheckpoint"


def entries(value: Any) -> list[Namespace]:
    """A logger or callbacks entry of the config as a list of ``class_path``/``init_args`` namespaces."""
    items = value if isinstance(value, list) else [value]
    return [item for item in items if isinstance(item, Namespace) and "class_path" in item]


def init_args(config: Namespace, section: str) -> Namespace:
    """The ``init_args`` of the config's ``model`` or ``data`` (empty when it has none)."""
    entry = config.get(section)
    return (entry.get("init_args") if isinstance(entry, Namespace) else None) or Namespace()


def plain_args(entry: Namespace) -> dict[str, Any]:
    """A class's init arguments in ``entry`` as plain values, a nested class's (``norm_policy``) as one mapping."""
    return runs.plain((entry.get("init_args") or Namespace()).as_dict())


def devices(trainer: Namespace) -> int | None:
    """Processes of the run from the Trainer's devices and num_nodes; None when only Lightning can tell ("auto")."""
    given = trainer.get("devices")
    if isinstance(given, list | tuple):
        count = len(given)
    elif isinstance(given, int) or (isinstance(given, str) and given.isdigit()):
        count = int(given)
    else:
        return None
    return count * int(trainer.get("num_nodes") or 1) if count > 0 else None


def per_node(trainer: Namespace) -> int:
    """The processes of one node."""
    return max(1, (devices(trainer) or 1) // int(trainer.get("num_nodes") or 1))


def device_batch(config: Namespace) -> int | None:
    """The per-device batch: the data's ``batch_size``, or its share of ``global_batch_size`` over the devices
    (``mabn.run.scaling.per_device_batch``, as the data module takes it)."""
    data = init_args(config, "data")
    norm_batch = init_args(config, "model").get("norm_batch_size")
    return per_device_batch(
        data.get("batch_size"), data.get("global_batch_size"), devices(config.trainer) or 1, norm_batch
    )


def checkpoint_dirs(config: Namespace, folder: Path) -> list[Path]:
    """The folders the run's checkpoints go to (``mabn.run.folder.checkpoint_dirs``): each ModelCheckpoint's
    ``dirpath``, ``<folder>/checkpoints`` where it names none, spelt from ``folder``. A ``dirpath`` outside the run's
    folder is a ``ConfigError``: a resume, the check that a new run's folder is free and ``last.ckpt`` look for the
    run's checkpoints inside its folder."""
    dirs = []
    for callback in entries(config.trainer.get("callbacks")):
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
    for logger in entries(config.trainer.get("logger")):
        if "save_dir" in logger.init_args:
            logger.init_args.save_dir = str(folder)
    for callback in entries(config.trainer.get("callbacks")):
        if callback.class_path == CHECKPOINT_CALLBACK and not callback.init_args.get("dirpath"):
            callback.init_args.dirpath = str(folder / runs.CHECKPOINTS)


def name_wandb_runs(config: Namespace) -> None:
    """Give each ``WandbLogger`` of ``config`` what names, groups and tags its run (``mabn.run.loggers``): the
    task's ``norm`` and ``decoder``, and where no ``dataset`` is given, the name of the data's ``data_dir``; a
    value the logger's entry sets itself is kept."""
    model, data_dir = init_args(config, "model"), init_args(config, "data").get("data_dir")
    facts = {"norm": model.get("norm"), "decoder": model.get("decoder")}
    facts["dataset"] = Path(str(data_dir)).name if data_dir else None
    for logger in entries(config.trainer.get("logger")):
        if issubclass(class_at(logger.class_path), WandbLogger):
            for key, value in facts.items():
                if logger.init_args.get(key) is None and isinstance(value, str):
                    logger.init_args[key] = value
