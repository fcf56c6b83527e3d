"""``python -m mabn plots RUN_DIR [--out DIR]``: per-layer normalization statistics (the MABN paper's Figures 2, 5,
6) and training curves of a run, as PNG files, from the run's CSV log; prints each file's path."""

from __future__ import annotations

from pathlib import Path

from ...cli.help import command_parser
from . import PlotError, find_metrics, render


def main(argv: list[str]) -> int:
    parser = command_parser("plots", __doc__)
    parser.add_argument(
        "run", type=Path, help="a run folder (e.g. runs/cityscapes/mabn), a folder above runs, or a metrics.csv"
    )
    parser.add_argument("--out", type=Path, help="where to write the PNG files (default: <run>/plots)")
    args = parser.parse_args(argv)
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        raise PlotError(f"--out {args.out}: not a folder")
    metrics_csv, found = find_metrics(args.run)
    if len(found) > 1:
        print(f"{len(found)} CSV logs under {args.run}; plotting the latest, {metrics_csv}")
    else:
        print(f"Plotting {metrics_csv}")
    run_dir = args.run if args.run.is_dir() else args.run.parent
    for path in render(metrics_csv, args.out if args.out is not None else run_dir / "plots"):
        print(f"wrote {path}")
    return 0
