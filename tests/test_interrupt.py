"""Ctrl-C in a terminal sends SIGINT to the whole foreground process group, the loader workers included: the main
process alone acts on it (the workers ignore it, ``mabn.data.loading.start_worker``), so a fit with loader workers
ends in one line that says where its state is, and ``--resume auto`` goes on from there."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import mabn
from helpers.own_dataset import bands
from helpers.processes import mabn_process, wait_for

SRC = Path(mabn.__file__).resolve().parents[1]  # the package these tests import, whichever checkout it is


@pytest.mark.slow  # an interpreter that imports torch and starts two workers: ~5 s
def test_loader_workers_leave_sigint_to_the_main_process(tmp_path):
    """SIGINT to the process group of a process reading a product loader with two workers: the main process
    handles it (here: notes it) and reads on; the workers are still there to serve it."""
    script = textwrap.dedent(
        """
        import os, signal, torch
        from torch.utils.data import TensorDataset
        from mabn.data.loading import make_loader

        signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal, whoever started this
        got = []
        loader = make_loader(TensorDataset(torch.arange(64.0)), 4, train=True, num_workers=2)
        for epoch in range(2):
            for i, _ in enumerate(loader):
                if epoch == 0 and i == 1:  # the workers run, with Python's SIGINT handler as a fit has it
                    signal.signal(signal.SIGINT, lambda *_: got.append(1))
                    os.killpg(os.getpgrp(), signal.SIGINT)
        del loader  # its persistent workers end with it
        print("read", len(got))
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120,
                          start_new_session=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["read", "1"]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.slow  # two short segment fits on the CPU with two loader workers each: ~40 s
def test_ctrl_c_to_a_fit_with_loader_workers_is_one_line_and_resume_auto_goes_on(tmp_path):
    """A ``segment`` fit with two loader workers in its own process group, SIGINT to the group (what Ctrl-C in a
    terminal does) once it has logged a training row: exit status 1, no traceback, one line saying where the
    state is; the same command with ``--resume auto`` takes the remaining steps from that step."""
    data = bands(tmp_path / "data", train=16)
    run = tmp_path / "run"
    argv = ["segment", "--data", str(data), "--norm", "mabn", "--backbone", "none", "--run-dir", str(run)]
    extra = [
        "--", "--data.init_args.global_batch_size", "4", "--data.init_args.num_workers", "2",
        "--data.init_args.crop_size", "64", "--model.init_args.arch", "resnet18", "--trainer.max_steps", "200",
        "--trainer.log_every_n_steps", "1", "--trainer.logger", "mabn.run.loggers.CSVLogger",
        "--trainer.logger.save_dir", str(run), "--trainer.enable_progress_bar", "false",
    ]  # fmt: skip
    # A process that a shell started in the background ignores SIGINT, and so would the fit it starts: the fit
    # starts with SIGINT's default, as in a terminal (a Python handler is reset to it across exec, SIG_IGN is not).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = mabn_process([*argv, *extra], tmp_path, group=True)
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        wait_for(run / "metrics.csv", proc)
        time.sleep(1.0)  # in the middle of a step, with batches in flight
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 1, err[-3000:]
    assert "Traceback" not in err and "exited unexpectedly" not in err, err[-3000:]
    said = [line for line in out.splitlines() + err.splitlines() if "KeyboardInterrupt" in line]
    stop = [line for line in said if line.startswith("KeyboardInterrupt at step")]
    assert len(stop) == 1, out[-3000:]
    step = int(re.match(r"KeyboardInterrupt at step (\d+): state saved in (\S+);", stop[0]).group(1))
    assert 0 < step < 200
    assert re.fullmatch(rf"KeyboardInterrupt at step {step}: state saved in \S+last\.ckpt; --resume auto goes on "
                        "from it", stop[0])  # fmt: skip

    extra[extra.index("--trainer.max_steps") + 1] = str(step + 2)
    resumed = mabn_process([*argv, "--resume", "auto", *extra], tmp_path)
    out, err = resumed.communicate(timeout=240)
    assert resumed.returncode == 0, err[-3000:]
    assert f"step {step})" in out, out[-3000:]
