"""``python -m mabn.bench norm|step|infer|all``: cost benchmarks, each ratio measured against BN in the same run.

norm: norm layers alone, forward+backward time and peak memory. step: a PSPNet-101 training step (forward,
backward, SGD) per norm, time and peak memory. infer: images per second of the folded PSPNet-101 per norm and
of the GroupNorm one. all: the three in one run, into one report (what `make bench` runs).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import torch

from ..files import write_text_atomic
from . import infer, norm, report, step

DEFAULT_REPEATS = {"norm": 15, "step": 5, "infer": 7}


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="python -m mabn.bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("what", choices=["norm", "step", "infer", "all"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--repeats",
        type=_positive,
        help="timed repeats (median reported); default: "
        + ", ".join(f"{k} {v}" for k, v in DEFAULT_REPEATS.items())
        + "; with all, applies to each",
    )
    parser.add_argument("--scale", type=float, default=1.0, help="norm: multiply every batch size (quick runs: 0.25)")
    parser.add_argument("--crop", type=_positive, default=512, help="step: square training crop")
    parser.add_argument("--batch", type=_positive, default=2, help="step: images per step (a multiple of 2)")
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
    if args.batch % step.NORM_BATCH_SIZE:
        parser.error(f"--batch must be a multiple of {step.NORM_BATCH_SIZE}, got {args.batch}")
    device = torch.device(args.device)
    if args.cuda_graph and device.type != "cuda":
        parser.error(f"--cuda-graph needs a CUDA device, got --device {args.device}")
    if args.threads:
        torch.set_num_threads(args.threads)
    size = (args.size[0], args.size[1])
    env = report.header(device)
    print(env, flush=True)

    def repeats(what: str) -> int:
        return args.repeats or DEFAULT_REPEATS[what]

    sections: list[str] = []
    step_rows: list[step.StepRow] = []
    infer_rows: list[infer.InferRow] = []
    if args.what in ("norm", "all"):
        table = norm.run(device, repeats=repeats("norm"), scale=args.scale)
        sections.append(table if args.what == "norm" else f"### Norm layers alone\n\n{table}")
    if args.what in ("step", "all"):
        step_rows = step.run(device, repeats("step"), args.crop, args.batch, cuda_graph=args.cuda_graph)
        sections.append(step.table(step_rows, repeats("step"), args.crop, args.batch, args.cuda_graph))
    if args.what in ("infer", "all"):
        infer_rows = infer.run(device, repeats("infer"), size)
        sections.append(infer.table(infer_rows, repeats("infer"), size))
    print()
    print("\n\n".join(sections))

    out = args.out
    if out is None and args.what != "norm":
        stem = ("bench" if args.what == "all" else f"bench-{args.what}") + ("-graph" if args.cuda_graph else "")
        out = Path("docs") / f"{stem}-{device.type}.md"
    if out is None:
        return
    if args.what == "norm":  # the table alone, as this command always wrote it
        write_text_atomic(out, sections[0] + "\n")
        return
    command = shlex.join(["python", "-m", "mabn.bench", *argv])
    md, png = report.write(out, device, command, sections, step_rows, infer_rows, env)
    print(f"\nwrote {md}" + (f" and {png}" if png else ""))


if __name__ == "__main__":
    main()
