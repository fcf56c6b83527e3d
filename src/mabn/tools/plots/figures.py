"""The figures: per-layer normalization statistics (the paper's Figures 2, 5 and 6) and training curves.

Matplotlib runs on the Agg backend (files only, no display). Each figure is a column of panels over the
optimizer step; a MABN2d layer's panels are shaded by its phase (batch statistics, moving averages,
renormalized), so the effect of each switch on the statistics can be read off directly.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from matplotlib.ticker import FormatStrFormatter

from ...run import write_atomic
from .runlog import Series


@dataclass(frozen=True)
class Panel:
    """One axis: the statistics ``lines`` (key, legend label) of a layer, or metric names of a run."""

    title: str
    lines: tuple[tuple[str, str], ...]
    bounds: tuple[str, ...] = ()  # keys drawn dashed: clip limits rather than measured values


# MABN2d (norm/<layer>/...): l2 norms over channels as in the paper's figures, r and its clipping.
MABN_PANELS = (
    Panel("chi2 = E[x^2] (l2 norm over channels)", (("chi2_batch", "batch"), ("chi2_sma", "SMA"), ("chi2_ema", "EMA"))),
    Panel("psi = E[g z] in backward (l2 norm)", (("psi_batch", "batch"), ("psi_bar", "psi_bar (SMA)"))),
    Panel("renormalization r", (("r_mean", "mean r"),)),
    Panel("share of r at the clip bounds", (("r_clipped", "clipped"),)),
)
# BatchRenorm2d: batch statistics against the running ones, and r / d against their (ramped) limits.
BRN_PANELS = (
    Panel("mu (l2 norm over channels)", (("mu_batch", "batch"), ("mu_ema", "running"))),
    Panel("sigma (l2 norm over channels)", (("sigma_batch", "batch"), ("sigma_ema", "running"))),
    Panel("r", (("r_mean", "mean r"), ("rmax", "r_max")), bounds=("rmax",)),
    Panel("d", (("d_abs_mean", "mean |d|"), ("dmax", "d_max")), bounds=("dmax",)),
    Panel("share of r at the clip bounds", (("r_clipped", "clipped"),)),
)
# MABNCallback's phase: 0 batch statistics, 1 moving averages, 2 renormalized.
PHASES = {0: ("batch statistics", "#ececec"), 1: ("moving averages", "#d6e6f5"), 2: ("renormalized", "#fbe0c4")}
VAL_METRICS = ("val/miou", "val/top1", "val/top5", "val/pixel_acc", "val/majority_miou")
VAL_LABELS = {"val/majority_miou": "mIoU of the majority class (baseline)"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display, no GUI toolkit
    import matplotlib.pyplot as plt

    return plt


def layer_kind(stats: dict[str, Series]) -> tuple[str, tuple[Panel, ...]]:
    """The layer type a set of statistics keys comes from, and the panels drawn for it."""
    if "chi2_batch" in stats:
        return "MABN2d", MABN_PANELS
    if "mu_batch" in stats or "sigma_batch" in stats:
        return "BatchRenorm2d", BRN_PANELS
    return "norm layer", ()


def stats_panels(stats: dict[str, Series]) -> list[Panel]:
    """The panels with data for this layer; keys no panel knows get one each, so none is silently dropped."""
    _, spec = layer_kind(stats)
    panels = [p for p in spec if any(key in stats for key, _ in p.lines)]
    known = {key for p in spec for key, _ in p.lines} | {"phase"}
    panels += [Panel(key, ((key, key),)) for key in sorted(stats) if key not in known]
    return panels


def phase_spans(phase: Series) -> list[tuple[float, float, int]]:
    """(start, end, phase) intervals: each logged phase holds until the next logged step (runs merged)."""
    order = np.argsort(phase.steps, kind="stable")
    steps, values = phase.steps[order].astype(float), np.rint(phase.values[order]).astype(int)
    if len(steps) == 0:
        return []
    gap = float(np.median(np.diff(steps))) if len(steps) > 1 else 1.0
    ends = np.append(steps[1:], steps[-1] + gap)  # the last phase is drawn for one logging interval
    spans: list[tuple[float, float, int]] = []
    for start, end, value in zip(steps, ends, values):
        if spans and spans[-1][2] == value and spans[-1][1] == start:
            spans[-1] = (spans[-1][0], float(end), int(value))
        else:
            spans.append((float(start), float(end), int(value)))
    return spans


def _log_scale(ax, series: list[Series]) -> bool:
    """Log y when the values are positive and span more than two decades (psi often spans several)."""
    values = np.concatenate([s.values for s in series]) if series else np.array([])
    values = values[np.isfinite(values)]
    if len(values) and values.min() > 0 and values.max() / values.min() > 100:
        ax.set_yscale("log")
        return True
    return False


def _draw(ax, panel: Panel, data: dict[str, Series], markers: bool) -> None:
    drawn = []
    for key, label in panel.lines:
        if key not in data:
            continue
        s = data[key]
        style = {"linestyle": "--", "color": "0.4"} if key in panel.bounds else {"marker": "." if markers else None}
        ax.plot(s.steps, s.values, label=label, linewidth=1.2, markersize=4, **style)
        if key not in panel.bounds:
            drawn.append(s)
    if not _log_scale(ax, drawn):
        # Plain tick labels: matplotlib's shared "1e-5" offset label would sit on the panel title.
        ax.yaxis.set_major_formatter(FormatStrFormatter("%.3g"))
    ax.set_title(panel.title, fontsize=9, loc="left")
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3)
    if ax.get_lines():  # every panel says what it draws, a loss panel of val/loss alone too
        ax.legend(fontsize=7, loc="best")


def stats_figure(layer: str, stats: dict[str, Series], path: Path) -> Path:
    """One layer's statistics over the optimizer steps, shaded by phase when the layer logs one."""
    plt = _pyplot()
    kind, _ = layer_kind(stats)
    panels = stats_panels(stats)
    fig, axes = plt.subplots(len(panels), 1, sharex=True, figsize=(8, 1.9 * len(panels) + 0.9), squeeze=False)
    spans = phase_spans(stats["phase"]) if "phase" in stats else []
    few = max(len(s.steps) for s in stats.values()) <= 60  # markers only where single points stay visible
    for ax, panel in zip(axes[:, 0], panels):
        for start, end, phase in spans:
            ax.axvspan(start, end, color=PHASES.get(phase, ("", "#cccccc"))[1], linewidth=0, zorder=0)
        _draw(ax, panel, stats, markers=few)
    axes[-1, 0].set_xlabel("optimizer step", fontsize=9)
    fig.suptitle(f"{layer} ({kind})", fontsize=11)
    if spans:
        from matplotlib.patches import Patch

        seen = sorted({phase for _, _, phase in spans})
        handles = [Patch(color=PHASES.get(p, (f"phase {p}", "#cccccc"))[1]) for p in seen]
        labels = [PHASES.get(p, (f"phase {p}", ""))[0] for p in seen]
        fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.97), fontsize=8, ncol=len(seen))
    fig.tight_layout(rect=(0, 0, 1, 0.96 if spans else 0.97))
    return _save(fig, path)


def training_panels(metrics: dict[str, Series]) -> list[Panel]:
    """Loss, learning rate and validation metrics panels, for the columns this run has."""
    losses = sorted(k for k in metrics if k.startswith("train/") and "loss" in k) + [
        k for k in ("val/loss",) if k in metrics
    ]
    lrs = sorted(k for k in metrics if k.startswith("lr-") or k == "lr" or k.endswith("/lr"))
    vals = [k for k in VAL_METRICS if k in metrics]
    panels = [
        Panel("loss", tuple((k, k) for k in losses)),
        Panel("learning rate", tuple((k, k.removeprefix("lr-")) for k in lrs)),
        Panel("validation", tuple((k, VAL_LABELS.get(k, k)) for k in vals), bounds=("val/majority_miou",)),
    ]
    return [p for p in panels if p.lines]


def training_figure(metrics: dict[str, Series], path: Path) -> Path | None:
    """Training loss, learning rate(s) and validation metrics over the optimizer steps (None: none logged)."""
    panels = training_panels(metrics)
    if not panels:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(len(panels), 1, sharex=True, figsize=(8, 2.2 * len(panels) + 0.6), squeeze=False)
    for ax, panel in zip(axes[:, 0], panels):
        # Validation runs are few: mark each; the dense training curves stay plain lines.
        _draw(ax, panel, metrics, markers=panel.title == "validation")
    axes[-1, 0].set_xlabel("optimizer step", fontsize=9)
    fig.suptitle("training", fontsize=11)
    fig.tight_layout()
    return _save(fig, path)


def layer_file(layer: str) -> str:
    """File name for a layer's figure: module names are dotted, anything else is replaced."""
    return "stats-" + re.sub(r"[^\w.-]", "_", layer) + ".png"


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    plt.close(fig)
    return path
