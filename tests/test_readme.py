"""The README's commands exist as written: every ``make`` target and variable in its fenced blocks and tables is
one the Makefile defines, and every ``python -m mabn`` command is one the entry point knows."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
MAKEFILE = (ROOT / "Makefile").read_text()


def _targets() -> set[str]:
    return set(re.findall(r"^([a-z][\w-]*):", MAKEFILE, flags=re.M))


def _variables() -> set[str]:
    return set(re.findall(r"^([A-Z_]+)\s*\?=", MAKEFILE, flags=re.M))


def _make_calls() -> list[str]:
    """Every ``make ...`` the README shows: lines of its code blocks and the code spans of its text."""
    blocks = re.findall(r"```(?:bash|text)?\n(.*?)```", README, flags=re.S)
    lines = [line.lstrip("$ ") for block in blocks for line in block.splitlines()]
    spans = re.findall(r"`(make [^`]+)`", README)
    return [line.split("#")[0].strip() for line in lines + spans if line.lstrip("$ ").startswith("make ")]


def test_every_make_target_and_variable_in_the_readme_exists():
    calls = _make_calls()
    assert len(calls) >= 8  # the set-up, the main job and the targets table
    targets, variables = _targets(), _variables()
    for call in calls:
        for word in re.sub(r"<[^>]*>", "VALUE", call).split()[1:]:  # <placeholders> may hold spaces
            if "=" in word:
                assert word.split("=")[0] in variables, (call, word)
            else:
                assert word in targets, (call, word)


def test_every_python_m_mabn_command_in_the_readme_exists():
    from mabn.__main__ import COMMANDS

    commands = re.findall(r"python -m mabn ([a-z][\w-]*)", README)
    assert commands
    for command in commands:
        assert command in COMMANDS, command
