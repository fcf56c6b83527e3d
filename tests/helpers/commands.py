"""Commands run as a user runs them, in this process: ``python -m mabn <argv>`` through its one entry point."""

from __future__ import annotations

import pytest


def run_mabn(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of ``python -m mabn <argv>``: what ``mabn.__main__.main`` returns, or the
    status it exits with (a user mistake: 2, with its one ``error:`` line)."""
    from mabn.__main__ import main

    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as exit_info:
        code = exit_info.code
    out = capsys.readouterr()
    return code, out.out, out.err
