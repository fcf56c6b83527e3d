"""Figures of a run from its CSV log: ``python -m mabn plots RUN_DIR [--out DIR]`` (``make plots RUN=...``).

Per logged norm layer, the statistics of the paper's Figures 2, 5 and 6 (MABN2d: chi2 of the batch against
its SMA and EMA, psi of the batch against psi_bar, r and its clipping, shaded by phase; BatchRenorm2d: batch
against running statistics, r and d against their limits), and the training curves (loss, learning rate,
validation metrics).
"""

from __future__ import annotations

from pathlib import Path

from .figures import layer_file, stats_figure, training_figure
from .runlog import STATS_PREFIX, PlotError, Series, find_metrics, layer_statistics, read_metrics

__all__ = ["PlotError", "Series", "find_metrics", "read_metrics", "layer_statistics", "render"]


def render(metrics_csv: Path, out: Path) -> list[Path]:
    """Write the statistics figure of every logged layer and the training figure to ``out``; the files.

    Raises PlotError when the log holds no per-layer statistics: the run had no MABN2d/BatchRenorm2d
    layer, or MABNCallback's ``log_every_n_steps`` was 0.
    """
    metrics = read_metrics(metrics_csv)
    layers = layer_statistics(metrics)
    if not layers:
        raise PlotError(
            f"no {STATS_PREFIX}<layer>/<statistic> columns in {metrics_csv}: the run has no MABN2d/BatchRenorm2d "
            "layer, or MABNCallback's log_every_n_steps is 0"
        )
    written = [stats_figure(layer, stats, out / layer_file(layer)) for layer, stats in sorted(layers.items())]
    training = training_figure(metrics, out / "training.png")
    return written + ([training] if training is not None else [])
