"""Inference benchmark: images per second of the folded PSPNet-101 per norm, and of the GroupNorm one."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ...norm import NORMS, BatchRenorm2d, MABN2d, fold_norms
from .measure import median_times
from .step import benched, build
from .workloads import BASELINE


def models() -> tuple[str, ...]:
    """The benched norms, those linear at inference (folded) first: every ratio is to folded BN. A norm that
    cannot fold (GN: per-sample statistics) runs as is."""
    names = benched()
    return (*(n for n in names if NORMS[n].linear), *(n for n in names if not NORMS[n].linear))


@dataclass(frozen=True)
class InferRow:
    """One model's median time per forward, and as a ratio to the folded BN model's."""

    model: str
    seconds: float
    images_per_second: float
    time_ratio: float


def calibrate(model: nn.Module, images: torch.Tensor) -> None:
    """Set every running statistic to that of ``images`` in one training-mode forward, as in a trained model.

    A fresh model's statistics (mean 0, variance 1) do not normalize anything, so its eval activations grow
    ~1e6-fold through the 100 layers: values no deployed model computes with.
    """
    saved = {}
    for m in model.modules():
        if isinstance(m, (nn.BatchNorm2d, BatchRenorm2d, MABN2d)):
            saved[m] = m.momentum
            # torch's momentum is the weight of the new value, BRN's and MABN's that of the old one.
            m.momentum = 1.0 if isinstance(m, nn.BatchNorm2d) else 0.0
    with torch.no_grad():
        model.train()(images)
    for m, momentum in saved.items():
        m.momentum = momentum


def build_inference(norm: str, num_classes: int = 19) -> nn.Module:
    """The eval model deployed for ``norm``, statistics calibrated: ``fold_norms`` of it, except for GN (eval)."""
    model = build(norm, num_classes)
    calibrate(model, torch.randn(2, 3, 128, 256, generator=torch.Generator().manual_seed(1)))
    return fold_norms(model) if NORMS[norm].linear else model.eval()


def label(norm: str) -> str:
    return f"{norm} (folded)" if NORMS[norm].linear else norm


def _forward(model: nn.Module, images: torch.Tensor) -> Callable[[], None]:
    def forward() -> None:
        with torch.inference_mode():
            model(images)

    return forward


def run(
    device: torch.device, repeats: int = 7, size: tuple[int, int] = (512, 1024), num_classes: int = 19
) -> list[InferRow]:
    """Median time of one forward of a 1x3xHxW image per model over ``repeats`` interleaved rounds
    (after three warm-up rounds), all on the same image."""
    images = torch.randn(1, 3, *size, generator=torch.Generator().manual_seed(0)).to(device)
    forwards = {}
    names = models()
    for norm in names:
        torch.manual_seed(0)
        forwards[norm] = _forward(build_inference(norm, num_classes).to(device), images)
    times = median_times(forwards, device, repeats, warmup=3)
    rows = [InferRow(label(n), times[n], 1.0 / times[n], times[n] / times[BASELINE]) for n in names]
    for row in rows:
        print(f"inference {row.model}: {row.images_per_second:.3f} images/s, {row.time_ratio:.3f} x BN", flush=True)
    return rows


def table(rows: list[InferRow], repeats: int, size: tuple[int, int]) -> str:
    """The markdown section for ``rows``."""
    lines = [
        f"### Inference: 1x3x{size[0]}x{size[1]}, eval mode under `torch.inference_mode`",
        "",
        f"Median of {repeats} interleaved repeats after three warm-up rounds. Folded: `fold_norms` merged every "
        "BN / BRN / MABN into its conv (and centred the MABN convs), leaving the same network for all three; "
        "GN keeps its norm layers.",
        "",
        "| model | s / image | images / s | time / folded BN |",
        "|---|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r.model} | {r.seconds:.3f} | {r.images_per_second:.3f} | {r.time_ratio:.3f} |")
    return "\n".join(lines)
