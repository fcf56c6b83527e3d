"""``python -m mabn bench memory``: the peak memory of stage 2's training step on the CPU, measured against the
estimate a run plans its per-device batch with (``mabn.run.memory``), and the measurement of that estimate's table.

Each point (encoder, norm, crop, images) runs in a process of its own, so that nothing another point allocated
stays in its memory: it builds the recipe's network (``configs/cityscapes.yaml``: PSPNet, its norm options and
normalization batch) and its SGD, centred as the task keeps them (``keep_centred``), and trains ``STEPS`` steps in
Lightning's order (gradients set to None, forward, the main and auxiliary losses, backward, step) on random
images. Its peak is the process's peak resident set (``VmHWM``, reset once the libraries are imported) above its
resident set at that moment: what the training adds to a process that has imported them, as a run's budget counts
it (``MemAvailable`` read by a process that has).

``--table`` measures ``ACTIVATION_BYTES``: for each encoder and norm family, the activations' bytes per pixel and
image as the slope of the peak between ``TABLE_POINTS`` (the fixed part, the parameters', drops out), printed as
the table's lines. Without it the report holds the estimate (fixed + activations) against the peak measured at
``--crops`` (other crops than the table's) for ``--archs``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from ...cli.help import PROG, HelpFormatter, positive

STEPS = 4  # the peak settles within the first steps: momentum exists from the second, the allocator's pools by then
TABLE_POINTS = ((128, 2), (192, 4))  # (crop, images) of --table: activations far above the allocator's noise
REPORT_CROPS = (160, 224)  # the report's crops, neither of the table's
REPORT_ARCHS = ("resnet18", "resnet50", "resnet101")
REPORT = Path("runs/bench/bench-memory-cpu.md")


@dataclass(frozen=True)
class Point:
    """One measured training step: encoder ``arch``, norm, a square crop and the images per step."""

    arch: str
    norm: str
    crop: int
    batch: int

    @property
    def pixels(self) -> int:
        return self.crop * self.crop * self.batch


@dataclass(frozen=True)
class Measured:
    """A point's peak above the process before the network (bytes), and the network's parameters and buffers."""

    point: Point
    peak: int
    params: int
    buffer_bytes: int


def _status(key: str) -> int:
    """A byte count of /proc/self/status (``VmRSS``, ``VmHWM``)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(f"{key}:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {key}")


def _step_once(point: Point, steps: int) -> dict:
    """Measure ``point`` in this process (``python -m mabn.tools.bench.memory``): the peak resident set of
    ``steps`` training steps above the resident set before the network is built."""
    import torch
    import torch.nn.functional as F
    import yaml

    from ...cli.launch import CONFIGS
    from ...data.classes import IGNORE_INDEX
    from ...models import build_segmentation_model
    from ...norm.cenconv import keep_centred

    recipe = yaml.safe_load((CONFIGS / "cityscapes.yaml").read_text())["model"]["init_args"]
    torch.manual_seed(0)
    start = _status("VmRSS")
    # 5 resets the peak to the current resident set (Linux's clear_refs); where it is refused the peak also holds
    # the imports', which the resident set after them bounds.
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    model = build_segmentation_model(
        "pspnet",
        19,
        point.norm,
        recipe["norm_batch_size"] if point.norm != "gn" else None,
        recipe["norm_options"],
        point.arch,
        recipe["dropout"],
    ).train()
    params = [p for p in model.parameters() if p.requires_grad]
    sgd = torch.optim.SGD(params, lr=0.01, momentum=recipe["momentum"], weight_decay=recipe["weight_decay"])
    keep_centred(model, sgd)
    images = torch.randn(point.batch, 3, point.crop, point.crop)
    labels = torch.randint(0, 19, (point.batch, point.crop, point.crop))
    for _ in range(steps):
        sgd.zero_grad(set_to_none=True)
        out, aux = model(images)
        loss = F.cross_entropy(out, labels, ignore_index=IGNORE_INDEX)
        (loss + recipe["aux_weight"] * F.cross_entropy(aux, labels, ignore_index=IGNORE_INDEX)).backward()
        sgd.step()
    return {
        "peak": _status("VmHWM") - start,
        "params": sum(p.numel() for p in params),
        "buffer_bytes": sum(b.numel() * b.element_size() for b in model.buffers()),
    }


def measure(point: Point, steps: int = STEPS, threads: int | None = None) -> Measured:
    """``point`` measured in a process of its own (``threads``: torch's CPU threads there)."""
    env = dict(os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {}))
    done = subprocess.run(
        [sys.executable, "-m", __name__, json.dumps({"point": asdict(point), "steps": steps})],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if done.returncode:
        raise RuntimeError(f"measuring {point}: exit {done.returncode}\n{done.stderr[-2000:]}")
    found = json.loads(done.stdout.strip().splitlines()[-1])
    return Measured(point, found["peak"], found["params"], found["buffer_bytes"])


def slope(low: Measured, high: Measured) -> int:
    """Bytes per pixel and image between two points of one network: the rise of the peak over the rise of the
    pixels the step holds."""
    return round((high.peak - low.peak) / (high.point.pixels - low.point.pixels))


def table_lines(archs: list[str], norms: list[str], steps: int, threads: int | None) -> list[str]:
    """``ACTIVATION_BYTES``'s lines, measured: one per encoder and norm family, with its two peaks."""
    from ...norm import norm_entry

    lines = []
    for arch in archs:
        for norm in norms:
            low, high = (measure(Point(arch, norm, c, b), steps, threads) for c, b in TABLE_POINTS)
            family = norm_entry(norm).family
            mb = f"{low.peak / 1e6:.0f} and {high.peak / 1e6:.0f} MB"
            lines.append(f'    ("{arch}", "{family}"): {slope(low, high)},  # peaks {mb}')
            print(lines[-1], flush=True)
    return lines


def report_section(archs: list[str], norm: str, crops: list[int], batch: int, steps: int, threads: int | None) -> str:
    """The report's table: per network and crop, the estimate's parts, the measured peak and their ratio."""
    from ...norm import norm_entry
    from ...run.memory import activation_bytes, estimate

    family = norm_entry(norm).family
    rows = [
        "| encoder | crop | images | parameters | estimate: fixed + activations | measured peak "
        "| estimate / measured |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    ratios = []
    for arch in archs:
        for crop in crops:
            found = measure(Point(arch, norm, crop, batch), steps, threads)
            guess = estimate(found.params, found.buffer_bytes, activation_bytes(arch, family), crop, batch)
            ratios.append(guess.total / found.peak)
            rows.append(
                f"| {arch} | {crop} | {batch} | {found.params / 1e6:.1f} M | {guess.fixed / 1e6:.0f} + "
                f"{guess.activations / 1e6:.0f} = {guess.total / 1e6:.0f} MB | {found.peak / 1e6:.0f} MB | "
                f"{ratios[-1]:.2f} |"
            )
            print(rows[-1], flush=True)
    about = (
        f"PSPNet on each encoder with {norm}, the recipe's norm options and normalization batch; {steps} training "
        f"steps of {batch} random images per point, each point in a process of its own. Measured: the process's "
        "peak resident set (VmHWM) above its resident set once torch and the product are imported. Estimate: "
        "`mabn.run.memory.estimate`, 12 bytes per parameter (weights, gradients, momentum) and the buffers, plus "
        f'`ACTIVATION_BYTES[(encoder, "{family}")]` bytes per pixel and image, measured at crops '
        f"{' and '.join(f'{c} x {b} images' for c, b in TABLE_POINTS)} (`--table`). Estimate / measured from "
        f"{min(ratios):.2f} to {max(ratios):.2f}."
    )
    return about + "\n\n" + "\n".join(rows)


def report_path(out: Path | None) -> Path:
    """The report: ``out`` (a markdown file, or a folder that gets ``REPORT``'s name), else ``REPORT``."""
    out = out or REPORT
    return out if out.suffix == ".md" else out / REPORT.name


def plan_lines(args: argparse.Namespace, argv: list[str]) -> list[str]:
    """What the command would measure and write (``--dry-run``)."""
    shown = shlex.join([*PROG.split(), "bench", "memory", *(a for a in argv if a != "--dry-run")])
    each = f"{args.steps} training steps per point, each in a process of its own"
    if args.table:
        points = " and ".join(f"crop {c} x {b} images" for c, b in TABLE_POINTS)
        return [
            f"dry run of {shown}: nothing is measured or written",
            f"table: {', '.join(args.archs)} with {', '.join(args.norms)}, at {points}; {each}",
            "output: the lines of mabn.run.memory.ACTIVATION_BYTES, printed",
        ]
    return [
        f"dry run of {shown}: nothing is measured or written",
        f"report: {', '.join(args.archs)} with {args.norm} at crops {', '.join(map(str, args.crops))} of "
        f"{args.batch} images; {each}",
        f"report: {report_path(args.out)}",
    ]


def main(argv: list[str]) -> int:
    from ...norm.factory import norms_where

    parser = argparse.ArgumentParser(prog=f"{PROG} bench memory", description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--archs", nargs="+", default=list(REPORT_ARCHS), help="the encoders measured")
    parser.add_argument("--norm", default="mabn", help="the report's norm")
    families = list(norms_where(lambda entry: entry.cost_family is None))  # a norm measured under its own name
    parser.add_argument("--norms", nargs="+", default=families, help="--table: the norms")
    parser.add_argument("--crops", type=positive, nargs="+", default=list(REPORT_CROPS), help="the report's crops")
    parser.add_argument("--batch", type=positive, default=2, help="the report's images per step")
    parser.add_argument("--steps", type=positive, default=STEPS, help="training steps per point")
    parser.add_argument("--threads", type=positive, help="CPU threads for torch in each point's process")
    parser.add_argument("--table", action="store_true", help="measure ACTIVATION_BYTES and print its lines")
    parser.add_argument(
        "--out", type=Path, help=f"the markdown report, or a folder for it (default {REPORT}; --out docs for the docs')"
    )
    parser.add_argument("--dry-run", action="store_true", help="print what would be measured; measure nothing")
    args = parser.parse_args(argv)
    if args.dry_run:
        print("\n".join(plan_lines(args, argv)))
        return 0
    if args.table:
        table_lines(args.archs, args.norms, args.steps, args.threads)
        return 0
    import torch

    from . import report

    out = report_path(args.out)
    cpu = torch.device("cpu")
    env = report.header(cpu)
    section = report_section(args.archs, args.norm, args.crops, args.batch, args.steps, args.threads)
    command = shlex.join([*PROG.split(), "bench", "memory", *argv])
    report.write(out, cpu, command, [section], [], [], env, title="Peak training memory against its estimate")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":  # one point, in a process of its own (``measure``)
    request = json.loads(sys.argv[1])
    print(json.dumps(_step_once(Point(**request["point"]), request["steps"])))
