"""``python -m mabn plots RUN_DIR [--out DIR]``: render a run's figures to PNG files and print each path."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import PlotError, find_metrics, render


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mabn plots",
        description="Per-layer normalization statistics (the MABN paper's Figures 2, 5, 6) and training curves "
        "of a run, as PNG files, from the run's CSV log.",
    )
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
    except PlotError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # e.g. an --out folder that cannot be written
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
