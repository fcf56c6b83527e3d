"""Arguments that document themselves: ``python -m mabn fit --model.help <task>`` (``--data.help <data module>``)
gives every argument of the class a line of help besides its type and default, read by jsonargparse from the
Google-style ``Args:`` sections of the docstrings (following ``**kwargs`` to the parent class's ``__init__``). So do
the settings of ``norm_policy`` (``--model.norm_policy.help``)."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re

import pytest

from helpers.commands import run_mabn
from mabn.callbacks import NormPolicy

TASKS = ["mabn.tasks.SegmentationTask", "mabn.tasks.ClassificationTask"]
DATA_MODULES = [
    "mabn.data.cityscapes.CityscapesDataModule",
    "mabn.data.folder.FolderDataModule",
    "mabn.data.imagenet.ImageFolderDataModule",
]

_OPTION_LINE = re.compile(r"^  (--\S+)")
# The part jsonargparse adds to every argument's help: ``(type: int, default: 19)``, ``(required, type: str)``.
_TYPE_PART = re.compile(r"\((required, )?type: .*\)\s*$", re.S)


def _import(path: str) -> type:
    module, name = path.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


def init_arguments(cls: type) -> list[str]:
    """The names of the arguments ``cls(...)`` takes: its ``__init__``'s, and where that passes ``**kwargs`` on,
    its parent classes' ``__init__``'s, as jsonargparse follows them."""
    names: list[str] = []
    for klass in cls.__mro__:
        if "__init__" not in vars(klass):
            continue
        params = list(inspect.signature(klass.__init__).parameters.values())[1:]  # without self
        names += [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if not any(p.kind == p.VAR_KEYWORD for p in params):
            break
    return names


def option_help(out: str) -> dict[str, str]:
    """The help text of each option of an argparse help ``out``, by option string: the text after the option
    strings and metavar, on their line (two spaces or more after them) and on the indented lines below."""
    entries: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in out.splitlines():
        match = _OPTION_LINE.match(line)
        if match:
            _, *rest = re.split(r"\s{2,}", line.strip(), maxsplit=1)
            current = entries.setdefault(match.group(1).rstrip(","), [])
            current.extend(rest)
        elif current is not None and line.startswith("    ") and line.strip():
            current.append(line.strip())
        else:
            current = None
    return {option: " ".join(text) for option, text in entries.items()}


def described(text: str) -> bool:
    """Whether an argument's help says something besides jsonargparse's ``(type: ..., default: ...)``."""
    return bool(re.search(r"\w", _TYPE_PART.sub("", text)))


def undocumented(out: str, prefix: str, names: list[str]) -> list[str]:
    """Of ``names``, the arguments whose ``--<prefix>.<name>`` has no help text in ``out`` (or is missing)."""
    helps = option_help(out)
    return [name for name in names if not described(helps.get(f"--{prefix}.{name}", ""))]


def _help(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    code, out, err = run_mabn(argv, capsys)
    assert code == 0, f"python -m mabn {' '.join(argv)} exited {code}: {err}"
    return out


@pytest.mark.parametrize(("group", "path"), [("model", p) for p in TASKS] + [("data", p) for p in DATA_MODULES])
def test_every_argument_has_help(capsys: pytest.CaptureFixture[str], group: str, path: str) -> None:
    names = init_arguments(_import(path))
    assert len(names) > 3, names  # the signature was read, with the parents' arguments where **kwargs passes them
    out = _help(capsys, ["fit", f"--{group}.help", path])
    missing = undocumented(out, group, names)
    assert not missing, f"--{group}.help {path}: no help text for {missing}:\n{out}"


def test_norm_policy_settings_have_help(capsys: pytest.CaptureFixture[str]) -> None:
    names = [f.name for f in dataclasses.fields(NormPolicy)]
    out = _help(capsys, ["fit", "--model.help", TASKS[0], "--model.norm_policy.help"])
    missing = undocumented(out, "model.norm_policy", names)
    assert not missing, f"--model.norm_policy.help: no help text for {missing}:\n{out}"


def test_the_check_sees_an_argument_without_help() -> None:
    out = (
        "options:\n"
        "  --model.num_classes NUM_CLASSES\n"
        "                        (type: int, default: 19)\n"
        "  --model.norm NORM     (type: str, default: mabn)\n"
        "  --model.base_lr BASE_LR\n"
        "                        the encoder's lr at base_batch_size. (type: float,\n"
        "                        default: 0.01)\n"
        "  --model.arch ARCH     the ResNet depth. (type: str, default: resnet101)\n"
        "  --data.data_dir DATA_DIR\n"
        "                        (required, type: str)\n"
    )
    names = ["num_classes", "norm", "base_lr", "arch", "compile"]
    assert undocumented(out, "model", names) == ["num_classes", "norm", "compile"]
    assert undocumented(out, "data", ["data_dir"]) == ["data_dir"]
