"""An offline wandb run read back through wandb's own reader of its transaction log (``run-<id>.wandb``).

The installed wandb has no Python reader of that file: records are written and read by its ``wandb-core``
binary, whose reader the CLI exposes as ``wandb leet inspect --json <run dir>`` (one JSON object per
record, ``{"type": "history", "history": {"item": {...}}}`` for each ``log`` call). Decoding the records
by hand instead would mean re-implementing the file's block framing, which is no wandb API.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def wandb_session(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    """Run this test's wandb in ``mode`` (offline, disabled) with its settings under the test's folder.

    wandb reads its environment once per process, at the first run, and ignores later changes until
    ``wandb.teardown()``: the session is restarted here, and again after the test so that the next one
    starts from the suite's default (conftest: disabled).
    """
    monkeypatch.setenv("WANDB_MODE", mode)
    monkeypatch.setenv("HOME", str(request.getfixturevalue("tmp_path")))  # settings and caches stay there
    _end_session()
    request.addfinalizer(_end_session)


def _end_session() -> None:
    import wandb

    if wandb.run is not None:  # a disabled run is not ended by teardown, and a new WandbLogger would reuse it
        wandb.run.finish()
    wandb.teardown()


def history(run_dir: Path) -> list[dict]:
    """The logged rows of an offline run, in logging order."""
    env = {**os.environ, "WANDB_MODE": "offline"}  # offline: the reader must not reach for the network
    cmd = [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_dir)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, f"`wandb leet inspect` failed on {run_dir}: {result.stderr}"
    records = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
    assert records and records[0]["type"] == "header", f"no transaction log records read from {run_dir}"
    return [r["history"]["item"] for r in records if r["type"] == "history"]


def offline_run(save_dir: Path) -> Path:
    """The one offline run folder a WandbLogger with ``save_dir`` wrote."""
    runs = list((save_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, f"expected one offline run under {save_dir / 'wandb'}, found {runs}"
    return runs[0]
