"""``python -m mabn plots``: finding a run's CSV log, reading its sparse columns, the figures, bad runs."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import pytorch_lightning as pl
from PIL import Image

from helpers.commands import run_mabn
from mabn.tools.plots import Series, figures, find_metrics, layer_statistics, read_metrics
from mabn.tools.plots.command import main

MABN_KEYS = ("chi2_batch", "chi2_sma", "chi2_ema", "psi_batch", "psi_bar", "r_mean", "r_clipped", "phase")
BRN_KEYS = ("mu_batch", "mu_ema", "sigma_batch", "sigma_ema", "r_mean", "r_clipped", "d_abs_mean", "rmax", "dmax")


def _write_run(save_dir: Path, version: int | None = None, stats: bool = True) -> Path:
    """A stage folder as a fit writes it: a CSVLogger log with MABNCallback-style statistics every 4 steps
    (phases 0, 1, 2), training losses and learning rate on other steps, two validations."""
    logger = pl.loggers.CSVLogger(save_dir, name="csv", version=version)
    for step in range(0, 24, 4):
        if stats:
            phase = 0.0 if step < 8 else 1.0 if step < 16 else 2.0
            mabn = {k: 10.0 + step for k in MABN_KEYS} | {"phase": phase, "psi_batch": 1e-5 * (step + 1)}
            logger.log_metrics({f"norm/model.encoder.layer1.0.bn1/{k}": v for k, v in mabn.items()}, step=step)
            logger.log_metrics({f"norm/model.aux.1/{k}": 1.0 + step for k in BRN_KEYS}, step=step)
        logger.log_metrics({"lr-SGD/pg1": 0.01 / (step + 1)}, step=step + 1)
        logger.log_metrics({"train/loss": 3.0 - 0.1 * step, "epoch": step // 8}, step=step + 1)
    logger.log_metrics({"val/miou": 0.2, "val/majority_miou": 0.03}, step=11)
    logger.log_metrics({"val/miou": 0.4, "val/majority_miou": 0.03}, step=23)
    logger.save()
    return Path(logger.log_dir) / "metrics.csv"


@pytest.mark.slow  # draws every panel
def test_the_latest_version_is_found_from_the_stage_folder(tmp_path, capsys):
    for version in (2, 10, 9):  # 10 is the latest although "version_9" sorts after it as text
        _write_run(tmp_path / "runs" / "cityscapes", version=version)
    chosen, found = find_metrics(tmp_path / "runs" / "cityscapes")
    assert chosen == tmp_path / "runs" / "cityscapes" / "csv" / "version_10" / "metrics.csv"
    assert len(found) == 3
    version_dir = tmp_path / "runs" / "cityscapes" / "csv" / "version_2"
    assert find_metrics(version_dir)[0] == version_dir / "metrics.csv"
    assert find_metrics(version_dir / "metrics.csv")[0] == version_dir / "metrics.csv"

    assert main([str(tmp_path / "runs" / "cityscapes")]) == 0
    out = capsys.readouterr().out
    assert "3 CSV logs" in out and str(chosen) in out.splitlines()[0]


def test_sparse_columns_are_read_at_their_own_steps(tmp_path):
    metrics = read_metrics(_write_run(tmp_path))
    chi2 = metrics["norm/model.encoder.layer1.0.bn1/chi2_batch"]
    assert chi2.steps.tolist() == [0, 4, 8, 12, 16, 20] and chi2.values.tolist() == [10, 14, 18, 22, 26, 30]
    assert metrics["train/loss"].steps.tolist() == [1, 5, 9, 13, 17, 21]
    assert metrics["val/miou"].steps.tolist() == [11, 23] and "epoch" not in metrics and "step" not in metrics
    layers = layer_statistics(metrics)
    assert set(layers) == {"model.encoder.layer1.0.bn1", "model.aux.1"}  # dotted layer names kept whole
    assert set(layers["model.aux.1"]) == set(BRN_KEYS)


def test_every_layer_and_the_training_curves_are_written_by_default_under_the_run(tmp_path, capsys):
    run = tmp_path / "runs" / "cityscapes"
    _write_run(run)
    assert main([str(run)]) == 0
    expected = {"stats-model.encoder.layer1.0.bn1.png", "stats-model.aux.1.png", "training.png"}
    assert {p.name for p in (run / "plots").iterdir()} == expected
    printed = [line.removeprefix("wrote ") for line in capsys.readouterr().out.splitlines()[1:]]
    assert sorted(Path(p).name for p in printed) == sorted(expected)
    for name in expected:
        with Image.open(run / "plots" / name) as image:
            assert image.format == "PNG" and min(image.size) > 300


@pytest.mark.slow  # draws every panel; the default suite checks the files a run's plots write
def test_mabn_panels_draw_the_logged_values_over_phase_shading(tmp_path, monkeypatch):
    figs = {}
    monkeypatch.setattr(figures, "_save", lambda fig, path: figs.setdefault(path.name, fig) and path)
    monkeypatch.chdir(tmp_path)
    assert main([str(_write_run(tmp_path)), "--out", "out"]) == 0
    fig = figs["stats-model.encoder.layer1.0.bn1.png"]
    chi2, psi, r, clipped = fig.axes[:4]
    assert [line.get_label() for line in chi2.get_lines()] == ["batch", "SMA", "EMA"]
    assert chi2.get_lines()[0].get_xdata().tolist() == [0, 4, 8, 12, 16, 20]
    assert [line.get_label() for line in psi.get_lines()] == ["batch", "psi_bar (SMA)"]
    assert psi.get_yscale() == "log"  # psi spans more than two decades here
    assert len(chi2.patches) == 3  # one shaded span per phase: batch statistics, moving averages, renormalized
    legend = fig.legends[0]
    assert [t.get_text() for t in legend.get_texts()] == ["batch statistics", "moving averages", "renormalized"]
    brn = figs["stats-model.aux.1.png"]
    assert [ax.get_title(loc="left").split(" ")[0] for ax in brn.axes] == ["mu", "sigma", "r", "d", "share"]
    training = figs["training.png"]
    assert [ax.get_title(loc="left") for ax in training.axes] == ["loss", "learning rate", "validation"]
    assert training.axes[2].get_lines()[0].get_ydata().tolist() == [0.2, 0.4]


def test_phase_spans_hold_each_phase_until_the_next_logged_step():
    phase = Series(np.array([0, 4, 8, 12, 16]), np.array([0.0, 0.0, 1.0, 1.0, 2.0]))
    assert figures.phase_spans(phase) == [(0.0, 8.0, 0), (8.0, 16.0, 1), (16.0, 20.0, 2)]


def test_unknown_statistics_get_a_panel_of_their_own():
    stats = {k: Series(np.array([0]), np.array([1.0])) for k in ("chi2_batch", "chi2_ema", "new_stat")}
    titles = [p.title for p in figures.stats_panels(stats)]
    assert titles == [figures.MABN_PANELS[0].title, "new_stat"]


@pytest.mark.parametrize("case", ["missing", "empty_dir", "no_stats", "bad_value"])
def test_unplottable_runs_fail_with_one_line_naming_the_path(tmp_path, capsys, case):
    run = tmp_path / "run"
    if case == "empty_dir":
        run.mkdir()
    elif case == "no_stats":
        _write_run(run, stats=False)
    elif case == "bad_value":
        csv_file = _write_run(run)
        csv_file.write_text(csv_file.read_text().replace("0.2", "n/a", 1))
    code, _, err = run_mabn(["plots", str(run)], capsys)
    assert code == 2
    err = err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and str(run) in err[0]
    if case == "no_stats":
        assert "norm/<layer>/<statistic>" in err[0]
    if case == "bad_value":
        assert "line " in err[0]
    assert not (run / "plots").exists()


@pytest.mark.slow  # draws every panel
def test_plotting_leaves_the_working_directory_alone(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    _write_run(run)
    before = set(os.listdir(tmp_path))
    assert main([str(run), "--out", str(tmp_path / "figs")]) == 0
    assert set(os.listdir(tmp_path)) == before | {"figs"}
