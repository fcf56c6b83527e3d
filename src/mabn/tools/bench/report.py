"""The benchmark report: a markdown file with the environment in its header, and a PNG bar chart beside it."""

from __future__ import annotations

import importlib.metadata
import os
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ...run import write_atomic, write_text_atomic
from .measure import environment

if TYPE_CHECKING:  # the rows' modules build the models, which a bare GPU machine's check may lack
    from .infer import InferRow
    from .step import StepRow


def header(device: torch.device) -> str:
    """Device, threads and library versions, plus the CPU load: timings on a shared machine need it."""
    versions = ", ".join(
        f"{name} {importlib.metadata.version(name)}" for name in ("torchvision", "segmentation-models-pytorch")
    )
    line = f"{environment(device)}, {versions}"
    if hasattr(os, "getloadavg"):
        line += f"; 1-min load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs at the start"
    return line


def chart(path: Path, title: str, step_rows: list[StepRow], infer_rows: list[InferRow]) -> Path:
    """A bar chart of every ratio to BN (1.0 = BN), one panel per measured quantity."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display, no GUI toolkit
    import matplotlib.pyplot as plt

    panels = []
    if step_rows:
        panels.append(("training step time / BN", [r.norm for r in step_rows], [r.time_ratio for r in step_rows]))
        panels.append(("training peak memory / BN", [r.norm for r in step_rows], [r.mem_ratio for r in step_rows]))
    if infer_rows:
        panels.append(("inference time / folded BN", [r.model for r in infer_rows], [r.time_ratio for r in infer_rows]))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8), squeeze=False)
    for ax, (name, labels, values) in zip(axes[0], panels):
        bars = ax.bar(labels, values, color=["#7f7f7f" if lab.startswith("bn") else "#1f77b4" for lab in labels])
        ax.bar_label(bars, fmt="%.2f")
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
        ax.set_title(name, fontsize=10)
        ax.set_ylim(0, max(values) * 1.18)
        ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    fig.suptitle(textwrap.fill(title, 140), fontsize=8)
    fig.tight_layout()
    write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    plt.close(fig)
    return path


def write(
    out: Path,
    device: torch.device,
    command: str,
    sections: list[str],
    step_rows: list[StepRow],
    infer_rows: list[InferRow],
    env: str,
    title: str = "Measured cost per norm",
) -> tuple[Path, Path | None]:
    """Write ``out`` (markdown: ``title``, command, environment, sections) and, when there are ratios to plot, the
    PNG chart beside it with the same stem; returns both paths."""
    png = out.with_suffix(".png") if step_rows or infer_rows else None
    lines = [f"## {title} ({device.type.upper()})", "", f"`{command}`", "", env, ""]
    for section in sections:
        lines += [section, ""]
    if png is not None:
        chart(png, env, step_rows, infer_rows)
        lines += [f"![ratios to BN]({png.name})", ""]
    write_text_atomic(out, "\n".join(lines))
    return out, png
