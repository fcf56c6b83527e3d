"""``python -m mabn bench norm|step|infer|all|ops|memory``: cost benchmarks, each ratio measured against BN in the
same run, and the training memory against its estimate (``memory``, with options of its own: ``python -m mabn bench
memory --help``, ``mabn.tools.bench.memory``).

norm: norm layers alone, forward+backward time and peak memory. step: a training step (forward, backward, SGD)
per norm, time and peak memory, of PSPNet-101, of stage 1's ResNet-101 or of ResNet-50 (--model), eager and with
--compile also compiled. infer: images per second of the folded PSPNet-101 per norm and of the GroupNorm one. all:
the three in one run, into one report (what `make bench` runs). ops: the host work of one norm layer's training
forward and backward, the GPU eager step's bottleneck at small batches: ATen operators and Triton launches
counted, host time on a tiny input (on the CPU through MABN's CUDA path, see ``mabn.tools.bench.ops``).
Reports go to runs/bench/ (``--out``: another folder, e.g. ``--out docs``, or a file).
--dry-run: check the options, print what would be measured (models, rows, sizes, repeats) and the report's path,
measure and write nothing; --cuda-graph is planned for CUDA anywhere. (The GPU check of a whole run is a tool of
the checkout: ``make gpu-check``, scripts/gpu/check.py.)
"""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Callable
from pathlib import Path

import torch

from ...cli.help import PROG, HelpFormatter, positive
from ...run import write_text_atomic
from ...tasks.cudagraph import GRAPH_SEGMENTS
from . import norm, ops, report, workloads

REPORTS = Path("runs/bench")  # where reports go unless --out names another place
DEFAULT_REPEATS = {"norm": 15, "step": 5, "infer": 7, "ops": 1000}


def _norm_batch(text: str) -> int | None:
    return None if text == "whole" else positive(text)


def report_path(args: argparse.Namespace, device: torch.device) -> Path | None:
    """The report of the command: under runs/bench/ by its default name, or ``--out`` (a markdown file, or a folder
    that gets the default name); None for norm and ops without ``--out``, which then only print their table."""
    if args.out is None and args.what in ("norm", "ops"):
        return None
    if args.out is not None and args.out.suffix == ".md":
        return args.out
    stem = "bench" if args.what == "all" else f"bench-{args.what}"
    if args.what not in ("norm", "ops"):  # these have one report each, whatever the step options
        if args.model != "pspnet101":
            stem += f"-{args.model}-" + (f"ghost{args.norm_batch}" if args.norm_batch else "whole")
        stem += ("-graph" if args.cuda_graph else "") + ("-stages" if args.graph_segments == "stages" else "")
        stem += "-compile" if args.compile else ""
    return (args.out or REPORTS) / f"{stem}-{device.type}.md"


def plan(
    args: argparse.Namespace,
    device: torch.device,
    size: tuple[int, int],
    repeats: Callable[[str], int],
    out: Path | None,
    command: str,
) -> list[str]:
    """What ``command`` would measure and write (``--dry-run``), one line per section."""
    here = "" if device.type != "cuda" or torch.cuda.is_available() else " (assumed by --dry-run: no CUDA device here)"
    threads = f", {args.threads} CPU thread(s)" if args.threads else ""
    lines = [f"dry run of {command}: nothing is measured or written", f"device: {device}{here}{threads}"]
    groups = f"ghost batches of {args.norm_batch}" if args.norm_batch else "the whole batch"

    def step_line(crop: int, graphed: bool, compile_mode: str | None, precision: str | None = None) -> str:
        how = (
            f", CUDA graphs ({args.graph_segments})"
            if graphed
            else f", eager and compiled ({compile_mode})"
            if compile_mode
            else ", eager"
        )
        how += f", {precision}" if precision else ""
        from . import step  # the step and infer benchmarks build the models: imported where they run

        what = f"crop {crop}x{crop}" if args.model == "pspnet101" else f"{crop}x{crop} px"
        rows = ", ".join(step.row_names(compile_mode, args.model))
        return (
            f"training step: {workloads.MODELS[args.model]}, batch {args.batch}, {what}, BRN and MABN over {groups}"
            f"{how}; rows {rows}; {repeats('step')} repeats"
        )

    if args.what in ("norm", "all"):
        scale = f" x batch scale {args.scale}" if args.scale != 1.0 else ""
        names = ", ".join((norm.BASELINE, *norm.compared()))
        lines.append(f"norm layers alone: {len(norm.SHAPES)} shapes{scale}, {names}; {repeats('norm')} repeats")
    if args.what in ("step", "all"):
        lines.append(step_line(args.crop, args.cuda_graph, args.compile))
    if args.what == "ops":
        lines.append(f"host work per norm layer: input {'x'.join(map(str, ops.SHAPE))}; {repeats('ops')} repeats")
    if args.what in ("infer", "all"):
        from . import infer

        models = ", ".join(infer.label(n) for n in infer.models())
        lines.append(f"inference: 1x3x{size[0]}x{size[1]}, {models}; {repeats('infer')} repeats")
    if out is None:
        lines.append(f"report: printed only ({args.what} writes a file with --out)")
    elif args.what in ("norm", "ops"):
        lines.append(f"report: {out}")
    else:
        lines.append(f"report: {out} and its chart {out.with_suffix('.png')}")
    return lines


def main(argv: list[str]) -> int:
    if argv[:1] == ["memory"]:  # options of its own (``mabn.tools.bench.memory``)
        from . import memory

        return memory.main(argv[1:])
    parser = argparse.ArgumentParser(prog=f"{PROG} bench", description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("what", choices=["norm", "step", "infer", "all", "ops"])
    parser.add_argument(
        "--device",
        help="torch device (default: cuda when present, else cpu; with --dry-run, cuda for --cuda-graph)",
    )
    parser.add_argument(
        "--repeats",
        type=positive,
        help="timed repeats (median reported); default: "
        + ", ".join(f"{k} {v}" for k, v in DEFAULT_REPEATS.items())
        + "; with all, applies to each",
    )
    parser.add_argument("--scale", type=float, default=1.0, help="norm: multiply every batch size (quick runs: 0.25)")
    parser.add_argument("--crop", type=positive, default=512, help="step: square training crop (image size)")
    parser.add_argument("--model", choices=list(workloads.MODELS), default="pspnet101", help="step: the network")
    parser.add_argument("--batch", type=positive, default=2, help="step: images per step (a multiple of --norm-batch)")
    parser.add_argument(
        "--norm-batch",
        type=_norm_batch,
        default=workloads.NORM_BATCH_SIZE,
        metavar="N|whole",
        help=f"step: BRN and MABN normalize ghost batches of N images, or the whole batch (default "
        f"{workloads.NORM_BATCH_SIZE})",
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
        "--graph-segments",
        choices=GRAPH_SEGMENTS,
        default="whole",
        help="step, with --cuda-graph: capture each model whole or per stage (graph_segments) (default: whole)",
    )
    parser.add_argument(
        "--size", type=positive, nargs=2, default=[512, 1024], metavar=("H", "W"), help="infer: image size"
    )
    parser.add_argument(
        "--threads", type=positive, help="CPU threads for torch (default: torch's own choice, one per core)"
    )
    parser.add_argument(
        "--out",
        type=Path,
        help="the markdown report (step, infer, all: with a PNG chart beside it), or a folder for it (default: "
        "runs/bench/, as "
        "bench-<device>.md for all, bench-<what>-<device>.md for the others; norm and ops write only when "
        "given). --out docs: the reports the docs quote",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="check the options and print the plan; measure and write nothing"
    )
    args = parser.parse_args(argv)
    if args.norm_batch and args.batch % args.norm_batch:
        parser.error(f"--batch must be a multiple of {args.norm_batch}, got {args.batch}")
    if args.device is None:  # a dry run plans --cuda-graph for the GPU machine it is meant for
        args.device = "cuda" if torch.cuda.is_available() or (args.dry_run and args.cuda_graph) else "cpu"
    device = torch.device(args.device)
    if args.cuda_graph and device.type != "cuda":
        parser.error(f"--cuda-graph needs a CUDA device, got --device {args.device}")
    if args.graph_segments != "whole" and not args.cuda_graph:
        parser.error(f"--graph-segments {args.graph_segments} needs --cuda-graph")

    def repeats(what: str) -> int:
        return args.repeats or DEFAULT_REPEATS[what]

    size = (args.size[0], args.size[1])
    out = report_path(args, device)
    command = shlex.join([*PROG.split(), "bench", *argv])
    if args.dry_run:
        shown = shlex.join([*PROG.split(), "bench", *(a for a in argv if a != "--dry-run")])
        print("\n".join(plan(args, device, size, repeats, out, shown)))
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.what in ("step", "infer", "all"):
        # They build the models (smp): imported here, so that the GPU check runs on a machine without them.
        from . import infer, step
    env = report.header(device)
    print(env, flush=True)
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
        graphs = {"cuda_graph": args.cuda_graph, "graph_segments": args.graph_segments}
        step_rows = step.run(device, repeats("step"), args.crop, args.batch, **graphs, **workload)
        sections.append(step.table(step_rows, repeats("step"), args.crop, args.batch, **graphs, **workload))
    if args.what == "ops":
        sections.append(ops.run(device, repeats=repeats("ops")))
    if args.what in ("infer", "all"):
        infer_rows = infer.run(device, repeats("infer"), size)
        sections.append(infer.table(infer_rows, repeats("infer"), size))
    print()
    print("\n\n".join(sections))

    if out is None:
        return 0
    if args.what in ("norm", "ops"):  # the table alone
        write_text_atomic(out, sections[0] + "\n")
        return 0
    md, png = save(step_rows)
    print(f"\nwrote {md}" + (f" and {png}" if png else ""))
    return 0
