"""``mabn.run.loggers.TensorBoardLogger`` beside the recipes' loggers: added with ``--trainer.logger+``, its events go
into the run's folder like ``metrics.csv``; without the tensorboard package the run stops with one error line.
The test of the events themselves needs tensorboard (its reader) and is skipped without it."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from helpers.cli_tiny import CONFIG
from helpers.wandb_reader import wandb_session
from mabn.cli import launch
from mabn.cli.config import place_run
from mabn.cli.lightning import run_cli
from mabn.run import loggers

TENSORBOARD = "mabn.run.loggers.TensorBoardLogger"
ADD_TENSORBOARD = ["--trainer.logger+", TENSORBOARD]


def _fit(tmp_path: Path, request, monkeypatch, capsys, *args: str) -> tuple[int, Path, str]:
    """(exit code, run folder, stderr) of ``python -m mabn fit`` of the tiny task with ``args``, in this process."""
    from mabn.__main__ import main

    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # cli_tiny, for the CLI's class paths
    folder = tmp_path / "run"
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(CONFIG.format(root=folder))
    monkeypatch.chdir(tmp_path)
    wandb_session(request, monkeypatch, "disabled")
    capsys.readouterr()
    try:
        code = main(["fit", "--config", str(cfg), *args])
    except SystemExit as exit_info:
        code = exit_info.code
    return code or 0, folder, capsys.readouterr().err


def test_a_stage_launch_places_the_tensorboard_logger_in_its_run_folder(tmp_path, monkeypatch):
    """Appended after the recipe's loggers, it gets the run's folder as they do, and the stage and dataset the
    launch passes stay the WandbLogger's."""
    monkeypatch.setattr(loggers, "TENSORBOARD_INSTALLED", True)  # the dry run's check; nothing is built
    monkeypatch.chdir(tmp_path)
    args = launch.build_args("cityscapes", None, "mabn", 0, 1, ADD_TENSORBOARD, dry_run=True)
    config = run_cli(args, dry_run=True).config
    folder = tmp_path / "runs" / "cityscapes" / "mabn"
    place_run(config, folder)
    entries = {entry.class_path: entry.init_args for entry in config.trainer.logger}
    assert list(entries) == ["mabn.run.loggers.CSVLogger", "mabn.run.loggers.WandbLogger", TENSORBOARD]
    assert {init_args.save_dir for init_args in entries.values()} == {str(folder)}
    assert (entries[TENSORBOARD].name, entries[TENSORBOARD].version) == ("", "")
    assert entries["mabn.run.loggers.WandbLogger"].stage == "cityscapes" and "stage" not in entries[TENSORBOARD]


def test_without_tensorboard_the_fit_stops_with_one_error_line(tmp_path, request, monkeypatch, capsys):
    # As on a machine without the package, whether or not this one has it.
    monkeypatch.setattr(loggers, "TENSORBOARD_INSTALLED", False)
    code, folder, err = _fit(tmp_path, request, monkeypatch, capsys, "--trainer.max_epochs", "1", *ADD_TENSORBOARD)
    assert code == 2
    assert err.strip().splitlines()[-1] == (
        f"error: {TENSORBOARD} needs the tensorboard package, which is not installed: "
        "pip install 'mabn[tensorboard]' (or tensorboard)"
    )
    assert not folder.exists()  # stopped before the run took its folder


def test_a_fit_writes_its_scalars_as_tensorboard_events_in_the_run_folder(tmp_path, request, monkeypatch, capsys):
    """Two epochs, then a resume to four: the events of both processes lie in the run's folder itself, and
    together hold every value of ``metrics.csv`` at its step."""
    event_accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator",
        reason="the tensorboard package is not installed (pip install 'mabn[tensorboard]')",
    )
    for epochs in ("2", "4"):
        args = ["--trainer.max_epochs", epochs, "--ckpt_path", "auto", *ADD_TENSORBOARD]
        code, folder, err = _fit(tmp_path, request, monkeypatch, capsys, *args)
        assert code == 0, err[-3000:]

    events = sorted(folder.rglob("events.out.tfevents.*"))
    assert len(events) == 2 and all(path.parent == folder for path in events), events
    scalars: dict[str, dict[int, float]] = {}
    loss_steps = []  # the training steps of each file: each process logged its own epochs
    for path in events:
        reader = event_accumulator.EventAccumulator(str(path))
        reader.Reload()
        for tag in reader.Tags()["scalars"]:
            scalars.setdefault(tag, {}).update({event.step: event.value for event in reader.Scalars(tag)})
        loss_steps.append({event.step for event in reader.Scalars("train/loss")})
    assert all(loss_steps) and not loss_steps[0] & loss_steps[1]
    assert "hp_metric" not in scalars

    with open(folder / "metrics.csv", newline="") as file:
        rows = list(csv.DictReader(file))
    for key in ("train/loss", "val/acc"):
        expected = {int(row["step"]): float(row[key]) for row in rows if row.get(key)}
        assert expected and scalars[key].keys() == expected.keys(), key
        assert all(scalars[key][step] == pytest.approx(value, rel=1e-6) for step, value in expected.items()), key
