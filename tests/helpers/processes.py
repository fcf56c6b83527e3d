"""Waiting on a product command run as a subprocess by the tests that kill or signal it mid-run."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest


def wait_for(marker: Path, proc: subprocess.Popen, seconds: float = 240) -> None:
    """Until ``proc`` touches ``marker``; the test fails with its output if it ends first."""
    deadline = time.monotonic() + seconds
    while not marker.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the run did not reach its marker: {proc.communicate()[1][-3000:]}")
        time.sleep(0.1)
