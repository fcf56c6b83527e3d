"""What a Lightning user types works, and a dry run refuses what the run would: ``--print_config`` writes YAML
alone on stdout, ``--ckpt_path last`` is the run's ``last.ckpt``, ``--trainer.logger false`` trains, a logger
given by a name that does not resolve is one line naming the classes to write; a GPU asked for where there is
none, a taken run folder and the data's problems are all named by the dry run; the output carries the product's
lines, not the libraries' notices (``python -m mabn segment`` on a generated dataset of one's own)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import yaml

from helpers.commands import run_mabn
from helpers.trainer import fit_flags
from mabn.data.synthetic import segment as demo_segment
from mabn.errors import ConfigError
from mabn.run import folder as runs

TINY = [
    *fit_flags(2, check_val_every_n_epoch=2, num_sanity_val_steps=0),
    "--data.init_args.global_batch_size", "4", "--data.init_args.num_workers", "0",
    "--data.init_args.crop_size", "32", "--model.init_args.arch", "resnet18",
    "--model.init_args.log_predictions_every_n_epochs", "0",
]  # fmt: skip


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return demo_segment.generate(tmp_path_factory.mktemp("habits") / "mine", n_train=4, n_val=2, size=(40, 64))


def _segment(data: Path, run: Path, *extra: str, dry_run: bool = False) -> list[str]:
    return ["segment", "--data", str(data), "--backbone", "none", "--run-dir", str(run),
            *(["--dry-run"] if dry_run else []), "--", *TINY, *extra]  # fmt: skip


def _errors(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("error: ")]


def test_print_config_writes_yaml_alone_on_stdout(data, tmp_path, capsys):
    code, out, err = run_mabn(_segment(data, tmp_path / "run", "--print_config"), capsys)
    assert code in (0, None), err
    config = yaml.safe_load(out)  # the launch's "Backbone: ..." line would make it no YAML
    assert config["model"]["init_args"]["arch"] == "resnet18" and config["data"]["init_args"]["data_dir"] == str(data)
    assert "Backbone: none" in err


def test_ckpt_path_last_is_the_runs_last_ckpt(tmp_path):
    identity = runs.Identity("x.Task", "bn")
    with pytest.raises(ConfigError, match=r"--ckpt_path last: .* holds no checkpoints/last.ckpt"):
        runs.plan(tmp_path, "last", identity, say=print)
    last = tmp_path / runs.CHECKPOINTS / runs.LAST
    last.parent.mkdir()
    torch.save({"global_step": 3, "epoch": 0, "state_dict": {}, "hyper_parameters": {"norm": "bn"}}, last)
    assert runs.plan(tmp_path, "last", identity, say=print).resume.path == last


@pytest.mark.slow  # a stage-2 fit
def test_a_fit_without_loggers_trains_and_says_only_the_products_lines(data, tmp_path, capsys, caplog):
    """``--trainer.logger false`` (the recipes' LearningRateMonitor refused a Trainer without a logger); the
    explicit ``--backbone none`` is said once, by the launch; Lightning's pytree deprecation and its
    advertisement are not shown."""
    caplog.set_level(logging.INFO)
    run = tmp_path / "run"
    code, out, err = run_mabn(_segment(data, run, "--trainer.logger", "false"), capsys)
    assert code == 0, err[-3000:]
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 2
    assert not (run / runs.METRICS).exists()
    said = out + err + caplog.text
    assert "Backbone: none" in out and "No backbone given" not in said
    assert "LeafSpec" not in said and "Tip:" not in said


@pytest.mark.parametrize(
    ("given", "says"),
    [
        ("TensorBoardLogger", "pytorch_lightning.loggers.TensorBoardLogger, mabn.run.loggers.TensorBoardLogger"),
        ("mabn.run.loggers.TensorBoard", "module 'mabn.run.loggers' has no attribute 'TensorBoard'"),
    ],
)
def test_a_logger_that_does_not_resolve_is_one_line_naming_what_to_write(data, tmp_path, capsys, given, says):
    code, _, err = run_mabn(_segment(data, tmp_path / "run", "--trainer.logger+", given, dry_run=True), capsys)
    assert code == 2
    (line,) = _errors(err)
    assert line.startswith(f"error: --trainer.logger: got '{given}': ") and says in line, line
    assert "mabn.run.loggers.CSVLogger, mabn.run.loggers.WandbLogger" in line


def test_a_gpu_where_there_is_none_is_refused_by_the_dry_run_and_the_run(data, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    line = "error: --trainer.accelerator gpu: this machine has no CUDA device"
    for dry_run in (True, False):
        code, _, err = run_mabn(
            _segment(data, tmp_path / "run", "--trainer.accelerator", "gpu", dry_run=dry_run), capsys
        )
        assert code == 2 and _errors(err)[0].startswith(line), err[-2000:]
    assert not (tmp_path / "run").exists()
    # A dry run of a launch for GPUs is checked where the job will run (a login node has none): no refusal.
    code, _, err = run_mabn(
        ["segment", "--data", str(data), "--backbone", "none", "--gpus", "2", "--dry-run", "--", *TINY], capsys
    )
    assert code == 0, err[-2000:]


def test_the_dry_run_names_a_taken_folder_and_the_datas_problems_at_once(data, tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / runs.METRICS).write_text("step\n")  # another run's log
    code, _, err = run_mabn(_segment(data, run, "--data.init_args.global_batch_size", "8", dry_run=True), capsys)
    assert code == 2
    assert [line.split(":")[1].strip() for line in _errors(err)] == [
        f"{run} already holds a run",
        "4 training images, fewer than the global batch 8",
    ], err[-2000:]


def test_a_warm_up_longer_than_the_run_is_a_line_of_the_plan(data, tmp_path, capsys):
    code, out, err = run_mabn(_segment(data, tmp_path / "run", dry_run=True), capsys)  # 2 steps, 3 warm-up epochs
    assert code == 0, err
    assert "warning: the warm-up (3 iterations) is not shorter than the run (2 iterations)" in out, out
    code, out, err = run_mabn(
        _segment(data, tmp_path / "run", "--model.init_args.warmup_epochs", "1", dry_run=True), capsys
    )
    assert code == 0 and "warning: the warm-up" not in out, out
