"""``python -m mabn.bench norm``: benchmarks, each ratio measured against BatchNorm in the same run."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from . import norm


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m mabn.bench", description=__doc__)
    parser.add_argument("what", choices=["norm"], help="norm: norm layers forward+backward time and peak memory")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=15, help="timed repeats per layer (median reported)")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every batch size (quick runs: 0.25)")
    parser.add_argument("--out", type=Path, help="also write the markdown table to this file")
    args = parser.parse_args(argv)
    table = norm.run(torch.device(args.device), repeats=args.repeats, scale=args.scale)
    print()
    print(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
