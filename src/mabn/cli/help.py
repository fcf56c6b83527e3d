"""What the parsers of ``python -m mabn <command>`` share: the program's name, help in plain text, a user mistake
as one ``error:`` line."""

from __future__ import annotations

import argparse
import re
import sys

from ..compat import HelpTextFormatter

PROG = "python -m mabn"

_ROLE = re.compile(r":[a-z]+:`~?([^`]+)`")  # :class:`x`, :func:`~a.b` (Sphinx roles)
_LITERAL = re.compile(r"``(.+?)``", re.S)
_LINK = re.compile(r"`([^`<]+?)\s*<([^>`]+)>`_+")  # `text <url>`_
_INTERPRETED = re.compile(r"`([^`]+)`_?")  # `x`, and the reference `x`_


def plain_text(text: str) -> str:
    """``text`` (a docstring) without reStructuredText markup: ``x``, `x` and :class:`x` as x, a link as its text
    and address."""
    for pattern, plain in ((_ROLE, r"\1"), (_LITERAL, r"\1"), (_LINK, r"\1 (\2)"), (_INTERPRETED, r"\1")):
        text = pattern.sub(plain, text)
    return text


class PlainTextHelp(HelpTextFormatter):
    """Descriptions and argument help as plain text: most come from docstrings, written in reStructuredText."""

    def help_text(self, text: str) -> str:
        return plain_text(text)


class HelpFormatter(PlainTextHelp, argparse.RawDescriptionHelpFormatter):
    """The commands' help: plain text, descriptions as their lines are written."""


def command_parser(command: str, description: str | None) -> argparse.ArgumentParser:
    """The argparse parser of ``python -m mabn <command>``."""
    return argparse.ArgumentParser(prog=f"{PROG} {command}", description=description, formatter_class=HelpFormatter)


def positive(text: str) -> int:
    """An argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def fail(message: str) -> int:
    """Print a user mistake as one ``error:`` line; the exit status to return."""
    print(f"error: {message}", file=sys.stderr)
    return 2
