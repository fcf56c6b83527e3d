"""SIGTERM (``scancel``, SLURM's preemption, a plain ``kill``) saves ``checkpoints/last.ckpt`` at the end of the
training batch it arrived in, with no collective inside the signal handler, and the run exits with status 143;
``--resume auto`` goes on from that checkpoint (``mabn.run.LastCheckpoint``; docs/reliability.md). Two DDP
processes: tests/test_ddp_failures.py; the whole process group with loader workers: tests/test_last_checkpoint.py."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch

from helpers.processes import mabn_process, signalled_while_held
from mabn.run.requeue import TERMINATED_EXIT

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _tests_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "tests"))


@pytest.mark.slow  # two runs of the tiny task, each its own interpreter: ~20 s
def test_sigterm_saves_at_the_next_batch_and_resume_auto_goes_on_from_it(tmp_path):
    """The run holds at the end of step 5 and gets SIGTERM there: the checkpoint is that of step 6, the batch
    the signal arrived in, the exit status 143 with one line saying so; the same command with --resume auto
    resumes from it and ends at step 8."""
    from helpers.cli_tiny import CONFIG

    folder = tmp_path / "run"
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(CONFIG.format(root=str(folder)))
    command = ["fit", "--config", str(cfg), "--ckpt_path", "auto", "--trainer.max_epochs", "2"]
    first, err = signalled_while_held(command, tmp_path, 5, lambda proc: proc.send_signal(signal.SIGTERM))
    assert first.returncode == TERMINATED_EXIT, err[-3000:]
    last = folder / "checkpoints" / "last.ckpt"
    line = f"SIGTERM: checkpoint saved at step 6 in {last}; the run stops here, and --resume auto goes on from it"
    assert line in err.splitlines(), err[-3000:]
    print(line)  # what the user reads (docs/reliability.md)
    assert torch.load(last, weights_only=True)["global_step"] == 6

    second = mabn_process(command, tmp_path)
    out, err = second.communicate(timeout=240)
    assert second.returncode == 0, err[-3000:]
    assert f"{last} (epoch 1, step 6)" in out, out[-3000:]
    assert torch.load(folder / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 8
