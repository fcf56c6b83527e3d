"""A shared cluster: one run per experiment folder at a time (``mabn.run.lock``), the operating system refusing a
write (a full disk, a quota, a read-only folder: ``mabn.errors.WriteError``), CUDA out of memory in a training
step (``mabn.run.OutOfMemoryReport``). Each ends with exit code 2 and one ``error:`` line, and loses
nothing: ``--ckpt_path auto`` (``--resume auto``) continues from the newest whole checkpoint.

The runs are tests/helpers/cli_tiny.py's seconds-long task, and a tiny PSPNet / ResNet-18 for the out-of-memory lines;
a run that must hold its folder while the test acts is a process of its own, the others run in this process.
"""

from __future__ import annotations

import csv
import errno
import fcntl
import io
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers.commands import run_mabn
from helpers.processes import wait_for
from helpers.trainer import QUIET, flags
from helpers.wandb_reader import wandb_session
from mabn import errors
from mabn.cli import lightning as cli
from mabn.data.synthetic import cityscapes as demo_cityscapes
from mabn.data.synthetic import imagenet as demo_imagenet
from mabn.errors import WriteError
from mabn.run import folder as runs
from mabn.run import lock as runlock
from mabn.run.files import write_atomic, write_text_atomic
from mabn.run.oom import training_oom_line

ROOT = Path(__file__).resolve().parents[1]
IN_USE = (
    "error: {folder} is in use by another run (host {host}, pid {pid}, started {started}): wait for it to end, or "
    "pick another folder with --run-dir (--trainer.default_root_dir)"
)


@pytest.fixture(autouse=True)
def _tests_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "tests"))


def _env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", **extra}


def _config(tmp_path: Path, root: str, plugin: str | None = None) -> Path:
    from helpers.cli_tiny import CONFIG

    text = CONFIG.format(root=root)
    if plugin:
        text = text.replace("trainer:\n", f"trainer:\n  plugins:\n    - class_path: {plugin}\n", 1)
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(text)
    return cfg


def _fit(cfg: Path, *extra: str) -> list[str]:
    """``python -m mabn fit`` of the tiny task, as its arguments after ``python -m mabn``."""
    return ["fit", "--config", str(cfg), *extra]


def _process(argv: list[str], cwd: Path, **env: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "mabn", *argv], cwd=cwd, env=_env(**env), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip


def _here(argv: list[str], request, monkeypatch, capsys) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``python -m mabn <argv>`` run in this process."""
    wandb_session(request, monkeypatch, "disabled")
    return run_mabn(argv, capsys)


def _error_line(err: str) -> str:
    """The one ``error:`` line, checked to be the last line of the output and the only one."""
    lines = err.strip().splitlines()
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0] == lines[-1], lines[-15:]
    print(errors[0])  # what the user reads (docs/reliability.md)
    return errors[0]


def _holder_fields(folder: Path) -> dict[str, str]:
    import json

    return json.loads((folder / runlock.LOCK_FILE).read_text())


def _step(path: Path) -> int:
    return torch.load(path, weights_only=True)["global_step"]


# ------------------------------------------------------------------------------ one run per folder
@pytest.mark.slow  # two interpreters importing torch and Lightning side by side on 2 cores: ~25 s
def test_two_runs_started_together_on_one_folder_one_trains_and_the_other_stops_naming_it(tmp_path):
    """Both start at once. The one that locks the folder waits at step 1 until the other has ended, so the other
    cannot come after a finished run (it would then stop with "already holds a run")."""
    folder = "runs/x"
    cfg = _config(tmp_path, folder)
    release = tmp_path / "release"
    markers = {"TINY_HOLD_AT_STEP": "1", "TINY_HOLDING_MARKER": str(tmp_path / "holding"),
               "TINY_RELEASE_MARKER": str(release)}  # fmt: skip
    procs = [_process(_fit(cfg, "--trainer.max_epochs", "1"), tmp_path, **markers) for _ in range(2)]
    try:
        deadline = time.monotonic() + 240
        while all(p.poll() is None for p in procs):
            assert time.monotonic() < deadline, "neither run ended"
            time.sleep(0.1)
        refused = next(p for p in procs if p.poll() is not None)
        trained = next(p for p in procs if p is not refused)
        refused_err = refused.communicate()[1]
        assert refused.returncode == 2, refused_err[-3000:]
        release.touch()
        err = trained.communicate(timeout=240)[1]
        assert trained.returncode == 0, err[-3000:]
    finally:
        release.touch()
        for p in procs:
            p.kill()
    record = _holder_fields(tmp_path / folder)
    assert record["pid"] == trained.pid
    expected = IN_USE.format(folder=folder, host=socket.gethostname(), pid=trained.pid, started=record["started"])
    assert _error_line(refused_err) == expected
    # One run's files: no last-v1.ckpt beside last.ckpt, each training step logged once.
    checkpoints = sorted(p.name for p in (tmp_path / folder / "checkpoints").iterdir())
    assert checkpoints == ["last.ckpt", "step=4.ckpt"]
    with open(tmp_path / folder / "metrics.csv", newline="") as file:
        steps = [row["step"] for row in csv.DictReader(file) if row.get("train/loss")]
    assert steps == ["0", "1", "2", "3"]


@pytest.mark.slow  # two runs in subprocesses, one killed
def test_a_run_killed_while_it_holds_its_folder_is_resumed_without_clean_up(tmp_path, request, monkeypatch, capsys):
    """A run holds its folder at step 5 (after the step-4 checkpoint): a second run of the same command stops,
    naming it, and a dry run says so without writing anything. Then it is killed with SIGKILL, and the same
    command resumes from step 4: the kernel dropped the lock with the process, nothing was cleaned up by hand."""
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "run"
    cfg = _config(tmp_path, str(folder))
    holding = tmp_path / "holding"
    markers = {"TINY_HOLD_AT_STEP": "5", "TINY_HOLDING_MARKER": str(holding),
               "TINY_RELEASE_MARKER": str(tmp_path / "never")}  # fmt: skip
    command = _fit(cfg, "--ckpt_path", "auto", "--trainer.max_epochs", "2")
    first = _process(command, tmp_path, **markers)
    try:
        wait_for(holding, first)
        record = _holder_fields(folder)
        assert (record["host"], record["pid"]) == (socket.gethostname(), first.pid)

        before = sorted((folder / "checkpoints").iterdir())
        code, _, err = _here(command, request, monkeypatch, capsys)
        assert code == 2
        expected = IN_USE.format(folder=folder, host=record["host"], pid=first.pid, started=record["started"])
        assert _error_line(err) == expected
        assert sorted((folder / "checkpoints").iterdir()) == before
        assert _holder_fields(folder) == record  # the refused run wrote nothing into the lock file

        plan = cli.check(command)  # a dry run: reports, takes nothing
        assert any(line.startswith(f"{folder} is in use by another run (host {record['host']}") for line in plan)
        assert _holder_fields(folder) == record
    finally:
        first.send_signal(signal.SIGKILL)
        first.communicate()
    assert first.returncode == -signal.SIGKILL

    code, out, err = _here(command, request, monkeypatch, capsys)
    assert code == 0, err[-3000:]
    assert "(epoch 0, step 4)" in out
    assert _step(folder / "checkpoints" / "last.ckpt") == 8
    assert _holder_fields(folder)["pid"] == os.getpid()  # this process, the resumed run, holds it now


def test_the_lock_is_reentrant_in_its_process_and_a_probe_creates_nothing(tmp_path):
    """A process that holds a folder takes it again (the check before a launch's run, then the run itself; other
    processes are refused: see the test above); the dry run's probe of a folder never locked creates nothing."""
    folder = tmp_path / "run"
    runlock.lock(folder)
    record = _holder_fields(folder)
    runlock.lock(folder)
    assert _holder_fields(folder) == record and record["pid"] == os.getpid()
    assert runlock.in_use(folder) is None  # held by this very process: no other run
    assert runlock.in_use(tmp_path / "other") is None and not (tmp_path / "other").exists()


def test_a_symlinked_lock_file_is_refused_and_its_target_left_untouched(tmp_path, request, monkeypatch, capsys):
    """A ``.lock`` that is a symbolic link would have its target truncated and overwritten by the holder's
    record: the run stops with one line instead, and the file it points to keeps its bytes."""
    monkeypatch.chdir(tmp_path)
    victim = tmp_path / "precious.txt"
    victim.write_text("keep me\n")
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / runlock.LOCK_FILE).symlink_to(victim)
    with pytest.raises(runlock.ConfigError, match="is not a regular file"):
        runlock.lock(folder)
    assert victim.read_text() == "keep me\n"
    with pytest.raises(runlock.ConfigError, match="is not a regular file"):
        runlock.in_use(folder)  # the dry run's probe refuses it as the run does, and opens nothing through it
    assert victim.read_text() == "keep me\n"
    with pytest.raises(runlock.ConfigError, match=r"is not a regular file \(a symbolic link\)"):
        cli.check(_fit(_config(tmp_path, str(folder))))  # a stage's --dry-run

    code, _, err = _here(_fit(_config(tmp_path, str(folder))), request, monkeypatch, capsys)
    assert code == 2
    assert _error_line(err) == f"error: {folder / runlock.LOCK_FILE} is not a regular file (a symbolic link); remove it"
    assert victim.read_text() == "keep me\n"


def _held_elsewhere(folder: Path) -> int:
    """A descriptor holding ``folder``'s lock as a process on another host would (its own open file, its record)."""
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / runlock.LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o666)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.pwrite(fd, b'{"host": "node-dead", "pid": 4242, "started": "2026-01-01 00:00:00"}\n', 0)
    return fd


@pytest.mark.slow  # waits out a lock's lease
def test_a_requeued_job_retries_a_lock_held_from_another_host_for_the_lease(tmp_path, monkeypatch, capsys):
    """After a requeue the dead predecessor's lock on another host is retried (NFS drops it after its lease):
    the lock is taken once it is gone, with one line saying why the run waits; a lock still held when the lease
    ends is "in use" as before."""
    import threading

    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    monkeypatch.setenv(runlock.LEASE_ENV, "10")
    folder = tmp_path / "run"
    fd = _held_elsewhere(folder)
    threading.Timer(2.5, os.close, [fd]).start()  # the server drops the dead client's lock
    start = time.monotonic()
    runlock.lock(folder)
    assert 2.0 < time.monotonic() - start < 9
    assert _holder_fields(folder)["pid"] == os.getpid()
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [
        f"{folder} is in use by another run (host node-dead, pid 4242, started 2026-01-01 00:00:00); this requeued "
        f"job retries for up to 10 s ({runlock.LEASE_ENV}) while the lock of its predecessor expires"
    ]
    print(lines[0])  # what the user reads (docs/reliability.md)

    monkeypatch.setenv(runlock.LEASE_ENV, "2")
    other = tmp_path / "other"
    fd = _held_elsewhere(other)
    try:
        start = time.monotonic()
        with pytest.raises(runlock.FolderInUse, match="node-dead"):
            runlock.lock(other)
        assert 2.0 <= time.monotonic() - start < 5
    finally:
        os.close(fd)


def test_a_first_start_does_not_wait_out_the_lease(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    folder = tmp_path / "run"
    fd = _held_elsewhere(folder)
    try:
        start = time.monotonic()
        with pytest.raises(runlock.FolderInUse):
            runlock.lock(folder)
        assert time.monotonic() - start < 3
    finally:
        os.close(fd)


@pytest.mark.parametrize("value", ["soon", "-1", "nan"])
def test_a_lease_that_is_not_seconds_is_one_line(monkeypatch, value):
    monkeypatch.setenv(runlock.LEASE_ENV, value)
    with pytest.raises(runlock.ConfigError, match=f"{runlock.LEASE_ENV}="):
        runlock.lease_s()


def test_where_the_filesystem_has_no_locks_the_run_goes_on_with_one_warning(tmp_path, monkeypatch, capsys):
    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    runlock.lock(tmp_path / "run")
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"warning: {tmp_path / 'run'} is not locked against a second run: this filesystem has no locks "
        f"({os.strerror(errno.ENOLCK)}); see docs/reliability.md"
    ]
    assert runlock.in_use(tmp_path / "run") is None


def test_a_read_only_folder_stops_the_run_at_its_lock(tmp_path, monkeypatch, request, capsys):
    """Before anything is built: the lock file is the run's first write. (Injected: this test may run as root,
    whom permissions do not stop, and cannot mount a read-only filesystem.)"""
    monkeypatch.chdir(tmp_path)
    cfg = _config(tmp_path, "runs/x")
    real_open = os.open

    def read_only(path, flags, *args, **kwargs):
        if str(path).endswith(runlock.LOCK_FILE) and flags & os.O_CREAT:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", read_only)
    code, _, err = _here(_fit(cfg), request, monkeypatch, capsys)
    assert code == 2
    assert _error_line(err) == "error: cannot write runs/x/.lock: Read-only file system"
    assert not (tmp_path / "runs" / "x" / "checkpoints").exists()


# ------------------------------------------------------------------------------ the OS refuses a write
def test_a_full_disk_at_a_checkpoint_write_is_one_line_and_the_run_resumes_from_the_previous(
    tmp_path, request, monkeypatch, capsys
):
    """The step-8 checkpoint's bytes stop half-way with ENOSPC inside the real write of its temporary file
    (``torch.save`` into it); the run ends with one line naming the file, leaves no temporary file, keeps the
    step-4 checkpoints whole, and the same command resumes from them once space is back."""
    from helpers.cli_tiny import write_until_full

    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "runs" / "x"
    cfg = _config(tmp_path, "runs/x")
    command = _fit(cfg, "--ckpt_path", "auto", "--trainer.max_epochs", "2")
    save = torch.save
    failed: list[int] = []

    def full_at_step_8(obj, f, *args, **kwargs):
        if isinstance(obj, dict) and obj.get("global_step") == 8 and not isinstance(f, io.BytesIO):
            failed.append(8)
            return write_until_full(obj, f)
        return save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_at_step_8)
    code, _, err = _here(command, request, monkeypatch, capsys)
    assert code == 2 and failed == [8]
    assert _error_line(err) == "error: cannot write runs/x/checkpoints/step=8.ckpt: No space left on device"
    assert not runs.stale_temporaries(folder)
    kept = sorted(p.name for p in (folder / "checkpoints").iterdir())
    assert kept == ["last.ckpt", "step=4.ckpt"]
    assert all(_step(folder / "checkpoints" / name) == 4 for name in kept)

    monkeypatch.setattr(torch, "save", save)  # space is back
    code, out, err = _here(command, request, monkeypatch, capsys)
    assert code == 0, err[-3000:]
    assert "(epoch 0, step 4)" in out
    assert _step(folder / "checkpoints" / "last.ckpt") == 8


@pytest.mark.parametrize("fault", [errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES])
def test_each_write_fault_is_a_write_error_that_keeps_the_old_file(tmp_path, monkeypatch, fault):
    monkeypatch.chdir(tmp_path)
    target = write_text_atomic(tmp_path / "runs" / "x" / "config.yaml", "old")

    def refused(tmp: Path) -> None:
        tmp.write_text("half")
        raise OSError(fault, os.strerror(fault))

    with pytest.raises(WriteError) as info:
        write_atomic(target, refused)
    assert str(info.value) == f"cannot write runs/x/config.yaml: {os.strerror(fault)}"
    print(f"error: {info.value}")  # what the user reads (docs/reliability.md)
    assert errors.user_error(info.value) == str(info.value)
    assert target.read_text() == "old" and not runs.stale_temporaries(tmp_path / "runs" / "x")


def test_a_fault_behind_torch_s_own_error_is_found(tmp_path):
    """torch's writer turns a failed write of its file object into a RuntimeError; the OSError behind it names
    the cause (here a real one: /dev/full refuses every write with ENOSPC)."""
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full")

    def into_full_device(tmp: Path) -> None:
        with open("/dev/full", "wb") as file:
            torch.save({"w": torch.zeros(1000)}, file)

    with pytest.raises(WriteError, match="No space left on device"):
        write_atomic(tmp_path / "x.ckpt", into_full_device)
    assert not list(tmp_path.iterdir())


@pytest.mark.slow  # two DDP processes on the CPU, each importing the CLI: ~30 s
def test_a_full_disk_on_rank_0_ends_every_rank_with_the_same_line(tmp_path):
    """Under DDP only rank 0 writes checkpoints; rank 1 waits in the barrier after the write. Both end within
    seconds (FailFast), with the same one line, instead of rank 1 waiting for the process group's timeout."""
    cfg = _config(tmp_path, "runs/x", plugin="helpers.cli_tiny.FullDiskCheckpointIO")
    argv = _fit(cfg, "--trainer.devices", "2", "--trainer.strategy", "ddp", "--trainer.accelerator", "cpu")
    start = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "mabn", *argv], cwd=tmp_path, env=_env(TINY_FULL_AT_STEP="4"),
                         capture_output=True, text=True, timeout=240)  # fmt: skip
    seconds = time.monotonic() - start
    line = "error: cannot write runs/x/checkpoints/step=4.ckpt: No space left on device"
    lines = run.stderr.splitlines()
    assert run.returncode == 2, run.stderr[-3000:]
    assert lines.count(line) == 2, run.stderr[-3000:]  # rank 0's, and rank 1's after it stopped
    assert not any("Traceback" in x for x in lines), run.stderr[-3000:]
    assert seconds < 120
    assert not runs.stale_temporaries(tmp_path / "runs" / "x")
    assert _step(tmp_path / "runs" / "x" / "checkpoints" / "last.ckpt") == 2


# ------------------------------------------------------------------------------ CUDA out of memory
@pytest.fixture(scope="session")
def sets(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sets")
    return {
        "cityscapes": demo_cityscapes.generate(root / "cs", n_train=4, n_val=1, size=(32, 64)),
        "pretrain": demo_imagenet.generate(root / "in", n_train=2, n_val=1, size=36),
    }


TINY = [*flags("trainer", limit_val_batches=1, num_sanity_val_steps=0, **QUIET),
        "--data.init_args.num_workers", "0", "--model.init_args.arch", "resnet18"]  # fmt: skip
STAGES = {
    "cityscapes": ("mabn.tasks.SegmentationTask", ["--backbone", "none"],
                   ["--data.init_args.global_batch_size", "4", "--data.init_args.crop_size", "32",
                    "--model.init_args.log_predictions_every_n_epochs", "0"],
                   "error: CUDA out of memory in a training step (per-device batch 4, crop 32): lower "
                   "--data.init_args.crop_size, use more devices so each holds fewer images (global_batch_size "
                   "splits over them), or accumulate: --data.init_args.global_batch_size 2 "
                   "--trainer.accumulate_grad_batches 2 (the same global batch)"),
    "pretrain": ("mabn.tasks.ClassificationTask", [],
                 ["--data.init_args.batch_size", "2", "--data.init_args.image_size", "32",
                  "--data.init_args.val_resize", "36"],
                 "error: CUDA out of memory in a training step (per-device batch 2, image size 32): lower "
                 "--data.init_args.batch_size (the images each device holds) or --data.init_args.image_size"),
}  # fmt: skip


@pytest.mark.slow  # a fit stopped by the error, then its resume
@pytest.mark.parametrize("stage", sorted(STAGES))
def test_cuda_out_of_memory_in_a_training_step_is_one_line_and_the_last_checkpoint_resumes(
    stage, sets, tmp_path, request, monkeypatch, capsys
):
    """One step is trained and checkpointed; the resumed run's next step runs out of memory (torch's own error,
    raised from the training step): one line with the per-device batch, the crop or image size and what to
    lower, the checkpoint untouched, and the run resumes from it."""
    import importlib

    monkeypatch.chdir(tmp_path)
    class_path, launch_args, data_args, expected = STAGES[stage]
    module, _, name = class_path.rpartition(".")
    task = getattr(importlib.import_module(module), name)
    folder = tmp_path / "run"
    argv = [stage, "--data", str(sets[stage]), *launch_args, "--run-dir", str(folder), "--resume", "auto", "--",
            *TINY, *data_args]  # fmt: skip

    code, _, err = _here([*argv, "--trainer.max_steps", "1"], request, monkeypatch, capsys)
    assert code == 0, err[-3000:]
    last = folder / "checkpoints" / "last.ckpt"
    saved = last.read_bytes()
    assert _step(last) == 1

    step = task.training_step

    def out_of_memory(self, batch, batch_idx):
        if self.global_step == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.11 GiB total)")
        return step(self, batch, batch_idx)

    monkeypatch.setattr(task, "training_step", out_of_memory)
    code, _, err = _here([*argv, "--trainer.max_steps", "2"], request, monkeypatch, capsys)
    assert code == 2
    assert _error_line(err) == expected
    assert last.read_bytes() == saved and not runs.stale_temporaries(folder)

    if stage == "cityscapes":  # the resume is the same for both stages: once is enough
        monkeypatch.setattr(task, "training_step", step)
        code, out, err = _here([*argv, "--trainer.max_steps", "2"], request, monkeypatch, capsys)
        assert code == 0, err[-3000:]
        assert "step 1)" in out and _step(last) == 2


class _Data:
    def __init__(self, **attrs) -> None:
        self.__dict__.update(attrs)


@pytest.mark.parametrize(
    ("data", "norm_batch", "advice"),
    [
        (
            _Data(batch_size=2, crop_size=713, global_batch_size=16),
            2,
            " (per-device batch 2, crop 713): lower --data.init_args.crop_size (more devices would not help: 2 images "
            "is the smallest share of a device)",
        ),
        (
            _Data(batch_size=4, crop_size=713, global_batch_size=None),
            2,
            " (per-device batch 4, crop 713): lower --data.init_args.crop_size or --data.init_args.batch_size",
        ),
        (_Data(batch_size=8), None, " (per-device batch 8): lower --data.init_args.batch_size"),
        (object(), None, ": lower --data.init_args.batch_size"),
    ],
    ids=["stage-2-smallest-share", "stage-2-per-device-batch", "batch-only", "nothing-known"],
)
def test_the_out_of_memory_line_names_what_can_be_lowered(data, norm_batch, advice):
    assert training_oom_line(data, norm_batch).startswith(f"CUDA out of memory in a training step{advice}")
