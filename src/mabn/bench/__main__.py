"""``python -m mabn.bench norm|step|infer|all``: cost benchmarks, each ratio measured against BN in the same run.

norm: norm layers alone, forward+backward time and peak memory. step: a training step (forward, backward, SGD)
per norm, time and peak memory, of PSPNet-101 or of ResNet-50 (--model), eager and with --compile also compiled.
infer: images per second of the folded PSPNet-101 per norm and of the GroupNorm one. all: the three in one run,
into one report (what `make bench` runs). check (CUDA): the PSPNet-101 step at crop 712 CUDA-graphed, then eager
beside compiled (``--compile``, default reduce-overhead), then at crop 512 CUDA-graphed and eager, into
docs/bench-cuda.md, rewritten as each ends (what `make gpu-check` runs after the GPU tests).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from ..files import write_text_atomic
from . import infer, norm, report, step

DEFAULT_REPEATS = {"norm": 15, "step": 5, "infer": 7, "check": 10}
# check: (crop, CUDA graphs, compiled) in the order they run. The recipe's crop 712 first, CUDA graphs (seconds
# to set up) before compiling (minutes for PSPNet-101, longer with MABN), and the report rewritten after each,
# so that a check cut short by a GPU session's end keeps what it measured.
CHECK_PLAN = ((712, True, False), (712, False, True), (512, True, False), (512, False, False))


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _norm_batch(text: str) -> int | None:
    return None if text == "whole" else _positive(text)


def run_check(
    device: torch.device,
    repeats: int,
    batch: int,
    compile_mode: str,
    sections: list[str],
    save: Callable[[list[step.StepRow]], tuple[Path, Path | None]],
) -> None:
    """The sections of CHECK_PLAN in order, each appended to ``sections`` and saved as it ends, by ``save(chart
    rows)``: the chart shows the compiled section's rows once measured, else the first section's."""
    chart: list[step.StepRow] = []
    for crop, graphed, compiled in CHECK_PLAN:
        mode = compile_mode if compiled else None
        rows = step.run(device, repeats, crop, batch, cuda_graph=graphed, compile_mode=mode)
        sections.append(step.table(rows, repeats, crop, batch, graphed, compile_mode=mode))
        if mode or not chart:
            chart = rows
        md, _ = save(chart)
        print(f"check: {len(sections)} of {len(CHECK_PLAN)} sections measured, wrote {md}", flush=True)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="python -m mabn.bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("what", choices=["norm", "step", "infer", "all", "check"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--repeats",
        type=_positive,
        help="timed repeats (median reported); default: "
        + ", ".join(f"{k} {v}" for k, v in DEFAULT_REPEATS.items())
        + "; with all, applies to each",
    )
    parser.add_argument("--scale", type=float, default=1.0, help="norm: multiply every batch size (quick runs: 0.25)")
    parser.add_argument("--crop", type=_positive, default=512, help="step: square training crop (image size)")
    parser.add_argument("--model", choices=list(step.MODELS), default="pspnet101", help="step: the network")
    parser.add_argument("--batch", type=_positive, default=2, help="step: images per step (a multiple of --norm-batch)")
    parser.add_argument(
        "--norm-batch",
        type=_norm_batch,
        default=step.NORM_BATCH_SIZE,
        metavar="N|whole",
        help=f"step: BRN and MABN normalize ghost batches of N images, or the whole batch (default "
        f"{step.NORM_BATCH_SIZE})",
    )
    parser.add_argument(
        "--compile",
        nargs="?",
        const="default",
        metavar="MODE",
        help="step: also time bn and mabn through torch.compile in this mode (default: torch's default)",
    )
    parser.add_argument(
        "--cuda-graph", action="store_true", help="step: replay each model's forward and backward as CUDA graphs"
    )
    parser.add_argument(
        "--size", type=_positive, nargs=2, default=[512, 1024], metavar=("H", "W"), help="infer: image size"
    )
    parser.add_argument(
        "--threads", type=_positive, help="CPU threads for torch (default: torch's own choice, one per core)"
    )
    parser.add_argument(
        "--out",
        type=Path,
        help="markdown report, with the PNG chart beside it (default: docs/bench-<device>.md for all, "
        "docs/bench-<what>-<device>.md for step and infer; norm writes only when given)",
    )
    args = parser.parse_args(argv)
    if args.norm_batch and args.batch % args.norm_batch:
        parser.error(f"--batch must be a multiple of {args.norm_batch}, got {args.batch}")
    device = torch.device(args.device)
    if (args.cuda_graph or args.what == "check") and device.type != "cuda":
        what = "--cuda-graph" if args.cuda_graph else "check"
        parser.error(f"{what} needs a CUDA device, got --device {args.device}")
    if args.threads:
        torch.set_num_threads(args.threads)
    size = (args.size[0], args.size[1])
    env = report.header(device)
    print(env, flush=True)

    def repeats(what: str) -> int:
        return args.repeats or DEFAULT_REPEATS[what]

    out = args.out
    if out is None and args.what != "norm":
        stem = "bench" if args.what in ("all", "check") else f"bench-{args.what}"
        if args.what != "check":  # check has one report, whatever its options
            if args.model != "pspnet101":
                stem += f"-{args.model}-" + (f"ghost{args.norm_batch}" if args.norm_batch else "whole")
            stem += ("-graph" if args.cuda_graph else "") + ("-compile" if args.compile else "")
        out = Path("docs") / f"{stem}-{device.type}.md"
    command = shlex.join(["python", "-m", "mabn.bench", *argv])
    sections: list[str] = []
    step_rows: list[step.StepRow] = []
    infer_rows: list[infer.InferRow] = []

    def save(chart: list[step.StepRow]) -> tuple[Path, Path | None]:
        assert out is not None  # every command but norm has a report
        return report.write(out, device, command, sections, chart, infer_rows, env)

    if args.what in ("norm", "all"):
        table = norm.run(device, repeats=repeats("norm"), scale=args.scale)
        sections.append(table if args.what == "norm" else f"### Norm layers alone\n\n{table}")
    if args.what in ("step", "all"):
        workload = {"model": args.model, "norm_batch_size": args.norm_batch, "compile_mode": args.compile}
        step_rows = step.run(device, repeats("step"), args.crop, args.batch, cuda_graph=args.cuda_graph, **workload)
        sections.append(step.table(step_rows, repeats("step"), args.crop, args.batch, args.cuda_graph, **workload))
    if args.what == "check":
        run_check(device, repeats("check"), args.batch, args.compile or "reduce-overhead", sections, save)
    if args.what in ("infer", "all"):
        infer_rows = infer.run(device, repeats("infer"), size)
        sections.append(infer.table(infer_rows, repeats("infer"), size))
    print()
    print("\n\n".join(sections))

    if out is None or args.what == "check":  # check wrote its report as each section ended
        return
    if args.what == "norm":  # the table alone, as this command always wrote it
        write_text_atomic(out, sections[0] + "\n")
        return
    md, png = save(step_rows)
    print(f"\nwrote {md}" + (f" and {png}" if png else ""))


if __name__ == "__main__":
    main()
