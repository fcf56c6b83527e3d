"""The ablation's figures: the training curves beside the final errors, and the paper's statistics
figures at small scale from the probed runs of the first seed.

(c) Curves: the training loss of BN(32), BN(2) and MABN(2) over the steps (mean over seeds of a running
mean), which shows whether the rows have levelled off, beside every row's final validation error per seed.

(a) Figure 2: the l2 norm over channels of mu_B, sigma^2_B, g_B and psi_B of one BN layer over the
iterations, normalization batch 2 (ghost BN) against 32 (BN). (b) Figures 5 and 6: chi^2 and psi of the
same layer with the modified normalization: a batch of 2 against the regular batch of 32 in the modified
BN(2) run (Figure 5), and MABN's SMA over 2 + 30 samples against the regular batch in the MABN(2) run
(Figure 6). The regular statistic of (b) is that of the step's whole gradient batch in the same run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from ...run import write_atomic

SMALL, REGULAR = "#1f77b4", "#ff7f0e"  # the paper's colours: blue for the small batch, orange for 32
# Which run each figure needs (row keys); these runs are probed on the first seed.
FIGURE2_ROWS = {"small": "bn2", "regular": "bn32"}
FIGURE56_ROWS = {"batch": "mbn2", "sma": "mabn2"}
PROBED_ROWS = frozenset({*FIGURE2_ROWS.values(), *FIGURE56_ROWS.values()})
CURVE_ROWS = {"bn32": REGULAR, "bn2": SMALL, "mabn2": "#2ca02c"}  # the rows whose training curves are drawn

Records = list[dict[str, float]]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display, no GUI toolkit
    import matplotlib.pyplot as plt

    return plt


def _line(ax, records: Records, key: str, color: str, label: str) -> None:
    ax.plot([r["step"] for r in records], [r[key] for r in records], color=color, linewidth=0.7, label=label)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    write_atomic(path, lambda scratch: fig.savefig(scratch, dpi=110, format="png"))
    _pyplot().close(fig)
    return path


def running_mean(values: Sequence[float], window: int) -> list[float]:
    """The mean of the last ``window`` values at each position (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def curves(
    losses: dict[str, list[list[float]]],
    errors: dict[str, list[float]],
    labels: dict[str, str],
    path: Path,
) -> Path | None:
    """Left: training loss of the CURVE_ROWS in ``losses`` (row key -> one loss list per seed), running
    mean over 5 % of the steps, mean over the seeds that ran all steps. Right: the final validation error
    of every row in ``errors`` (row key -> one per seed, NaN for a diverged seed), each seed a dot and
    the mean a bar. None when nothing ran."""
    if not errors:
        return None
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.2), gridspec_kw={"width_ratios": [3, 2]})
    for key, color in CURVE_ROWS.items():
        runs = [run for run in losses.get(key, []) if run]
        steps = max((len(run) for run in runs), default=0)
        full = [running_mean(run, max(1, steps // 20)) for run in runs if len(run) == steps]
        if full:
            mean = [sum(values) / len(full) for values in zip(*full)]
            left.plot(range(1, steps + 1), mean, color=color, label=f"{labels[key]} ({len(full)} seeds)")
    left.set(xlabel="step", ylabel="training loss (running mean)", title="Training loss", yscale="log")
    left.legend(fontsize=8)
    keys = list(errors)
    for i, key in enumerate(keys):
        finite = [e for e in errors[key] if math.isfinite(e)]
        color = CURVE_ROWS.get(key, "grey")
        if finite:
            right.barh(i, sum(finite) / len(finite), color=color, alpha=0.35)
        right.plot(finite, [i] * len(finite), "o", color=color, markersize=4)
    right.set_yticks(range(len(keys)), [labels[k] for k in keys], fontsize=8)
    right.invert_yaxis()
    right.set(xlabel="top-1 validation error % (dots: seeds, bar: mean)", title="Final error")
    return _save(fig, path)


def figure2(stats: dict[str, Records], layer: str, path: Path) -> Path | None:
    """Figure 2 from the BN(2) and BN(32) records in ``stats`` (by row key); None when neither ran.

    Top: a normalization batch of the BN(2) run against the batch of the BN(32) run. Bottom (with the
    BN(2) run): the same network's statistics over a batch of 2 and over its whole gradient batch of 32,
    which separates the sampling noise of 2 samples from the difference between the two trained networks.
    """
    small, regular = stats.get(FIGURE2_ROWS["small"]), stats.get(FIGURE2_ROWS["regular"])
    if not small and not regular:
        return None
    plt = _pyplot()
    panels = (("mu", "mu_B"), ("var", "sigma^2_B"), ("g", "g_B = mean(dL/dy)"), ("psi", "psi_B = mean(dL/dy * y)"))
    fig, axes = plt.subplots(2 if small else 1, 4, figsize=(15, 6.6 if small else 3.4), squeeze=False)
    for ax, (key, title) in zip(axes[0], panels):
        if small:
            _line(ax, small, key, SMALL, "BN(2) run, |B| = 2")
        if regular:
            _line(ax, regular, key, REGULAR, "BN(32) run, |B| = 32")
        ax.set_title(f"{title}, l2 norm over channels", fontsize=9)
    if small:
        for ax, (key, title) in zip(axes[1], panels):
            _line(ax, small, key, SMALL, "|B| = 2")
            _line(ax, small, f"{key}_regular", REGULAR, "whole gradient batch, 32")
            ax.set_title(f"{title} within the BN(2) run", fontsize=9)
    for ax in axes.flat:
        ax.set_xlabel("iteration")
        ax.legend(fontsize=8)
    fig.suptitle(f"Batch statistics of {layer} during training (paper Figure 2)", fontsize=10)
    return _save(fig, path)


def figure56(stats: dict[str, Records], layer: str, path: Path) -> Path | None:
    """Figures 5 and 6 from the modified BN(2) and MABN(2) records in ``stats``; None when neither ran."""
    runs = [
        (FIGURE56_ROWS["batch"], "batch", "|B| = 2", "modified BN(2), batch statistics (paper Figure 5)"),
        (FIGURE56_ROWS["sma"], "used", "SMA (2 + 30)", "MABN(2) (paper Figure 6)"),
    ]
    runs = [(stats[key], *rest) for key, *rest in runs if stats.get(key)]
    if not runs:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(len(runs), 2, figsize=(11, 3.2 * len(runs)), squeeze=False)
    for ax_row, (records, which, label, title) in zip(axes, runs):
        for ax, stat in zip(ax_row, ("chi2", "psi")):
            _line(ax, records, f"{stat}_{which}", SMALL, label)
            _line(ax, records, f"{stat}_regular", REGULAR, "|B| = 32")
            moving_from = next((r["step"] for r in records if r["moving"]), None)
            if which == "used" and moving_from is not None:
                ax.axvline(moving_from, color="grey", linestyle="--", linewidth=0.8, label="SMA from here")
            ax.set_title(f"{title}: {stat}, l2 norm over channels", fontsize=9)
            ax.set_xlabel("iteration")
            ax.legend(fontsize=8)
    fig.suptitle(f"chi^2 and psi of {layer}", fontsize=10)
    return _save(fig, path)
