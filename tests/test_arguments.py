"""Mistakes on the command line as one line: an unknown LightningCLI argument names itself, its closest known name
and the ``--help`` that lists the arguments; a value of the wrong type names the argument and the value, not
jsonargparse's internals; a stage launch passes both on. Every command of ``python -m mabn`` has a help in plain
text, and every user error of the product shares one base that the one-line handler knows."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mabn import errors
from mabn.__main__ import COMMANDS, main
from mabn.cli import lightning as cli
from mabn.cli.launch import LaunchError
from mabn.data.errors import DatasetError
from mabn.errors import ConfigError, UserError
from mabn.inference.export import ExportError
from mabn.models import BackboneError
from mabn.tools.plots import PlotError

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "configs" / "cityscapes.yaml")


def _python_m_mabn(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "disabled"}
    return subprocess.run(
        [sys.executable, "-m", "mabn", *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def _error(capsys, argv: list[str]) -> str:
    """The one stderr line of ``python -m mabn <argv>`` (in this process), which must exit with status 2."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


@pytest.mark.slow  # python -m mabn in a subprocess; the in-process cases below check the same lines
def test_a_misspelt_argument_is_one_line_with_the_close_match_and_the_help_to_read(tmp_path):
    run = _python_m_mabn("fit", "--config", CONFIG, "--trainer.max_epocs", "3", cwd=tmp_path)
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and 1 <= len(lines) <= 3, run.stderr
    assert lines[0].startswith("error: ") and "--trainer.max_epocs" in lines[0], lines
    assert "did you mean --trainer.max_epochs?" in run.stderr
    assert "python -m mabn fit --help" in run.stderr and "__main__.py" not in run.stderr
    assert not list(tmp_path.iterdir())  # refused before anything is built or written


@pytest.mark.parametrize(
    ("argument", "value", "line"),
    [
        ("--trainer.max_epochs", "abc", "--trainer.max_epochs: expected int or null, got 'abc'"),
        (
            "--model.init_args.norm_options",
            "3",
            "--model.init_args.norm_options: expected dict[str, dict[str, Any]] or null, got '3'",
        ),
        ("--model.init_args.base_lr", "fast", "--model.init_args.base_lr: expected float, got 'fast'"),
        (
            "--model.init_args.nrom",
            "gn",
            "unrecognized argument --model.init_args.nrom (did you mean --model.init_args.norm?)",
        ),
        (
            "--model.init_args.norm_policy.log_every_n_step",
            "5",
            "unrecognized argument --model.init_args.norm_policy.log_every_n_step "
            "(did you mean --model.init_args.norm_policy.log_every_n_steps?)",
        ),
        (
            "--data.init_args.batch_sise",
            "4",
            "unrecognized argument --data.init_args.batch_sise (did you mean --data.init_args.batch_size?)",
        ),
    ],
    ids=["int", "nested-type", "init-arg-type", "init-arg-name", "policy-name", "data-arg-name"],
)
def test_a_wrong_value_or_init_argument_names_the_argument_not_jsonargparse(
    argument, value, line, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    shown = _error(capsys, ["fit", "--config", CONFIG, argument, value])
    assert shown == f"error: {line}; python -m mabn fit --help lists the arguments"
    assert not list(tmp_path.iterdir())


def test_a_stage_launch_passes_the_argument_mistake_on_as_the_same_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    line = _error(capsys, ["cityscapes", "--dry-run", "--", "--trainer.max_epocs", "3"])
    assert line == (
        "error: unrecognized argument --trainer.max_epocs (did you mean --trainer.max_epochs?); "
        "python -m mabn fit --help lists the arguments"
    )
    assert not list(tmp_path.iterdir())  # no demo set, no run folder


def test_python_m_mabn_help_lists_every_command(capsys):
    """``python -m mabn --help`` in this process (the interpreter's start: the subprocess case above)."""
    assert main(["--help"]) == 0
    listed = {line.split()[0] for line in capsys.readouterr().out.splitlines() if line.startswith("  ")}
    assert listed == set(COMMANDS)


def test_every_command_has_a_plain_text_help_under_its_own_name(capsys):
    for name in COMMANDS:
        with pytest.raises(SystemExit) as exit_info:
            main([name, "--help"])
        assert exit_info.value.code == 0, name
        shown = capsys.readouterr().out
        assert shown.startswith(f"usage: python -m mabn {name}"), (name, shown[:80])
        assert "`" not in shown and ":class:" not in shown, name  # Lightning's and the tasks' docstrings
    assert main(["no-such-command"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: unknown command 'no-such-command'; python -m mabn --help lists the commands"
    ]


@pytest.mark.parametrize(
    "error", [ConfigError, DatasetError, LaunchError, BackboneError, ExportError, PlotError, cli.ArgumentMistake]
)
def test_every_user_error_is_one_line_by_its_base(error):
    class Unlisted(UserError):
        """A user error the handler has never heard of."""

    assert issubclass(error, UserError)
    assert errors.user_error(RuntimeError("a bug")) is None
    for raised in (error("the file at fault"), Unlisted("the file at fault")):
        wrapped = RuntimeError("jsonargparse's wrapper")
        wrapped.__cause__ = raised
        assert errors.user_error(wrapped) == "the file at fault"
