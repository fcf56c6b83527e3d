"""The LightningCLI's parser, and a refused argument as one line: the argument at fault, the closest known name,
and where to read the arguments."""

from __future__ import annotations

import difflib
import re
from typing import Any

from jsonargparse import ArgumentParser, DefaultHelpFormatter
from pytorch_lightning.cli import LightningArgumentParser

from ..compat import argument_error_text
from ..errors import UserError
from ..recipes import class_at
from ..tasks.losses import MOVED
from .help import PROG, PlainTextHelp

LOGGERS_HINT = (
    "the product's loggers: mabn.run.loggers.CSVLogger, mabn.run.loggers.WandbLogger, "
    "mabn.run.loggers.TensorBoardLogger; false for none"
)


class ArgumentMistake(UserError):
    """An argument the LightningCLI's parser refused: an unknown name or a value of the wrong type."""


class PlainHelpFormatter(PlainTextHelp, DefaultHelpFormatter):
    """jsonargparse's help (types, defaults) in plain text: the help of Lightning's and the tasks' arguments comes
    from their docstrings."""


class MabnArgumentParser(LightningArgumentParser):
    """The LightningCLI's parser, and the ones jsonargparse makes for a class's help (``--model.help``): named
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
