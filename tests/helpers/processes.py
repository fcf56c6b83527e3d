"""A product command run as a subprocess by the tests that kill or signal it mid-run, and waiting on it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]


def mabn_process(argv: list[str], cwd: Path, group: bool = False, **extra: str) -> subprocess.Popen:
    """``python -m mabn <argv>`` in ``cwd`` with the tests' helpers importable, wandb off, one thread and the
    environment ``extra``; ``group``: in a process group of its own (``os.killpg`` then reaches it and its
    loader workers, as SLURM's signal reaches a job)."""
    path = os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", **extra}
    return subprocess.Popen([sys.executable, "-m", "mabn", *argv], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=group)  # fmt: skip


def signalled_while_held(
    argv: list[str], cwd: Path, step: int, send: Callable[[subprocess.Popen], None], group: bool = False
) -> tuple[subprocess.Popen, str]:
    """Runs the tiny task's ``argv`` (tests/helpers/cli_tiny.py) until it holds at the end of ``step``, calls
    ``send`` with the process there, then lets it go on; the ended process and its stderr."""
    holding, release = cwd / "holding", cwd / "release"
    markers = {"TINY_HOLD_AT_STEP": str(step), "TINY_HOLDING_MARKER": str(holding), "TINY_RELEASE_MARKER": str(release)}
    proc = mabn_process(argv, cwd, group, **markers)
    try:
        wait_for(holding, proc)
        send(proc)
        time.sleep(0.5)  # the handler runs in the main thread, in the hold's sleep loop
        release.touch()
        _, err = proc.communicate(timeout=240)
    finally:
        release.touch()
        proc.kill()
    return proc, err


def wait_for(marker: Path, proc: subprocess.Popen, seconds: float = 240) -> None:
    """Until ``proc`` touches ``marker``; the test fails with its output if it ends first."""
    deadline = time.monotonic() + seconds
    while not marker.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the run did not reach its marker: {proc.communicate()[1][-3000:]}")
        time.sleep(0.1)
