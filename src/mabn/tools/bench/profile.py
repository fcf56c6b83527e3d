"""Where a training step's device time goes, norm by norm: a few eager steps under ``torch.profiler``, each kernel's
time summed per step, the kernels ranked by the time they cost the norm that spends most on them.

A ratio MABN / BN that misses its target says how much; this table says which kernels make the difference (on a
GPU the CUDA kernels, Triton's by their function names; on the CPU the ATen operators, which is how the tests run
it). Eager, so that every kernel is seen by itself: CUDA graphs replay the same kernels as one launch.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from .measure import sync

NORMS = ("bn", "mabn")
SHOWN = 20  # kernels in the table; the rest are summed in its last row but one


@dataclass(frozen=True)
class KernelTimes:
    """One norm's kernels: per short name, (calls, microseconds) per step, and all of them summed per step."""

    norm: str
    kernels: dict[str, tuple[float, float]]
    total_us: float


def short_name(name: str) -> str:
    """A kernel's name without its return type, template arguments and parameters: ``void
    at::native::batch_norm_backward_kernel<float, ...>(...)`` -> ``at::native::batch_norm_backward_kernel``."""
    name = re.sub(r"^void ", "", name.strip())
    return re.split(r"[<(]", name, maxsplit=1)[0].strip() or name


def kernel_times(norm: str, step: Callable[[], None], device: torch.device, steps: int = 3) -> KernelTimes:
    """``step`` run ``steps`` times under the profiler: on CUDA each kernel's device time, elsewhere each operator's
    own host time, per step."""
    cuda = device.type == "cuda"
    sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        sync(device)
    kernels: dict[str, list[float]] = {}
    for event in prof.key_averages():
        if cuda and event.device_type != DeviceType.CUDA:
            continue  # an operator's own device time is its kernels', which are rows of their own
        spent = event.self_device_time_total if cuda else event.self_cpu_time_total
        if spent <= 0:
            continue
        calls_us = kernels.setdefault(short_name(event.key), [0.0, 0.0])
        calls_us[0] += event.count / steps
        calls_us[1] += spent / steps
    return KernelTimes(norm, {k: (v[0], v[1]) for k, v in kernels.items()}, sum(v[1] for v in kernels.values()))


def run(
    device: torch.device, model: str, batch: int, crop: int, steps: int = 3, say: Callable[[str], None] = print
) -> list[KernelTimes]:
    """Each of ``NORMS`` profiled on ``model``'s eager training step at ``batch`` x ``crop``."""
    from . import step  # here: it builds the models, which the check's dry run and kernel section need not

    out = []
    for norm in NORMS:
        times = kernel_times(norm, step.training_step(norm, device, model, batch, crop), device, steps)
        say(f"profile {norm}: {times.total_us / 1000:.2f} ms of {'kernels' if device.type == 'cuda' else 'operators'}"
            " a step")  # fmt: skip
        out.append(times)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def table(results: Sequence[KernelTimes], title: str, device: torch.device) -> str:
    """The Markdown: the costliest kernels by the most any norm spends on them, the rest, the total and its ratio
    to the first norm's (BN's)."""
    what = "kernel" if device.type == "cuda" else "operator"
    names = sorted(
        {k for r in results for k in r.kernels}, key=lambda k: -max(r.kernels.get(k, (0, 0))[1] for r in results)
    )
    head = " | ".join(f"{r.norm} calls | {r.norm} µs" for r in results)
    lines = [f"| {what} | {head} |", "|---|" + "---:|" * (2 * len(results))]

    def cells(pick: Callable[[KernelTimes], tuple[float, float]]) -> str:
        return " | ".join(f"{c:.0f} | {us:.0f}" for c, us in map(pick, results))

    for name in names[:SHOWN]:
        lines.append(f"| `{name}` | {cells(lambda r, n=name: r.kernels.get(n, (0.0, 0.0)))} |")
    rest = names[SHOWN:]
    if rest:
        lines.append(f"| {len(rest)} others | " + cells(lambda r: _summed(r, rest)) + " |")
    lines.append("| all | " + cells(lambda r: _summed(r, names)) + " |")
    base = results[0].total_us
    ratios = ", ".join(f"{r.norm} {r.total_us / base:.3f}" for r in results[1:])
    return (
        f"### Where the step's time goes: {title}\n\n"
        f"Per step, the mean of 3 eager steps under `torch.profiler` on {device.type.upper()}: each {what}'s calls "
        f"and own time in µs. All {what}s' time against {results[0].norm}'s: {ratios}.\n\n" + "\n".join(lines)
    )


def _summed(result: KernelTimes, names: Sequence[str]) -> tuple[float, float]:
    picked = [result.kernels[n] for n in names if n in result.kernels]
    return sum(c for c, _ in picked), sum(us for _, us in picked)
