"""Norm-layer benchmark: forward+backward time and peak memory of each norm that normalizes over a batch (MABN2d,
BatchRenorm2d, and any registered with a ``steady_state``) vs BatchNorm2d."""

from __future__ import annotations

import torch
from torch import nn

from ...norm import NORMS, create_norm
from ...norm.factory import norms_where
from .measure import environment, median_times, peak_memory
from .workloads import BASELINE

# (where the shape occurs, N, C, H, W, norm_batch_size): ResNet-101 pre-training at 224 px with 32
# images per device (ghost batches of 2 as in the recipe), PSPNet-101 at a 512 px crop with 2 per device.
SHAPES = [
    ("resnet101 bn1", 32, 64, 112, 112, None),
    ("resnet101 layer1.0.bn1", 32, 64, 56, 56, None),
    ("resnet101 layer2.0.bn3", 32, 512, 28, 28, None),
    ("resnet101 layer3.0.bn2", 32, 256, 14, 14, None),
    ("resnet101 layer4.0.bn3", 32, 2048, 7, 7, None),
    ("resnet101 layer1.0.bn1, ghost 2", 32, 64, 56, 56, 2),
    ("resnet101 layer3.0.bn2, ghost 2", 32, 256, 14, 14, 2),
    ("pspnet layer3.0.bn3 (os 8)", 2, 1024, 64, 64, None),
    ("pspnet layer4.0.bn3 (os 8)", 2, 2048, 64, 64, None),
    ("pspnet ppm bottleneck", 2, 512, 64, 64, None),
]


def compared() -> tuple[str, ...]:
    """The norms measured against the baseline: those that normalize over a batch (ghost batches included) and
    that the benchmarks build (their entry's ``steady_state``), in registration order."""
    return norms_where(lambda entry: entry.batch and entry.steady_state is not None and entry.name != BASELINE)


def _layers(c: int, norm_batch_size: int | None) -> dict[str, nn.Module]:
    # Steady state from the first step (e.g. MABN's SMA and renormalization active: short warm-ups).
    layers = {BASELINE: create_norm(BASELINE, c)}
    for name in compared():
        layers[name] = create_norm(name, c, norm_batch_size=norm_batch_size, **NORMS[name].steady_state)
    return layers


def _step(layer: nn.Module, x: torch.Tensor, grad: torch.Tensor):
    def run() -> None:
        x.grad = None
        layer(x).backward(grad)

    return run


def run(device: torch.device, repeats: int = 15, shapes=SHAPES, scale: float = 1.0) -> str:
    """Measure every shape and return a markdown table of times and ratios to BatchNorm2d."""
    names = compared()
    columns = [f"{n.upper()} / BN time" for n in names] + [f"{n.upper()} / BN peak mem" for n in names]
    lines = [
        f"Norm layers, forward+backward, {environment(device)}; median of {repeats} interleaved repeats",
        "",
        f"| layer (N, C, H, W) | BN ms | {' | '.join(columns)} |",
        "|---|---|" + "---|" * len(columns),
    ]
    for where, n, c, h, w, nbs in shapes:
        group = nbs or 1  # ghost batches must stay whole
        n = max(round(n * scale / group), 1) * group
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(n, c, h, w, generator=gen).to(device).requires_grad_()
        grad = torch.randn(n, c, h, w, generator=gen).to(device)
        layers = {k: m.to(device).train() for k, m in _layers(c, nbs).items()}
        steps = {k: _step(m, x, grad) for k, m in layers.items()}
        times = median_times(steps, device, repeats)
        mem = {k: peak_memory(fn, device) for k, fn in steps.items()}
        ratios = [f"{times[k] / times[BASELINE]:.2f}" for k in names] + [f"{mem[k] / mem[BASELINE]:.3f}" for k in names]
        lines.append(f"| {where} ({n}, {c}, {h}, {w}) | {times[BASELINE] * 1e3:.2f} | {' | '.join(ratios)} |")
        print(lines[-1], flush=True)
    return "\n".join(lines)
