"""A run's CSV metrics as series: where Lightning's CSVLogger put ``metrics.csv``, and its columns by name.

The CSV log is the one every run writes (the wandb run may be offline, disabled or elsewhere), so the
figures are drawn from it. Each logging call is one row holding only the metrics of that call, so every
column is read as its own series of (optimizer step, value) pairs over the rows where it has a value.
"""

from __future__ import annotations

import csv
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ...errors import UserError

STATS_PREFIX = "norm/"  # MABNCallback's per-layer statistics: norm/<layer>/<key>
_VERSION = re.compile(r"version_(\d+)$")


class PlotError(UserError):
    """A run that cannot be plotted; the message names the path (and the column or line) at fault."""


@dataclass(frozen=True)
class Series:
    """One metric: the optimizer steps it was logged at and its values, in logging order."""

    steps: np.ndarray
    values: np.ndarray


def find_metrics(path: Path) -> tuple[Path, list[Path]]:
    """The ``metrics.csv`` to plot for ``path``, and every one found there.

    ``path`` may be the file itself, a run folder (``runs/<stage>/<norm>``, which holds ``metrics.csv``) or
    any folder above runs (``runs/<stage>``). With several logs the latest is chosen: the highest
    ``version_N`` of Lightning's own CSVLogger folders, then the newest file.
    """
    if path.is_file():
        return path, [path]
    if not path.is_dir():
        raise PlotError(f"no such run directory: {path}")
    if (path / "metrics.csv").is_file():
        return path / "metrics.csv", [path / "metrics.csv"]
    found = [p for p in path.rglob("metrics.csv") if "plots" not in p.relative_to(path).parts]
    if not found:
        raise PlotError(f"no metrics.csv under {path} (expected the run folder's metrics.csv)")
    found.sort(key=_version_order)
    return found[-1], found


def _version_order(path: Path) -> tuple[int, float]:
    match = _VERSION.search(path.parent.name)
    return (int(match.group(1)) if match else -1, path.stat().st_mtime)


def read_metrics(path: Path) -> dict[str, Series]:
    """Every column of a CSVLogger ``metrics.csv`` but ``step`` and ``epoch``, as a series over ``step``."""
    with open(path, newline="") as file:
        reader = csv.DictReader(file)
        if not reader.fieldnames or "step" not in reader.fieldnames:
            raise PlotError(f"{path} has no 'step' column: not a Lightning CSVLogger metrics file")
        points: dict[str, tuple[list[int], list[float]]] = {}
        for line, row in enumerate(reader, start=2):  # line 1 is the header
            step_text = row.get("step")
            if not step_text:
                continue
            try:
                step = int(float(step_text))
                for name, text in row.items():
                    if name in ("step", "epoch") or name is None or not text:
                        continue
                    steps, values = points.setdefault(name, ([], []))
                    steps.append(step)
                    values.append(float(text))
            except ValueError as err:
                raise PlotError(f"{path}, line {line}: not a number ({err})") from None
    return {name: Series(np.asarray(s), np.asarray(v, dtype=float)) for name, (s, v) in points.items()}


def layer_statistics(metrics: dict[str, Series]) -> dict[str, dict[str, Series]]:
    """The ``norm/<layer>/<key>`` columns grouped by layer (layer names hold dots, keys no slash)."""
    layers: dict[str, dict[str, Series]] = {}
    for name, series in metrics.items():
        if name.startswith(STATS_PREFIX) and "/" in name[len(STATS_PREFIX) :]:
            layer, key = name[len(STATS_PREFIX) :].rsplit("/", 1)
            layers.setdefault(layer, {})[key] = series
    return layers
