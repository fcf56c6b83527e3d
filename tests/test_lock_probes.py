"""The run lock's refusals through ``python -m mabn fit``: a ``.lock`` that is not a regular file of one name (a
folder, a hard link) and a ``MABN_LOCK_LEASE_S`` that is not a number of seconds (``inf`` would hold a requeued
job for ever) each stop the run with exit code 2 and one ``error:`` line before anything is written
(``mabn.run.lock``). The lock's other cases, the symbolic link among them, are in tests/test_shared_cluster.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from helpers.cli_tiny import CONFIG
from helpers.commands import run_mabn
from helpers.wandb_reader import wandb_session
from mabn.run import lock as runlock


@pytest.fixture
def fit(tmp_path, request, monkeypatch, capsys):
    """``python -m mabn fit`` of tests/helpers/cli_tiny.py's seconds-long task into ``runs/x`` (the working folder
    is ``tmp_path``), run in this process: (exit code, the lines of stderr)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)  # a first start, unless a test says otherwise
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(CONFIG.format(root="runs/x"))

    def run() -> tuple[int, list[str]]:
        wandb_session(request, monkeypatch, "disabled")
        code, _, err = run_mabn(["fit", "--config", str(cfg), "--trainer.max_steps", "2"], capsys)
        return code, err.strip().splitlines()

    return run


@pytest.mark.parametrize(
    ("make", "kind"),
    [(Path.mkdir, "a folder"), (os.mkfifo, "a named pipe")],
    ids=["folder", "named-pipe"],
)
def test_a_lock_that_is_not_a_file_is_one_line(tmp_path, fit, make, kind):
    folder = tmp_path / "runs" / "x"
    folder.mkdir(parents=True)
    make(folder / runlock.LOCK_FILE)
    assert fit() == (2, [f"error: runs/x/{runlock.LOCK_FILE} is not a regular file ({kind}); remove it"])
    assert sorted(p.name for p in folder.iterdir()) == [runlock.LOCK_FILE]


def test_a_hard_linked_lock_is_one_line_and_the_linked_file_keeps_its_bytes(tmp_path, fit):
    """The holder's record would be written into the file of the other name: it is refused before the lock."""
    victim = tmp_path / "precious.txt"
    victim.write_bytes(b"keep me\n")
    folder = tmp_path / "runs" / "x"
    folder.mkdir(parents=True)
    os.link(victim, folder / runlock.LOCK_FILE)
    assert fit() == (2, [f"error: runs/x/{runlock.LOCK_FILE} is not a regular file (a hard link: 2 names); remove it"])
    assert victim.read_bytes() == b"keep me\n"
    assert sorted(p.name for p in folder.iterdir()) == [runlock.LOCK_FILE]


@pytest.mark.parametrize("value", ["inf", "nan", "-1", "soon", "3601"])
@pytest.mark.parametrize("restarts", ["0", "1"], ids=["first-start", "requeued"])
def test_a_lease_that_is_not_seconds_is_one_line_at_any_start(tmp_path, fit, monkeypatch, value, restarts):
    """Checked at a first start as well, where the lease is not used: the user sees a wrong value while
    watching, not after a requeue at night."""
    monkeypatch.setenv("SLURM_RESTART_COUNT", restarts)
    monkeypatch.setenv(runlock.LEASE_ENV, value)
    assert fit() == (2, [f"error: {runlock.LEASE_ENV}={value!r} is not a number of seconds from 0 to 3600"])
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(("value", "seconds"), [("0", 0.0), ("90", 90.0), ("3600", 3600.0), ("", 120.0)])
def test_a_lease_of_seconds_is_read(monkeypatch, value, seconds):
    monkeypatch.setenv(runlock.LEASE_ENV, value)
    assert runlock.lease_s() == seconds
