"""A trained task rebuilt from its Lightning checkpoint: what ``export`` folds and ``test`` / ``predict`` run."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import Tensor

from ..callbacks import NormPolicy
from ..errors import ConfigError
from ..models import Undrawn, key_differences
from ..run import first_line, load_weights_file
from ..tasks import losses
from ..tasks.base import NormTask
from ..tasks.classification import ClassificationTask
from ..tasks.segmentation import SegmentationTask

# The tasks a checkpoint can come from, by class name.
TASKS: dict[str, type[NormTask]] = {"SegmentationTask": SegmentationTask, "ClassificationTask": ClassificationTask}


@dataclass(frozen=True)
class Restored:
    """A checkpoint's task in eval mode with the checkpoint's weights, and its data module's arguments."""

    name: str  # the task's class name, a key of TASKS
    task: NormTask
    data: dict[str, Any]  # the data module's hyperparameters (data_dir, crop_size, ...); empty when not saved


def task_name(path: Path, ckpt: dict[str, Any], error: type[Exception]) -> str:
    """The task that wrote ``ckpt``: LightningCLI records its class path; otherwise the model's keys tell."""
    class_path = ckpt["hyper_parameters"].get("_class_path")
    if class_path is not None:
        name = str(class_path).rsplit(".", 1)[-1]
        if name not in TASKS:
            raise error(f"{path} is a checkpoint of {class_path}, not of {' or '.join(TASKS)}")
        return name
    keys = ckpt["state_dict"].keys()
    if any(k.startswith(("model.ppm.", "model.classifier.")) for k in keys):  # PSPNet, or another decoder's
        return "SegmentationTask"
    if "model.fc.weight" in keys:
        return "ClassificationTask"
    raise error(f"{path} holds neither a PSPNet nor a ResNet under 'model.': not a checkpoint of {' or '.join(TASKS)}")


def _mismatch(expected: dict[str, Tensor], given: dict[str, Tensor]) -> str | None:
    """One line on how ``given`` fails to fit ``expected`` (missing, unexpected, mis-shaped keys), or None."""
    problems = []
    for what, keys in zip(("missing", "unexpected", "mis-shaped"), key_differences(expected, given)):
        if keys:
            problems.append(f"{len(keys)} {what} key(s) (e.g. {keys[0]})")
    return ", ".join(problems) or None


def task_hparams(hparams: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's ``hyper_parameters`` with the task's settings under the keys the task takes: a ``norm_policy``
    rule may name its first steps by older keys (``NormPolicy.from_checkpoint`` translates them), OHEM's options
    may be the task's arguments (``losses.from_checkpoint`` moves them into its ``loss``)."""
    out = losses.from_checkpoint(hparams)
    if out.get("norm_policy") is not None:
        out["norm_policy"] = NormPolicy.from_checkpoint(out["norm_policy"]).as_dict()
    return out


def load_task(path: str | Path, error: type[Exception] = ConfigError) -> Restored:
    """Rebuild the task of a Lightning checkpoint from its hyperparameters and load its weights; ``error`` with one
    line naming the file when it is missing, unreadable, of another task, or holds weights that do not fit.

    A stage-2 encoder is built without reading the fit's backbone file, a stage-1 network without its warm start's
    file: the checkpoint holds the trained weights.
    """
    path = Path(path)
    ckpt = load_weights_file(path, "checkpoint", error)
    if not isinstance(ckpt, dict) or not {"state_dict", "hyper_parameters"} <= ckpt.keys():
        raise error(f"{path} is not a Lightning checkpoint (expected 'state_dict' and 'hyper_parameters')")
    name = task_name(path, ckpt, error)
    # LightningCLI's bookkeeping keys start with "_"; everything else is an argument of the task.
    kwargs = {k: v for k, v in ckpt["hyper_parameters"].items() if not k.startswith("_")}
    if name == "SegmentationTask":
        kwargs["backbone"] = None
    if name == "ClassificationTask":
        kwargs["warm_start"] = None
    try:
        # The weights come next: no backbone to read, no initial values to draw.
        with warnings.catch_warnings(), Undrawn():
            warnings.filterwarnings("ignore", message="No backbone given")
            task = TASKS[name](**task_hparams(kwargs))
    except (TypeError, ValueError) as err:
        raise error(f"{path}: cannot rebuild {name} from its hyper_parameters: {first_line(err)}") from err
    state = {k.removeprefix("model."): v for k, v in ckpt["state_dict"].items() if k.startswith("model.")}
    problem = _mismatch(task.model.state_dict(), state)
    if problem is not None:
        raise error(f"{path} does not fit the {name} its hyper_parameters describe: {problem}")
    task.model.load_state_dict(state, strict=True)
    return Restored(name, task.eval(), dict(ckpt.get("datamodule_hyper_parameters") or {}))
