"""Without a terminal (SLURM's ``.out`` file, CI, a pipe) ``python -m mabn fit`` prints one progress line every N
steps instead of redrawing a progress bar (``mabn.run.LineProgress``); on a terminal Lightning's bar stays,
and ``--trainer.enable_progress_bar false`` silences both."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import pytorch_lightning as pl
from pytorch_lightning.callbacks import TQDMProgressBar

from helpers.cli_tiny import CONFIG
from mabn.run import LineProgress, progress, use_line_progress

TESTS = Path(__file__).parent
LINE = re.compile(
    r"step (\d+)/(\d+) \(epoch \d+\) \| loss \d+\.\d{4} \| lr \d\.\d\de[-+]\d\d \| [\d.e+-]+ s/step"
    r" \| ETA \d+:\d\d:\d\d"
)


def _fit(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    """``python -m mabn fit`` of the tiny task (4 steps an epoch) in a subprocess, its stdout and stderr pipes."""
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(CONFIG.format(root=tmp_path / "run"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    env["WANDB_MODE"] = "disabled"
    cmd = [sys.executable, "-m", "mabn", "fit", "--config", str(cfg), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)


@pytest.mark.slow  # a fit in a subprocess
def test_without_a_terminal_lines_replace_the_bar(tmp_path):
    result = _fit(
        tmp_path, "--trainer.enable_progress_bar", "true", "--trainer.max_steps", "100", "--trainer.max_epochs", "-1"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert all(LINE.fullmatch(line) is not None for line in lines), lines
    # About 20 lines a run of known length (PROGRESS_LINES): every 5 of the 100 steps.
    assert [LINE.fullmatch(line).group(1, 2) for line in lines] == [(str(step), "100") for step in range(5, 101, 5)]
    assert lines[-1].endswith("ETA 0:00:00")
    validations = [line for line in out.splitlines() if line.startswith("validation at step ")]
    assert len(validations) == 25 and re.fullmatch(r"validation at step 4: val/acc \d\.\d{4}", validations[0])
    assert "\r" not in out + result.stderr  # no redrawn bar in either stream
    assert "it/s]" not in result.stderr


@pytest.mark.slow  # a second fit in a process of its own; the lines themselves are the test above's
def test_enable_progress_bar_false_silences_the_lines(tmp_path):
    result = _fit(
        tmp_path, "--trainer.enable_progress_bar", "false", "--trainer.max_steps", "50", "--trainer.max_epochs", "-1"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert not [line for line in result.stdout.splitlines() if line.startswith(("step ", "validation at"))]


def test_a_terminal_keeps_lightnings_bar(monkeypatch, tmp_path):
    def trainer() -> pl.Trainer:
        return pl.Trainer(default_root_dir=tmp_path, logger=False, enable_checkpointing=False)

    monkeypatch.setattr(progress, "is_terminal", lambda: True)
    on_terminal = trainer()
    bar = on_terminal.progress_bar_callback
    use_line_progress(on_terminal)
    assert on_terminal.progress_bar_callback is bar

    monkeypatch.setattr(progress, "is_terminal", lambda: False)
    in_a_file = trainer()
    use_line_progress(in_a_file, every_n_steps=7)
    assert isinstance(in_a_file.progress_bar_callback, LineProgress)
    assert in_a_file.progress_bar_callback.every_n_steps == 7
    assert not any(isinstance(c, TQDMProgressBar) for c in in_a_file.callbacks)
