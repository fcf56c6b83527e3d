"""``python -m mabn plots RUN_DIR [--out DIR]``: per-layer normalization statistics (the MABN paper's Figures 2, 5,
6) and training curves of a run, as PNG files, from the run's CSV log; prints each file's path."""

from __future__ import annotations

from pathlib import Path

from ..errors import UserError
from ..plots import find_metrics, render
from . import command_parser, fail


def main(argv: list[str]) -> int:
    parser = command_parser("plots", __doc__)
    parser.add_argument(
        "run", type=Path, help="a run folder (e.g. runs/cityscapes/mabn), a folder above runs, or a metrics.csv"
    )
    parser.add_argument("--out", type=Path, help="where to write the PNG files (default: <run>/plots)")
    args = parser.parse_args(argv)
    try:
        metrics_csv, found = find_metrics(args.run)
        if len(found) > 1:
            print(f"{len(found)} CSV logs under {args.run}; plotting the latest, {metrics_csv}")
        else:
            print(f"Plotting {metrics_csv}")
        run_dir = args.run if args.run.is_dir() else args.run.parent
        for path in render(metrics_csv, args.out if args.out is not None else run_dir / "plots"):
            print(f"wrote {path}")
    except (UserError, OSError) as err:  # OSError: e.g. an --out folder that cannot be written
        return fail(str(err))
    return 0
