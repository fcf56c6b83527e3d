"""One folder per experiment (``mabn.run.folder``, ``mabn.cli.lightning``): a new run never overwrites another, a
restart with
``--ckpt_path auto`` continues the same folder, CSV log and wandb run from the newest good checkpoint of the same
task and norm, and a kill in the middle of a checkpoint write loses nothing (tests/helpers/cli_tiny.py is the task)."""

from __future__ import annotations

import csv
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
import yaml
from torch import nn

from helpers.commands import run_mabn
from helpers.wandb_reader import wandb_session
from mabn.errors import ConfigError
from mabn.run import folder as runs

ROOT = Path(__file__).resolve().parents[1]
TINY = "helpers.cli_tiny.TinyTask"


def _env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", **extra}


def _command(cfg: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "mabn", "fit", "--config", str(cfg), *extra]


def _config(tmp_path: Path, root: Path, slow_io: bool = False) -> Path:
    from helpers.cli_tiny import CONFIG

    text = CONFIG.format(root=root)
    if slow_io:
        text = text.replace(
            "trainer:\n", "trainer:\n  plugins:\n    - class_path: helpers.cli_tiny.SlowCheckpointIO\n", 1
        )
    cfg = tmp_path / f"cfg-{root.name}.yaml"
    cfg.write_text(text)
    return cfg


def _run(cmd: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=_env(**env), capture_output=True, text=True, timeout=300)


def _run_here(cmd: list[str], request, monkeypatch, capsys) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of a ``_command`` run in this process through the same entry point,
    ``mabn.__main__.main``, with wandb disabled as in ``_env``: no interpreter to start where nothing is killed."""
    wandb_session(request, monkeypatch, "disabled")
    return run_mabn(cmd[cmd.index("-m") + 2 :], capsys)  # the arguments after ``python -m mabn``


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as file:
        return list(csv.DictReader(file))


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(autouse=True)
def _tests_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "tests"))


@pytest.mark.slow
def test_a_killed_run_resumes_in_its_folder_with_its_log_best_checkpoint_and_wandb_id(
    tmp_path, request, monkeypatch, capsys
):
    """4 epochs of 4 steps (shuffling, dropout, MABN2d and BRN, a per-step lr schedule). Killed at step 10 (mid
    epoch 3, after the step-8 checkpoint), then restarted by the same command, the run resumes from the epoch
    boundary in its folder and ends bit-identical to the uninterrupted run, optimizer and scheduler state
    included, with the same CSV log, best checkpoint and wandb run. The uninterrupted run, the reference, runs in
    this process on one thread (as the processes do: OMP_NUM_THREADS=1); the killed run and its restart are
    processes of their own."""
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    monkeypatch.chdir(tmp_path)
    reference = _command(_config(tmp_path, straight), "--ckpt_path", "auto")
    code, out, err = _run_here(reference, request, monkeypatch, capsys)
    assert code == 0, err[-3000:]
    assert "No checkpoint to resume" in out

    cfg = _config(tmp_path, killed)
    dead = _run(_command(cfg, "--ckpt_path", "auto"), tmp_path, TINY_KILL_AT_STEP="10")
    assert dead.returncode == -signal.SIGKILL, dead.stderr[-3000:]
    assert torch.load(killed / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 8
    wandb_id = (killed / "wandb-id").read_text()
    assert max(int(r["step"]) for r in _rows(killed / "metrics.csv")) >= 8  # rows logged after the step-8 checkpoint
    again = _run(_command(cfg, "--ckpt_path", "auto"), tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "Resuming from" in again.stdout and "(epoch 1, step 8)" in again.stdout
    assert (killed / "wandb-id").read_text() == wandb_id  # the same wandb run continues

    # One CSV log, cut back to the checkpoint and continued: row for row the uninterrupted run's.
    assert _rows(killed / "metrics.csv") == _rows(straight / "metrics.csv")
    a, b = (torch.load(f / "checkpoints" / "last.ckpt", weights_only=True) for f in (straight, killed))
    assert a["global_step"] == b["global_step"] == 16
    for key, value in a["state_dict"].items():
        assert torch.equal(b["state_dict"][key], value), key
    for pa, pb in zip(a["optimizer_states"][0]["state"].values(), b["optimizer_states"][0]["state"].values()):
        assert torch.equal(pa["momentum_buffer"], pb["momentum_buffer"])
    assert a["lr_schedulers"] == b["lr_schedulers"] and a["lr_schedulers"][0]["last_epoch"] == 16
    best = [next(v for k, v in c["callbacks"].items() if k.startswith("ModelCheckpoint")) for c in (a, b)]
    assert best[1]["best_model_score"] == best[0]["best_model_score"]  # the best survives the restart
    assert Path(best[1]["best_model_path"]).parent == killed / "checkpoints"
    assert {p.name for p in (killed / "checkpoints").iterdir()} == {
        p.name for p in (straight / "checkpoints").iterdir()
    }


def _same_weights(a: Path, b: Path) -> None:
    first, second = (torch.load(f / "checkpoints" / "last.ckpt", weights_only=True) for f in (a, b))
    assert first["global_step"] == second["global_step"]
    for key, value in first["state_dict"].items():
        assert torch.equal(second["state_dict"][key], value), key


def test_a_fit_stopped_at_an_epoch_end_with_max_steps_resumes_as_the_uninterrupted_one(
    tmp_path, request, monkeypatch, capsys
):
    """max_steps set (far off) and max_epochs ending the fit: a fit of 1 epoch then resumed to 2 trains the same
    8 steps, logs the same rows under the same steps and ends with the same weights as a fit of 2 epochs."""
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    monkeypatch.chdir(tmp_path)
    steps = ("--trainer.max_steps", "100")
    for folder, runs_of in ((straight, [("2",)]), (stopped, [("1",), ("2", "--ckpt_path", "auto")])):
        cfg = _config(tmp_path, folder)
        for epochs, *extra in runs_of:
            cmd = _command(cfg, "--trainer.max_epochs", epochs, *steps, *extra)
            code, _, err = _run_here(cmd, request, monkeypatch, capsys)
            assert code == 0, err[-3000:]
    rows = _rows(straight / "metrics.csv")
    assert {int(r["step"]) for r in rows if r["train/loss"]} == set(range(8))  # the reference trained 8 steps
    assert _rows(stopped / "metrics.csv") == rows
    _same_weights(straight, stopped)


@pytest.mark.slow  # three fits: ~6 s (tests/test_compat.py holds the loop's counters and samples in the default suite)
def test_a_fit_stopped_inside_an_epoch_resumes_with_the_rest_of_its_batches(tmp_path, request, monkeypatch, capsys):
    """A fit of 4 batches an epoch stopped by max_steps at step 6 (2 batches into its second epoch), then resumed
    to step 12, trains the batches the uninterrupted fit of 12 steps trains: the same rows and the same weights.
    A resume that drew the epoch's order anew would train other samples at steps 6 and 7."""
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    monkeypatch.chdir(tmp_path)
    for folder, runs_of in ((straight, [("12",)]), (stopped, [("6",), ("12", "--ckpt_path", "auto")])):
        cfg = _config(tmp_path, folder)
        for steps, *extra in runs_of:
            cmd = _command(cfg, "--trainer.max_epochs", "100", "--trainer.max_steps", steps, *extra)
            code, _, err = _run_here(cmd, request, monkeypatch, capsys)
            assert code == 0, err[-3000:]
    assert torch.load(stopped / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 12
    rows = _rows(straight / "metrics.csv")
    assert {int(r["step"]) for r in rows if r["train/loss"]} == set(range(12))
    assert _rows(stopped / "metrics.csv") == rows
    _same_weights(straight, stopped)


@pytest.mark.slow  # three fits of two DDP processes each (gloo): ~1 min
def test_a_ddp_fit_stopped_inside_an_epoch_resumes_with_the_rest_of_each_ranks_batches(tmp_path):
    """Two processes of 2 batches an epoch each, stopped by max_steps at step 3 (inside the second epoch), then
    resumed to step 6, train the batches the uninterrupted fit of 6 steps trains on each rank, with the same flips:
    the same rows and the same weights. A resume that drew the epoch anew would train other samples at step 3."""
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    ddp = ("--trainer.accelerator", "cpu", "--trainer.devices", "2", "--trainer.strategy", "ddp")
    for folder, runs_of in ((straight, [("6",)]), (stopped, [("3",), ("6", "--ckpt_path", "auto")])):
        cfg = _config(tmp_path, folder)
        for steps, *extra in runs_of:
            cmd = _command(cfg, *ddp, "--trainer.max_epochs", "100", "--trainer.max_steps", steps, *extra)
            done = _run(cmd, tmp_path)
            assert done.returncode == 0, done.stderr[-3000:]
    rows = _rows(straight / "metrics.csv")
    assert {int(r["step"]) for r in rows if r["train/loss"]} == set(range(6))
    assert _rows(stopped / "metrics.csv") == rows
    _same_weights(straight, stopped)


def test_a_run_that_died_before_its_first_checkpoint_starts_again_with_its_log(tmp_path, request, monkeypatch, capsys):
    """A folder whose run logged rows and died before any checkpoint (here: its checkpoints removed): --ckpt_path
    auto starts a new run, whose metrics.csv holds its own rows, not the dead run's before them."""
    folder = tmp_path / "run"
    cfg = _config(tmp_path, folder)
    monkeypatch.chdir(tmp_path)
    code, _, err = _run_here(_command(cfg, "--trainer.max_epochs", "1"), request, monkeypatch, capsys)
    assert code == 0, err[-3000:]
    rows = _rows(folder / "metrics.csv")
    shutil.rmtree(folder / "checkpoints")
    again = _command(cfg, "--trainer.max_epochs", "1", "--ckpt_path", "auto")
    code, out, err = _run_here(again, request, monkeypatch, capsys)
    assert code == 0, err[-3000:]
    assert "No checkpoint to resume" in out
    assert _rows(folder / "metrics.csv") == rows


def test_a_resume_of_a_finished_run_says_it_is_finished(tmp_path, request, monkeypatch, capsys):
    folder = tmp_path / "run"
    cfg = _config(tmp_path, folder)
    monkeypatch.chdir(tmp_path)
    code, _, err = _run_here(_command(cfg, "--trainer.max_epochs", "1"), request, monkeypatch, capsys)
    assert code == 0, err[-3000:]
    before = torch.load(folder / "checkpoints" / "last.ckpt", weights_only=True)["global_step"]
    again = _command(cfg, "--trainer.max_epochs", "1", "--ckpt_path", "auto")
    code, out, err = _run_here(again, request, monkeypatch, capsys)
    assert code == 0, err[-3000:]
    assert (
        f"{folder}'s run is finished (max_epochs=1 reached, 1 trained): nothing to train; raise "
        "--trainer.max_epochs or --trainer.max_steps to train on"
    ) in out
    assert torch.load(folder / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == before == 4


def test_a_new_run_never_overwrites_the_run_in_its_folder(tmp_path, request, monkeypatch, capsys):
    folder = tmp_path / "run"
    cfg = _config(tmp_path, folder)
    monkeypatch.chdir(tmp_path)
    code, _, err = _run_here(_command(cfg, "--trainer.max_epochs", "1"), request, monkeypatch, capsys)
    assert code == 0, err[-3000:]
    before = _snapshot(folder)
    code, _, err = _run_here(_command(cfg, "--trainer.max_epochs", "1"), request, monkeypatch, capsys)
    assert code == 2
    assert err.strip().splitlines()[-1].startswith(f"error: {folder} already holds a run")
    assert _snapshot(folder) == before


def test_validate_without_a_checkpoint_of_the_run_is_refused_in_one_line(tmp_path, request, monkeypatch, capsys):
    """A config whose run folder holds no last.ckpt: nothing to evaluate, rather than a freshly built model's
    scores filed under the run."""
    folder = tmp_path / "run"
    monkeypatch.chdir(tmp_path)
    validate = [sys.executable, "-m", "mabn", "validate", "--config", str(_config(tmp_path, folder))]
    code, _, err = _run_here(validate, request, monkeypatch, capsys)
    assert code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        f"error: validate without --ckpt_path evaluates the run's last checkpoint, and {folder} holds no "
        f"{Path('checkpoints', 'last.ckpt')}: give the checkpoint to evaluate with --ckpt_path <file>"
    )
    assert not folder.exists()


def test_validate_with_a_runs_config_writes_into_a_folder_of_its_own(tmp_path, request, monkeypatch, capsys):
    """``validate --config runs/x/config.yaml`` leaves every file of the training run byte for byte (its
    metrics.csv, config.yaml, wandb id); its own metrics and config go to ``runs/x/eval/validate-<time>/``."""
    folder = tmp_path / "run"
    monkeypatch.chdir(tmp_path)
    code, _, err = _run_here(
        _command(_config(tmp_path, folder), "--trainer.max_epochs", "1"), request, monkeypatch, capsys
    )
    assert code == 0, err[-3000:]
    before = _snapshot(folder)
    validate = [sys.executable, "-m", "mabn", "validate", "--config", str(folder / "config.yaml")]
    code, out, err = _run_here(validate, request, monkeypatch, capsys)
    assert code == 0, err[-3000:]
    last = folder / "checkpoints" / "last.ckpt"
    assert f"Validate: {last}, the run's latest state (--ckpt_path <file> picks another)" in out
    assert {k: v for k, v in _snapshot(folder).items() if not k.startswith("eval/")} == before
    (evaluation,) = (folder / "eval").iterdir()
    assert evaluation.name.startswith("validate-")
    assert [set(row) - {"epoch", "step"} for row in _rows(evaluation / "metrics.csv")] == [{"val/acc"}]
    # The score of the run's last validation: the same weights on the same data.
    trained = [row["val/acc"] for row in _rows(folder / "metrics.csv") if row["val/acc"]]
    assert _rows(evaluation / "metrics.csv")[0]["val/acc"] == trained[-1]
    assert (evaluation / "wandb-id").read_text() != (folder / "wandb-id").read_text()  # a wandb run of its own


@pytest.mark.slow
def test_a_kill_during_a_checkpoint_write_leaves_the_previous_checkpoint(tmp_path, request, monkeypatch, capsys):
    """The run folder on a tmpfs, $TMPDIR on the disk: a write that went through $TMPDIR and a copy would not be
    atomic here. The kill lands after the new checkpoint's bytes are written and before the rename; the restart
    runs in this process, with the same $TMPDIR."""
    shm = Path("/dev/shm")
    if not shm.is_dir():
        pytest.skip("no tmpfs at /dev/shm on this machine")
    scratch = Path(tempfile.mkdtemp(dir=shm))
    try:
        folder = scratch / "run"
        assert os.stat(scratch).st_dev != os.stat(tmp_path).st_dev
        marker = tmp_path / "saving"
        cfg = _config(tmp_path, folder, slow_io=True)
        env = _env(TMPDIR=str(tmp_path), TINY_SLOW_SAVE_AT_STEP="8", TINY_SAVING_MARKER=str(marker))
        proc = subprocess.Popen(_command(cfg, "--ckpt_path", "auto"), cwd=tmp_path, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
        deadline = time.monotonic() + 240
        while not marker.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()[-3000:]
            time.sleep(0.2)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()

        assert runs.stale_temporaries(folder)  # the cut-off write, under its temporary name only
        for ckpt in (folder / "checkpoints").glob("*.ckpt"):
            assert torch.load(ckpt, weights_only=True)["global_step"] == 4, ckpt  # the previous, whole
        monkeypatch.chdir(tmp_path)
        monkeypatch.setenv("TMPDIR", str(tmp_path))
        monkeypatch.setattr(tempfile, "tempdir", None)  # read $TMPDIR again, as a new process would
        code, out, err = _run_here(_command(cfg, "--ckpt_path", "auto"), request, monkeypatch, capsys)
        assert code == 0, err[-3000:]
        assert "(epoch 0, step 4)" in out and "left by a write that did not finish" in out
        assert not runs.stale_temporaries(folder)
        assert torch.load(folder / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 16
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


# ------------------------------------------------------------------------------ which checkpoint, in-process
def _save(path: Path, step: int, mtime: int, norm: str = "mabn", task: str = TINY) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    hparams = {"norm": norm, "_class_path": task}
    torch.save({"state_dict": {}, "hyper_parameters": hparams, "epoch": 0, "global_step": step}, path)
    os.utime(path, (mtime, mtime))
    return path


def test_auto_picks_the_highest_step_readable_checkpoint_of_the_same_task_and_norm(tmp_path):
    said: list[str] = []
    identity = runs.Identity(TINY, "mabn")
    _save(tmp_path / "checkpoints" / "last.ckpt", 100, 1000)
    hpc = _save(tmp_path / "hpc_ckpt_1.ckpt", 200, 2000)
    _save(tmp_path / "checkpoints" / "other-norm.ckpt", 300, 3000, norm="bn")
    _save(tmp_path / "checkpoints" / "other-task.ckpt", 400, 4000, task="mabn.tasks.ClassificationTask")
    cut = tmp_path / "checkpoints" / "cut.ckpt"
    cut.write_bytes(hpc.read_bytes()[:100])
    os.utime(cut, (5000, 5000))
    (tmp_path / "checkpoints" / "dangling.ckpt").symlink_to(tmp_path / "gone.ckpt")

    plan = runs.plan(tmp_path, "auto", identity, say=said.append)
    assert plan.resume.path == hpc and plan.resume.step == 200
    text = "\n".join(said)
    for name, why in [("dangling", "target is gone"), ("cut", "not a readable checkpoint"),
                      ("other-task", "ClassificationTask"), ("other-norm", "norm 'bn'")]:  # fmt: skip
        assert any(name in line and why in line for line in said), (name, text)
    assert runs.plan(tmp_path / "new", "auto", identity, say=said.append).resume is None


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: p.write_bytes(b"cut short"), "is not a readable checkpoint"),
        (lambda p: _save(p, 1, 1, norm="gn"), "trained with norm 'gn'"),
        (lambda p: _save(p, 1, 1, task="mabn.tasks.ClassificationTask"), "written by mabn.tasks.ClassificationTask"),
        (lambda p: None, "checkpoint not found"),
    ],
    ids=["truncated", "other-norm", "other-stage", "missing"],
)
def test_an_explicit_checkpoint_that_does_not_fit_is_refused(tmp_path, make, message):
    path = tmp_path / "given.ckpt"
    make(path)
    with pytest.raises(ConfigError, match=message):
        runs.plan(tmp_path / "run", str(path), runs.Identity(TINY, "mabn"))


def test_cut_metrics_keeps_the_rows_from_before_the_resumed_step(tmp_path):
    path = tmp_path / "metrics.csv"
    path.write_text("step,train/loss,val/acc\n3,0.5,\n4,,0.75\n5,0.4,\n")
    runs.cut_metrics(path, 5)
    assert _rows(path) == [
        {"step": "3", "train/loss": "0.5", "val/acc": ""},
        {"step": "4", "train/loss": "", "val/acc": "0.75"},
    ]


class _TwoStepsABatch(pl.LightningModule):
    """Manual optimization with two optimizer steps a batch: the global step runs twice as fast as the step the
    rows are logged under. 4 batches an epoch; the CSV log is saved and copied at the end of the first epoch,
    as LastCheckpoint does before its save."""

    def __init__(self, copy: Path) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.layer, self.copy = nn.Linear(2, 1), copy

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        for _ in range(2):
            loss = self.layer(batch[0]).square().mean()
            optimizer.zero_grad()
            self.manual_backward(loss)
            optimizer.step()
        self.log("train/loss", loss)

    def on_train_epoch_end(self):
        if self.current_epoch == 0:
            self.logger.save()
            shutil.copy(Path(self.logger.log_dir) / "metrics.csv", self.copy)
            self.trainer.save_checkpoint(self.copy.with_suffix(".ckpt"))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(16, 2)), batch_size=4)


def test_a_resume_cuts_metrics_at_the_step_its_rows_carry_not_the_global_step(tmp_path):
    """The rows a checkpoint's run had logged when it was saved are the rows the cut keeps, whatever its global
    step says (here twice the logged step)."""
    copy = tmp_path / "at-save.csv"
    logger = pl.loggers.CSVLogger(tmp_path, name="log", version=0, flush_logs_every_n_steps=1)
    trainer = pl.Trainer(max_epochs=2, logger=logger, log_every_n_steps=1, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    trainer.fit(_TwoStepsABatch(copy))
    metrics = Path(logger.log_dir) / "metrics.csv"
    saved = runs.read_checkpoint(copy.with_suffix(".ckpt"))
    assert saved.step == 8 and len(_rows(metrics)) == 8  # two steps a batch; a row a batch
    runs.cut_metrics(metrics, saved.logged_step)
    assert _rows(metrics) == _rows(copy) and len(_rows(copy)) == 4


# ------------------------------------------------------------------------------ a run folder knows its experiment
LR = (("--model.init_args.lr", "0.5"), "--model.init_args.lr 0.5 (recorded: 0.05)")


@pytest.mark.parametrize(
    ("changed", "named", "recorded"),
    [
        (*LR, True),
        (*LR, False),
        (("--data.init_args.data_dir", "other"), "--data.init_args.data_dir {other} (recorded: {unused})", True),
    ],
    ids=["lr", "lr-checkpoint-only", "data-folder"],
)
def test_a_resume_of_another_experiment_is_refused_in_one_line(
    tmp_path, request, monkeypatch, capsys, changed, named, recorded
):
    """A run of 1 epoch, then a resume to 2 epochs with one argument of the model or the data changed: refused,
    exit 2, one line naming the argument, both values and the two ways on, the folder left as it was. A run that
    recorded no experiment (experiment.json removed) is compared with its checkpoint's hyperparameters, which hold
    the model's arguments only."""
    folder = tmp_path / "run"
    cfg = _config(tmp_path, folder)
    monkeypatch.chdir(tmp_path)
    code, _, err = _run_here(_command(cfg, "--trainer.max_epochs", "1"), request, monkeypatch, capsys)
    assert code == 0, err[-3000:]
    if not recorded:
        (folder / runs.EXPERIMENT).unlink()
    before = _snapshot(folder)
    code, _, err = _run_here(
        _command(cfg, "--trainer.max_epochs", "2", "--ckpt_path", "auto", *changed), request, monkeypatch, capsys
    )
    assert code == 2
    last = err.strip().splitlines()[-1]
    where = f"{folder} holds the run of another experiment" if recorded else f"{folder / 'checkpoints'}"
    assert last.startswith(f"error: {where}"), last
    assert named.format(other=tmp_path / "other", unused=tmp_path / "unused") in last
    assert "--run-dir" in last and "resume with the recorded values" in last
    assert "Traceback" not in err
    assert {k: v for k, v in _snapshot(folder).items() if k != ".lock"} == {
        k: v for k, v in before.items() if k != ".lock"
    }


def test_a_resume_of_the_same_experiment_goes_on(tmp_path, request, monkeypatch, capsys):
    """The same arguments in another spelling (the data folder as an absolute path, the lr as the number it is)
    are the same experiment: the resume trains on. Its config.yaml records the checkpoint it resumed from: the file
    (which the same config resumes from again) and, in its first line, the step that file held then (last.ckpt
    holds a later one by the run's end)."""
    folder = tmp_path / "run"
    cfg = _config(tmp_path, folder)
    monkeypatch.chdir(tmp_path)
    code, _, err = _run_here(_command(cfg, "--trainer.max_epochs", "1"), request, monkeypatch, capsys)
    assert code == 0, err[-3000:]
    assert yaml.safe_load((folder / "config.yaml").read_text())["ckpt_path"] is None
    assert "# resumed from" not in (folder / "config.yaml").read_text()
    same = ("--data.init_args.data_dir", str(tmp_path / "unused"), "--model.init_args.lr", "5e-2")
    code, out, err = _run_here(
        _command(cfg, "--trainer.max_epochs", "2", "--ckpt_path", "auto", *same), request, monkeypatch, capsys
    )
    assert code == 0, err[-3000:]
    assert torch.load(folder / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 8
    last = folder / "checkpoints" / "last.ckpt"
    recorded = (folder / "config.yaml").read_text()
    assert recorded.splitlines()[0] == f"# resumed from {last} (epoch 0, step 4)"
    assert yaml.safe_load(recorded)["ckpt_path"] == str(last)


def test_a_run_setting_given_on_resume_is_taken_and_said(tmp_path, request, monkeypatch, capsys):
    """A task's run setting (here SettingTask's lr) given on a resume is the one the resumed run takes, not the
    checkpoint's, and a line says so."""
    folder = tmp_path / "run"
    cfg = _config(tmp_path, folder)
    task = ("--model", "helpers.cli_tiny.SettingTask")
    monkeypatch.chdir(tmp_path)
    code, _, err = _run_here(_command(cfg, "--trainer.max_epochs", "1", *task), request, monkeypatch, capsys)
    assert code == 0, err[-3000:]
    resume = ("--trainer.max_epochs", "2", "--ckpt_path", "auto", *task, "--model.init_args.lr", "0.5")
    code, out, err = _run_here(_command(cfg, *resume), request, monkeypatch, capsys)
    assert code == 0, err[-3000:]
    assert "Resuming with --model.init_args.lr 0.5 (the checkpoint's: 0.05)" in out
    assert torch.load(folder / "checkpoints" / "last.ckpt", weights_only=True)["hyper_parameters"]["lr"] == 0.5


# ------------------------------------------------------------------------------ where a run's checkpoints are
def _config_with_dirpath(tmp_path: Path, root: Path, dirpath: Path) -> Path:
    cfg = _config(tmp_path, root)
    cfg.write_text(cfg.read_text().replace("{monitor: val/acc,", f"{{dirpath: {dirpath}, monitor: val/acc,"))
    return cfg


def test_a_config_dirpath_inside_the_run_is_where_resume_and_a_new_run_look(tmp_path, request, monkeypatch, capsys):
    """ModelCheckpoint's dirpath named by the config, inside the run's folder: last.ckpt is written there, a resume
    continues from it, and a new run (no metrics.csv to give the run away: no logger) is refused."""
    folder = tmp_path / "run"
    cfg = _config_with_dirpath(tmp_path, folder, folder / "kept")
    monkeypatch.chdir(tmp_path)
    quiet = ("--trainer.logger", "false")
    code, _, err = _run_here(_command(cfg, "--trainer.max_epochs", "1", *quiet), request, monkeypatch, capsys)
    assert code == 0, err[-3000:]
    assert (folder / "kept" / "last.ckpt").is_file() and not (folder / "checkpoints").exists()
    code, _, err = _run_here(_command(cfg, "--trainer.max_epochs", "1", *quiet), request, monkeypatch, capsys)
    assert code == 2 and err.strip().splitlines()[-1].startswith(f"error: {folder} already holds a run")
    resume = ("--trainer.max_epochs", "2", "--ckpt_path", "auto", *quiet)
    code, out, err = _run_here(_command(cfg, *resume), request, monkeypatch, capsys)
    assert code == 0, err[-3000:]
    assert f"Resuming from {folder / 'kept' / 'last.ckpt'} (epoch 0, step 4)" in out
    assert torch.load(folder / "kept" / "last.ckpt", weights_only=True)["global_step"] == 8


def test_a_config_dirpath_outside_the_run_is_refused_in_one_line(tmp_path, request, monkeypatch, capsys):
    folder, outside = tmp_path / "run", tmp_path / "elsewhere"
    cfg = _config_with_dirpath(tmp_path, folder, outside)
    monkeypatch.chdir(tmp_path)
    code, _, err = _run_here(_command(cfg, "--trainer.max_epochs", "1"), request, monkeypatch, capsys)
    assert code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        f"error: ModelCheckpoint's dirpath {outside} is outside the run's folder {folder}: a resume and last.ckpt "
        f"look for the run's checkpoints inside it; leave dirpath unset ({folder / 'checkpoints'}) or name a folder "
        "inside the run"
    )
    assert not outside.exists() and not folder.exists()


# ------------------------------------------------------------------------------ checkpoints verified
def _overwrite_inside(path: Path) -> None:
    """Overwrite 16 bytes in the middle of the checkpoint's largest tensor, in place: the zip archive stays whole
    (torch stores its records uncompressed and checks none of their checksums as it loads)."""
    with zipfile.ZipFile(path) as archive:
        tensors = [info for info in archive.infolist() if "/data/" in info.filename]  # <archive>/data/<storage>
        member = max(tensors, key=lambda info: info.file_size)
    with open(path, "r+b") as file:
        file.seek(member.header_offset + 26)
        name_length, extra_length = struct.unpack("<HH", file.read(4))
        file.seek(member.header_offset + 30 + name_length + extra_length + member.file_size // 2)
        file.write(b"\x7f" * 16)


def test_a_checkpoint_with_bytes_overwritten_inside_is_skipped_for_the_newest_intact_one(
    tmp_path, request, monkeypatch, capsys
):
    """A run of 2 epochs (checkpoints at steps 4 and 8), last.ckpt and the step-8 file damaged inside: the resume
    says so for each, in one line, and continues from the step-4 file; the damaged file given as --ckpt_path is
    refused in one line."""
    folder = tmp_path / "run"
    cfg = _config(tmp_path, folder)
    monkeypatch.chdir(tmp_path)
    code, _, err = _run_here(_command(cfg, "--trainer.max_epochs", "2"), request, monkeypatch, capsys)
    assert code == 0, err[-3000:]
    damaged = [folder / "checkpoints" / "last.ckpt", folder / "checkpoints" / "step=8.ckpt"]
    for path in damaged:
        assert torch.load(path, weights_only=True)["global_step"] == 8
        _overwrite_inside(path)
    code, _, err = _run_here(
        _command(cfg, "--trainer.max_epochs", "3", "--ckpt_path", str(damaged[0])), request, monkeypatch, capsys
    )
    assert code == 2 and err.strip().splitlines()[-1].startswith(f"error: cannot resume from {damaged[0]}: its ")
    assert "damaged" in err.strip().splitlines()[-1] and "Traceback" not in err
    code, out, err = _run_here(
        _command(cfg, "--trainer.max_epochs", "3", "--ckpt_path", "auto"), request, monkeypatch, capsys
    )
    assert code == 0, err[-3000:]
    for path in damaged:
        assert f"Skipping {path}: its content is not what was saved" in out
    assert f"Resuming from {folder / 'checkpoints' / 'step=4.ckpt'} (epoch 0, step 4)" in out
    assert torch.load(folder / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 12


# ------------------------------------------------------------------------------ resumes at random kills
@pytest.mark.slow
@pytest.mark.parametrize(
    ("limits", "end"),
    [(("--trainer.max_epochs", "100", "--trainer.max_steps", "14"), 14), (("--trainer.max_epochs", "4"), 16)],
    ids=["max_steps", "max_epochs"],
)
@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_fit_killed_at_random_steps_resumes_to_the_uninterrupted_fits_end(
    tmp_path, request, monkeypatch, capsys, limits, end, signum
):
    """A fit (4 steps an epoch, a validation at each epoch's end) stopped by SIGKILL or SIGTERM at 3 random steps,
    each time restarted by the same command (``--ckpt_path auto``), ends where the uninterrupted fit ends, with its
    metrics.csv row for row and the same weights: SIGKILLs resume from the last validation's checkpoint (an epoch's
    end), SIGTERMs from the step they arrive at, inside an epoch, with the rest of that epoch's batches."""
    seed = random.randrange(2**32)
    draw = random.Random(seed)
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    monkeypatch.chdir(tmp_path)
    code, _, err = _run_here(_command(_config(tmp_path, straight), *limits), request, monkeypatch, capsys)
    assert code == 0, err[-3000:]
    cfg = _config(tmp_path, stopped)
    points, last = [], stopped / "checkpoints" / "last.ckpt"
    for _ in range(3):
        start = torch.load(last, weights_only=True)["global_step"] if last.is_file() else 0
        if start >= end - 1:
            break
        points.append(draw.randrange(start + 1, end))
        variable = "TINY_KILL_AT_STEP" if signum == signal.SIGKILL else "TINY_TERM_AT_STEP"
        dead = _run(_command(cfg, *limits, "--ckpt_path", "auto"), tmp_path, **{variable: str(points[-1])})
        expected = -signal.SIGKILL if signum == signal.SIGKILL else 128 + signal.SIGTERM
        assert dead.returncode == expected, (seed, points, dead.stderr[-3000:])
    again = _run(_command(cfg, *limits, "--ckpt_path", "auto"), tmp_path)
    assert again.returncode == 0, (seed, points, again.stderr[-3000:])
    rows = _rows(straight / "metrics.csv")
    assert torch.load(last, weights_only=True)["global_step"] == end, (seed, points)
    assert _rows(stopped / "metrics.csv") == rows, (seed, points)
    _same_weights(straight, stopped)
