"""A run's steps: one step number for one event (the optimizer steps done) in the console, the checkpoint names,
metrics.csv and the plots; a logging cadence that fits the run (at most an epoch's optimizer steps, for the training
rows and the norm statistics alike, unless set), and progress lines that show a short run whose output is a file."""

from __future__ import annotations

import csv
import re
import warnings
from pathlib import Path

import pytest

from helpers.commands import run_mabn
from helpers.own_dataset import bands
from mabn.tools.plots import figures
from mabn.tools.plots.command import main as plots


def _rows(folder: Path) -> list[dict[str, str]]:
    with open(folder / "metrics.csv", newline="") as file:
        return list(csv.DictReader(file))


def _steps(rows: list[dict[str, str]], key: str) -> list[int]:
    return [int(row["step"]) for row in rows if row.get(key)]


def test_the_console_the_checkpoint_names_and_metrics_csv_name_one_step(segment_run):
    """The session's segment fit (2 steps of 1 an epoch, one validation at the end): the console's validation,
    its checkpoint and its metrics.csv row are all at step 2; the training rows and the norm statistics of the
    step-1 and step-2 batches are at steps 1 and 2, the trainer's log_every_n_steps (unset) lowered to the epoch's
    one step."""
    assert re.findall(r"Validation at step (\d+)", segment_run.output) == ["2"]
    names = sorted(p.name for p in (segment_run.folder / "checkpoints").glob("step*.ckpt"))
    assert [re.match(r"step(\d+)-", name).group(1) for name in names] == ["2"], names
    rows = _rows(segment_run.folder)
    assert _steps(rows, "val/miou") == [2]
    assert [row["epoch"] for row in rows if row.get("val/miou")] == ["1"]
    assert _steps(rows, "train/loss") == [1, 2]
    assert _steps(rows, "norm/model.encoder.layer1.0.bn1/chi2_batch") == [1, 2]


@pytest.mark.slow  # 40 steps of PSPNet on ResNet-18 at crop 32 on the CPU: ~1 min
def test_a_40_step_run_of_2_steps_an_epoch_logs_plots_and_prints_its_steps(tmp_path, capsys, monkeypatch):
    """40 steps on 8 images in batches of 4, no cadence set: a training row at every second step at least, norm
    statistics at more than one step, a legend on every panel of training.png, and about 20 progress lines on an
    output that is not a terminal."""
    data = bands(tmp_path / "data", train=8)
    run = tmp_path / "run"
    argv = ["segment", "--data", str(data), "--norm", "mabn", "--backbone", "none", "--run-dir", str(run), "--",
            "--data.init_args.global_batch_size", "4", "--data.init_args.num_workers", "0",
            "--data.init_args.crop_size", "32", "--model.init_args.arch", "resnet18",
            "--model.init_args.log_predictions_every_n_epochs", "0", "--trainer.max_steps", "40",
            "--trainer.check_val_every_n_epoch", "10", "--trainer.num_sanity_val_steps", "0",
            "--trainer.logger", "mabn.run.loggers.CSVLogger", "--trainer.logger.save_dir", str(run)]  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code, out, err = run_mabn(argv, capsys)
    assert code == 0, err[-3000:]
    assert not [w for w in caught if "logging interval" in str(w.message)]  # the cadence fits the epoch
    rows = _rows(run)
    trained = _steps(rows, "train/loss")
    assert trained[-1] == 40 and all(b - a <= 2 for a, b in zip([0, *trained], trained)), trained
    stats = _steps(rows, "norm/model.encoder.layer1.0.bn1/chi2_batch")
    assert len(stats) > 1 and stats[-1] >= 39, stats
    progress = [line for line in out.splitlines() if re.match(r"step \d+/40 ", line)]
    assert 15 <= len(progress) <= 25, out[-3000:]

    figs = {}
    monkeypatch.setattr(figures, "_save", lambda fig, path: figs.setdefault(path.name, fig) and path)
    assert plots([str(run), "--out", str(tmp_path / "plots")]) == 0
    for ax in figs["training.png"].axes:
        labels = [line.get_label() for line in ax.get_lines()]
        assert ax.get_legend() is not None, ax.get_title(loc="left")
        assert [t.get_text() for t in ax.get_legend().get_texts()] == labels
    chi2 = figs["stats-model.encoder.layer1.0.bn1.png"].axes[0].get_lines()[0]
    assert chi2.get_xdata().tolist() == stats
