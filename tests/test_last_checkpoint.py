"""``checkpoints/last.ckpt`` is the run's latest state at every end of a fit (``mabn.run.LastCheckpoint``), whether
or not the last validation improved; ``--resume auto`` takes the highest step; SIGTERM on an epoch's last batch
keeps that epoch's validation; a SIGTERM sent to the whole process group, loader workers included (as SLURM
does), saves and exits 143. The tiny task of tests/helpers/cli_tiny.py, whose score worsens at every validation,
so ModelCheckpoint saves a top-k file at the first validation only."""

from __future__ import annotations

import csv
import logging
import os
import shutil
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from helpers.commands import run_mabn
from helpers.processes import mabn_process, signalled_while_held
from helpers.wandb_reader import wandb_session
from mabn.run import folder as runs
from mabn.run.requeue import TERMINATED_EXIT

ROOT = Path(__file__).resolve().parents[1]
WORSENING = "helpers.cli_tiny.WorseningTask"  # 4 batches an epoch, a validation at the end of each


@pytest.fixture(autouse=True)
def _tests_importable(monkeypatch, request):
    monkeypatch.syspath_prepend(str(ROOT / "tests"))
    wandb_session(request, monkeypatch, "disabled")


def _config(tmp_path: Path, root: Path) -> Path:
    from helpers.cli_tiny import CONFIG

    cfg = tmp_path / f"cfg-{root.name}.yaml"
    cfg.write_text(CONFIG.format(root=root).replace("helpers.cli_tiny.TinyTask", WORSENING))
    return cfg


def _stop_at(step: int, how: str) -> list[str]:
    return ["--trainer.callbacks+", f"{{class_path: helpers.cli_tiny.StopAt, init_args: {{step: {step}, how: {how}}}}}"]


def _fit(cfg: Path, capsys, *extra: str) -> tuple[int | str | None, str, str]:
    try:
        return run_mabn(["fit", "--config", str(cfg), *extra], capsys)
    except RuntimeError as err:  # the run's own error, as a user's traceback ends
        out = capsys.readouterr()
        return f"{type(err).__name__}: {err}", out.out, out.err


def _step(path: Path) -> int:
    return torch.load(path, weights_only=True, map_location="cpu")["global_step"]


def _rows(folder: Path) -> list[tuple[str, str, tuple[str, ...]]]:
    """Each row of metrics.csv as (epoch, step, the metrics it holds): what a resumed run must reproduce."""
    with open(folder / runs.METRICS, newline="") as file:
        return [
            (row["epoch"], row["step"], tuple(sorted(k for k, v in row.items() if v and k not in ("epoch", "step"))))
            for row in csv.DictReader(file)
        ]


@pytest.mark.parametrize(
    ("end", "extra", "code", "step"),
    [
        ("max_epochs", ["--trainer.max_epochs", "3"], 0, 12),
        ("max_steps", ["--trainer.max_steps", "10"], 0, 10),  # mid-epoch: no validation at the end
        ("an exception at step 6", _stop_at(6, "raise"), "RuntimeError: stopped at step 6", 6),
        ("Ctrl-C at step 6", _stop_at(6, "interrupt"), 1, 6),
        ("SIGTERM in step 7", _stop_at(6, "sigterm"), TERMINATED_EXIT, 7),
        ("SIGHUP in step 7", _stop_at(6, "sighup"), 128 + signal.SIGHUP, 7),  # a dropped ssh session
        ("SIGUSR1 in step 7", _stop_at(6, "sigusr1"), 128 + signal.SIGUSR1, 7),  # outside SLURM's requeue
    ],
)
def test_last_ckpt_is_the_last_step_taken_however_the_fit_ends(tmp_path, capsys, caplog, end, extra, code, step):
    folder = tmp_path / "run"
    caplog.set_level(logging.INFO)
    result, out, err = _fit(_config(tmp_path, folder), capsys, "--trainer.max_epochs", "3", *extra)
    assert result == code, err[-3000:]
    assert _step(folder / runs.CHECKPOINTS / runs.LAST) == step, end
    assert sorted(p.name for p in (folder / runs.CHECKPOINTS).iterdir())[:2] == ["last.ckpt", "step=4.ckpt"]
    if end.startswith("SIG"):
        line = f"{end.split()[0]}: checkpoint saved at step 7 in {folder / 'checkpoints' / 'last.ckpt'}; the run stops"
        assert line in err, err[-3000:]
    assert "`weights_only` was not set" not in out + err + caplog.text  # Lightning's notice at every save


def test_sigterm_on_an_epochs_last_batch_keeps_its_validation_and_resume_auto_takes_the_highest_step(tmp_path, capsys):
    """SIGTERM in batch 4 of 4: the run validates epoch 0 before it stops, so after ``--resume auto`` metrics.csv
    holds the rows of an uninterrupted run, none lost, none twice. Then the folder is copied (every file gets a
    new time, the oldest checkpoint the newest time): ``--resume auto`` still goes on from the highest step."""
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    assert _fit(_config(tmp_path, whole), capsys, "--trainer.max_epochs", "2")[0] == 0
    cfg = _config(tmp_path, cut)
    code, _, err = _fit(cfg, capsys, "--trainer.max_epochs", "2", *_stop_at(3, "sigterm"))
    assert code == TERMINATED_EXIT, err[-3000:]
    assert _step(cut / runs.CHECKPOINTS / runs.LAST) == 4
    assert any(row[2] == ("val/acc",) for row in _rows(cut)), "epoch 0's validation before the stop"
    code, out, err = _fit(cfg, capsys, "--trainer.max_epochs", "2", "--ckpt_path", "auto")
    assert code == 0, err[-3000:]
    assert f"Resuming from {cut / runs.CHECKPOINTS / runs.LAST} (epoch 0, step 4)." in out
    assert _rows(cut) == _rows(whole)

    copy = tmp_path / "copy"
    shutil.copytree(cut, copy, symlinks=True, copy_function=shutil.copy)  # as cp -r: new times
    later = time.time() + 60
    os.utime(copy / runs.CHECKPOINTS / "step=4.ckpt", (later, later))
    cfg = _config(tmp_path, copy)
    code, out, err = _fit(cfg, capsys, "--trainer.max_epochs", "3", "--ckpt_path", "auto")
    assert code == 0, err[-3000:]
    assert f"Resuming from {copy / runs.CHECKPOINTS / runs.LAST} (epoch 1, step 8)." in out


def _save(path: Path, step: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"global_step": step, "epoch": 0, "state_dict": {}, "hyper_parameters": {"norm": "bn"}}, path)
    return path


def test_resume_auto_takes_the_highest_step_and_last_ckpt_of_equal_steps(tmp_path):
    identity = runs.Identity("x.Task", "bn")
    last = _save(tmp_path / runs.CHECKPOINTS / runs.LAST, 8)
    _save(tmp_path / "hpc_ckpt_1.ckpt", 7)  # newer file, lower step
    assert runs.newest_checkpoint(tmp_path, identity, print).path == last
    _save(tmp_path / "hpc_ckpt_2.ckpt", 8)  # newer file, the same step
    assert runs.newest_checkpoint(tmp_path, identity, print).path == last
    hpc = _save(tmp_path / "hpc_ckpt_3.ckpt", 9)
    assert runs.newest_checkpoint(tmp_path, identity, print).path == hpc


@pytest.mark.slow  # three runs of the tiny task, each its own interpreter with two loader workers: ~40 s
def test_sigterm_to_the_whole_process_group_with_loader_workers_saves_and_resumes_without_losing_rows(tmp_path):
    """As SLURM ends a job: SIGTERM to every process of the group, the training process and its two loader
    workers, while the run holds after step 2. It saves at the end of step 3, says so in one line, exits 143
    without a traceback; the same command with ``--resume auto`` takes the remaining steps and metrics.csv
    equals an uninterrupted run's row for row."""
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    workers = ["--data.init_args.num_workers", "2", "--trainer.max_epochs", "2"]
    uninterrupted = mabn_process(["fit", "--config", str(_config(tmp_path, whole)), *workers], tmp_path)
    assert uninterrupted.wait(timeout=240) == 0, uninterrupted.communicate()[1][-3000:]

    command = ["fit", "--config", str(_config(tmp_path, cut)), *workers, "--ckpt_path", "auto"]
    # the session's group: the run and its loader workers
    first, err = signalled_while_held(
        command, tmp_path, 2, lambda proc: os.killpg(proc.pid, signal.SIGTERM), group=True
    )
    assert first.returncode == TERMINATED_EXIT, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert [line for line in err.splitlines() if line.startswith("SIGTERM")] == [
        f"SIGTERM: checkpoint saved at step 3 in {cut / 'checkpoints' / 'last.ckpt'}; the run stops here, and "
        "--resume auto goes on from it"
    ]
    assert _step(cut / runs.CHECKPOINTS / runs.LAST) == 3

    second = mabn_process(command, tmp_path)
    out, err = second.communicate(timeout=240)
    assert second.returncode == 0, err[-3000:]
    assert "(epoch 0, step 3)" in out, out[-3000:]
    assert _step(cut / runs.CHECKPOINTS / runs.LAST) == 8
    assert _rows(cut) == _rows(whole)


def test_the_timer_saves_at_the_first_batch_end_after_every_minutes(monkeypatch, tmp_path):
    """Besides validations, ``last.ckpt`` is written at the end of the first training batch once ``every_minutes``
    of training have passed since the last save, and not before."""
    import mabn.run.last as last_module

    now = [0.0]
    monkeypatch.setattr(last_module.time, "monotonic", lambda: now[0])
    saved: list[int] = []
    trainer = SimpleNamespace(
        loggers=[], global_step=0, num_training_batches=100, is_global_zero=True,
        save_checkpoint=lambda path, weights_only: saved.append(trainer.global_step),
    )  # fmt: skip
    callback = last_module.LastCheckpoint(every_minutes=30)
    callback.dirpath = tmp_path
    callback.on_train_start(trainer, None)
    module = SimpleNamespace(device=torch.device("cpu"))
    for step, minutes in [(1, 10), (2, 29.9), (3, 30), (4, 31), (5, 59.9), (6, 60.5)]:
        now[0], trainer.global_step = 60 * minutes, step
        callback.on_train_batch_end(trainer, module, None, None, step - 1)
    assert saved == [3, 6]
    with pytest.raises(ValueError, match="every_minutes"):
        last_module.LastCheckpoint(every_minutes=float("inf"))
