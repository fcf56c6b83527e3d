"""``python -m mabn ablation``: the paper's ImageNet ablation (Tables 2 and 6) at small scale.

Trains one small ResNet per row and seed with the same loop (gradient batch 32, normalization batch 2
through ghost batches; seeds paired across rows), writes the table of validation errors with each row's
paired difference to BN(32) (confidence interval, paired t-test) beside the paper's numbers to
<out>/ablation.md, the run outcomes and training losses to <out>/results.json, the training curves beside
the final errors to <out>/curves.png, the per-step statistics of layer1.0.bn1 to <out>/stats/*.csv and
the paper's Figures 2, 5 and 6 to <out>/*.png. By default the key rows of Table 2 (--rows all: Tables 2
and 6 in full). --warm-start (beyond the paper) trains BN(32) and MABN(2) from scratch per seed, then MABN(2)
started from that seed's BN(32) network for each given number of steps, and writes their table against MABN(2)
from scratch to <out>/ablation.md (default out: runs/ablation-warm). --segment-start (beyond the paper) trains
BN(32) per seed, then fine-tunes segmentation networks from it on a generated segmentation set of the same shapes
(``segment``): MABN(2) with the BN(32) encoder converted as stage 2 converts BN weights, BN(32) with it as it is,
and MABN(2) from random weights, and writes their validation mIoU with the paired differences to the converted
start to <out>/ablation.md (default out: runs/ablation-segment). --dry-run checks the options and the dataset,
prints the runs and the files they would write, and trains, generates and writes nothing.
"""

from __future__ import annotations

import argparse
import shlex
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch

from ...cli.help import PROG, HelpFormatter, positive
from ...data.imagenet import ImageFolderDataModule
from ...errors import ConfigError
from . import figures, report, segment, shapes
from .model import BLOCKS, WIDTHS
from .rows import ALL, DEFAULT_WARM_STEPS, KEY_ROWS, ROWS, ROWS_BY_KEY, WARM_SOURCE, Row, select, warm_rows
from .runner import Runnable, Task, available_cores, default_workers, run_all
from .train import RunResult, TrainConfig, open_data, run_steps

GENERATED_DATA = Path("data/ablation-shapes")
# Sized for the 5 key rows x 8 seeds within 30 minutes on 2 idle CPU cores, two one-thread runs at a time (20
# rounds): a step takes about 0.11 s with either norm, so a run of 600 steps plus its evaluation takes about
# 70 s; a machine under other load takes up to 3 times as long. 8 seeds, because BN(2)'s error spreads over
# tens of points between seeds: at 4 its paired difference to BN(32) stays short of p < 0.01.
DEFAULT_STEPS = 600
DEFAULT_SEEDS = 8
DEFAULT_OUT = Path("runs/ablation")
DEFAULT_WARM_OUT = Path("runs/ablation-warm")
DEFAULT_SEGMENT_OUT = Path("runs/ablation-segment")


def _step_counts(text: str) -> list[int]:
    """``--warm-start``'s comma-separated step counts, each an integer >= 0 (0: the seeded network untrained)."""
    try:
        steps = [int(k) for k in text.split(",") if k.strip()]
    except ValueError:
        steps = []
    if not steps or min(steps) < 0:
        raise argparse.ArgumentTypeError(f"expected comma-separated step counts >= 0, e.g. 0,60,150,300, got {text!r}")
    return steps


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=f"{PROG} ablation", description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument(
        "--data",
        type=Path,
        help="ImageFolder root with train/<class>/* and val/<class>/* (default: the generated set of 10 "
        f"noisy shapes, 3000 training and 3000 validation images, written once to {GENERATED_DATA})",
    )
    parser.add_argument(
        "--steps", type=positive, default=DEFAULT_STEPS, help=f"optimizer steps per run (default: {DEFAULT_STEPS})"
    )
    parser.add_argument(
        "--seeds", type=positive, default=DEFAULT_SEEDS, help=f"seeds 0..N-1 per row (default: {DEFAULT_SEEDS})"
    )
    parser.add_argument(
        "--rows",
        type=lambda text: [k.strip() for k in text.split(",") if k.strip()],
        help=f"comma-separated row keys, or {ALL} for Tables 2 and 6 in full (default: {','.join(KEY_ROWS)}): "
        + ", ".join(r.key for r in ROWS),
    )
    parser.add_argument("--threads", type=positive, default=1, help="torch CPU threads per run (default: 1)")
    parser.add_argument(
        "--workers",
        type=positive,
        help="runs at a time (default: on the CPU, available cores // threads, here "
        f"{default_workers(1)} at one thread; on another device, 1)",
    )
    parser.add_argument(
        "--warm-start",
        type=_step_counts,
        nargs="?",
        const=list(DEFAULT_WARM_STEPS),
        metavar="STEPS",
        help="beyond the paper: BN(32), MABN(2) from scratch, and MABN(2) warm-started from the BN(32) network of "
        "the same seed for each of these comma-separated step counts (default: "
        f"{','.join(map(str, DEFAULT_WARM_STEPS))}); the table compares them with MABN(2) from scratch",
    )
    parser.add_argument(
        "--segment-start",
        type=positive,
        nargs="?",
        const=segment.DEFAULT_SEGMENT_STEPS,
        metavar="STEPS",
        help="beyond the paper: BN(32) per seed (--steps), then segmentation fine-tunes of this many steps (default: "
        f"{segment.DEFAULT_SEGMENT_STEPS}) from it, one per start of docs/ablation/segment-start.md (--rows picks "
        f"some: {', '.join(segment.SEGMENT_ROWS_BY_KEY)})",
    )
    parser.add_argument(
        "--domain-shift",
        action="store_true",
        help="with --segment-start: the fine-tunes' images in other colours, contrast and texture than BN(32)'s",
    )
    parser.add_argument(
        "--out",
        type=Path,
        help=f"output folder (default: {DEFAULT_OUT}; with --warm-start {DEFAULT_WARM_OUT}, with --segment-start "
        f"{DEFAULT_SEGMENT_OUT})",
    )
    parser.add_argument("--image-size", type=positive, default=32, help="square training crop in pixels (default: 32)")
    parser.add_argument(
        "--lr",
        type=float,
        default=TrainConfig.lr,
        help=f"peak learning rate at gradient batch 32 (default: {TrainConfig.lr})",
    )
    parser.add_argument("--device", default="cpu", help="torch device of every run, e.g. cuda (default: cpu)")
    parser.add_argument(
        "--loader-workers", type=int, default=0, help="DataLoader processes per run (default: 0, in the run's process)"
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="check the options (and --data's layout), print the runs and output files; train and write nothing",
    )
    return parser.parse_args(argv)


def _data_root(arg: Path | None, dry_run: bool = False) -> Path:
    """The dataset root; without --data, the generated set (written once, then reused; a dry run only names it)."""
    if arg is not None:
        return arg
    if dry_run:
        state = "present" if _generated() else "generated at the start of the run"
        print(f"No dataset given (--data ...): the generated noisy-shape set in {GENERATED_DATA} ({state})")
        return GENERATED_DATA
    print(
        "No dataset given (--data ...: train/<class>/* and val/<class>/*): training on the generated "
        f"noisy-shape classification set in {GENERATED_DATA}"
    )
    return shapes.generate(GENERATED_DATA)


def _generated() -> bool:
    """Whether the generated set is in place (its marker is written last)."""
    return (GENERATED_DATA / shapes.MARKER).is_file()


def _check_out(out: Path) -> None:
    """Refuse an output folder that is a file (or under one), before hours of training."""
    for folder in (out, *out.parents):
        if folder.exists() and not folder.is_dir():
            raise ConfigError(f"--out {out}: {folder} is not a folder")


def outputs(out: Path, rows: list[Row], probe: bool = True) -> list[Path]:
    """The files a run of ``rows`` writes under ``out`` (the statistics and their figures: seed 0's probed rows,
    where ``probe``; --segment-start's rows: the table and the results alone)."""
    if rows and all(row.key in segment.STARTS for row in rows):
        return [out / "ablation.md", out / "results.json"]
    probed = {row.key for row in rows if row.key in figures.PROBED_ROWS} if probe else set()
    files = [out / "ablation.md", out / "results.json", out / "curves.png"]
    files += [out / "stats" / f"{row.key}-seed0.csv" for row in rows if row.key in probed]
    figure_rows = {"fig2-bn-statistics.png": figures.FIGURE2_ROWS, "fig5-6-chi2-psi.png": figures.FIGURE56_ROWS}
    for name, needs in figure_rows.items():
        files += [out / name] if probed & set(needs.values()) else []
    return files


def plan(
    args: argparse.Namespace,
    rows: list[Row],
    config: TrainConfig,
    data: ImageFolderDataModule | None,
    workers: int,
    argv: list[str],
) -> list[str]:
    """What the command would train and write (``--dry-run``)."""
    shown = shlex.join([*PROG.split(), "ablation", *(a for a in argv if a != "--dry-run")])
    lines = [f"dry run of {shown}: nothing is trained, generated or written"]
    if data is not None:
        lines.append(
            f"data: {config.data}: {data.num_classes} classes, {len(data.train_set)} training and "
            f"{len(data.val_set)} validation images, {config.image_size} px crops"
        )
    if args.segment_start:
        return lines + segment_plan(args, rows, config, workers)
    lines.append(f"rows: {', '.join(f'{row.label} ({row.key}: {row.preset})' for row in rows)}")
    counts = [run_steps(row, config) for row in rows]
    steps = str(counts[0]) if len(set(counts)) == 1 else f"{', '.join(map(str, counts))} (in row order)"
    lines.append(
        f"runs: {len(rows)} rows x {args.seeds} seeds = {len(rows) * args.seeds} runs of {steps} steps, peak lr "
        f"{config.lr}, {workers} at a time ({config.threads} thread(s) each), on {config.device}"
    )
    if args.warm_start:
        lines.append("warm starts: from the BN(32) network of the same seed, convs centred, statistics seeded")
    return lines + [f"writes {path}" for path in outputs(args.out, rows, probe=not args.warm_start)]


def _train(rows: list[Row], seeds: range, config: TrainConfig, workers: int, warm: bool) -> list[RunResult]:
    """Every (row, seed) run. Without ``warm`` seed-major, so the probed runs of the first seed finish first; with
    it, the rows from scratch first (BN(32) keeps its weights), then each warm start from its seed's BN(32)."""
    if not warm:
        tasks = [Task(row, s, s == 0 and row.key in figures.PROBED_ROWS) for s in seeds for row in rows]
        return run_all(tasks, config, workers)
    scratch = [
        Task(row, s, False, keep_state=row.key == WARM_SOURCE) for s in seeds for row in rows if not row.warm_from
    ]
    results = run_all(scratch, config, workers)
    source = {r.seed: r.state for r in results if r.row == WARM_SOURCE}
    warm = [Task(row, s, False, init=source[s]) for s in seeds for row in rows if row.warm_from]
    results += run_all(warm, config, workers)
    for result in results:
        result.state = None  # the weights were for the warm starts only
    return results


def segment_plan(args: argparse.Namespace, rows: list[Row], config: TrainConfig, workers: int) -> list[str]:
    """--segment-start's part of the dry run: the two phases and the files."""
    source = ROWS_BY_KEY[segment.SOURCE]
    names = ", ".join(f"{row.label} ({row.key}: {row.preset})" for row in rows)
    shift = ", domain-shifted" if args.domain_shift else ""
    return [
        f"pre-training: {source.label} ({source.key}) x {args.seeds} seeds = {args.seeds} runs of {config.steps} "
        f"steps, peak lr {config.lr}",
        f"fine-tunes: {names} x {args.seeds} seeds = {len(rows) * args.seeds} runs of "
        f"{args.segment_start} steps on the generated segmentation set{shift} ({segment.TRAIN_IMAGES} training and "
        f"{segment.VAL_IMAGES} validation images of {config.image_size} px, {segment.NUM_CLASSES} classes), "
        f"encoder lr {segment.SEGMENT_LR}, heads x {segment.HEAD_LR_MULT:g}",
        f"{workers} runs at a time ({config.threads} thread(s) each), on {config.device}",
        *(f"writes {path}" for path in outputs(args.out, rows)),
    ]


def _segment_runs(
    rows: list[Row], seeds: range, steps: int, shift: bool, config: TrainConfig, workers: int
) -> list[RunResult]:
    """BN(32) per seed, then every fine-tune of ``rows`` from that seed's network (--segment-start)."""
    source = ROWS_BY_KEY[segment.SOURCE]
    pretrained = run_all([Task(source, s, False, keep_state=True) for s in seeds], config, workers)
    states = {r.seed: r.state for r in pretrained}
    tasks: list[Runnable] = [segment.FinetuneTask(row, s, steps, states[s], shift) for s in seeds for row in rows]
    results = pretrained + run_all(tasks, config, workers)
    for result in results:
        result.state = None  # the weights were for the fine-tunes only
    return results


def _setting(
    argv: list[str], config: TrainConfig, data: ImageFolderDataModule, seeds: range, workers: int, wall: float
) -> dict[str, Any]:
    """What every run of the command shared, for the table's header and the results."""
    return {
        "command": shlex.join([*PROG.split(), "ablation", *argv]),
        "data": str(config.data),
        "classes": data.num_classes,
        "train_images": len(data.train_set),
        "val_images": len(data.val_set),
        "model": f"SmallResNet widths {WIDTHS}, blocks {BLOCKS}",
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(config).items()},
        "seeds": list(seeds),
        "workers": workers,
        "wall_seconds": round(wall, 1),
        "torch": torch.__version__,
    }


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    default_out = DEFAULT_WARM_OUT if args.warm_start else DEFAULT_SEGMENT_OUT if args.segment_start else DEFAULT_OUT
    args.out = args.out or default_out
    _check_out(args.out)
    if args.warm_start and args.rows is not None:
        raise ConfigError("--warm-start trains its own rows (BN(32), MABN(2) and the warm starts): drop --rows")
    if args.segment_start and args.warm_start:
        raise ConfigError(
            "--segment-start trains its own rows (BN(32), then the segmentation fine-tunes): drop --warm-start"
        )
    if args.domain_shift and not args.segment_start:
        raise ConfigError("--domain-shift shifts the fine-tunes' images: it needs --segment-start")
    if args.segment_start:
        rows = segment.select_segment_rows(args.rows)
    else:
        rows = warm_rows(args.warm_start) if args.warm_start else select(args.rows)
    config = TrainConfig(
        data=_data_root(args.data, args.dry_run),
        steps=args.steps,
        image_size=args.image_size,
        lr=args.lr,
        threads=args.threads,
        loader_workers=args.loader_workers,
        device=args.device,
    )
    # A wrong layout fails here, once, before any run starts (a dry run reads the generated set if it is there).
    data = None if args.dry_run and args.data is None and not _generated() else open_data(config)
    # One device run at a time unless asked: CPU cores are shared out, a GPU is not.
    workers = args.workers or (default_workers(args.threads) if config.device == "cpu" else 1)
    if args.dry_run:
        print("\n".join(plan(args, rows, config, data, workers, argv)))
        return 0
    if args.segment_start:
        return segment_main(args, argv, rows, config, data, workers)
    seeds = range(args.seeds)
    own = " (warm starts: their own)" if args.warm_start else ""
    print(
        f"{len(rows)} rows x {args.seeds} seeds = {len(rows) * args.seeds} runs of {args.steps} steps{own}, {workers} "
        f"at a time ({args.threads} thread(s) each, {available_cores()} cores available), on {config.device}",
        flush=True,
    )
    start = time.perf_counter()
    results = _train(rows, seeds, config, workers, bool(args.warm_start))
    wall = time.perf_counter() - start

    out = args.out
    setting = _setting(argv, config, data, seeds, workers, wall)
    summaries = report.summarize(rows, results)
    stats = {r.row: r.stats for r in results if r.stats}
    losses = {
        s.row.key: [r.losses for r in sorted(results, key=lambda r: r.seed) if r.row == s.row.key] for s in summaries
    }
    if args.warm_start:
        head, render = report.warm_header(setting), partial(report.warm_table, config=config)
    else:
        head, render = report.header(setting), report.table
    written = [
        report.write_markdown(out / "ablation.md", summaries, head, render),
        report.write_results(out / "results.json", setting, results),
        *(report.write_stats(out / "stats" / f"{key}-seed0.csv", records) for key, records in stats.items()),
    ]
    layer = config.probe_layer
    written += [
        p
        for p in (
            figures.curves(
                losses,
                {s.row.key: list(s.errors) for s in summaries},
                {s.row.key: s.row.label for s in summaries},
                out / "curves.png",
            ),
            figures.figure2(stats, layer, out / "fig2-bn-statistics.png"),
            figures.figure56(stats, layer, out / "fig5-6-chi2-psi.png"),
        )
        if p is not None
    ]
    print()
    print(render(summaries))
    for path in written:
        print(f"wrote {path}")
    return 0


def segment_main(
    args: argparse.Namespace,
    argv: list[str],
    rows: list[Row],
    config: TrainConfig,
    data: ImageFolderDataModule,
    workers: int,
) -> int:
    """--segment-start: train, then write the table and the results."""
    seeds = range(args.seeds)
    print(
        f"{args.seeds} BN(32) runs of {args.steps} steps, then {len(rows) * args.seeds} fine-tunes "
        f"of {args.segment_start} steps, {workers} at a time ({args.threads} thread(s) each, {available_cores()} "
        f"cores available), on {config.device}",
        flush=True,
    )
    start = time.perf_counter()
    results = _segment_runs(rows, seeds, args.segment_start, args.domain_shift, config, workers)
    wall = time.perf_counter() - start
    setting = {
        **_setting(argv, config, data, seeds, workers, wall),
        "segment_steps": args.segment_start,
        "domain_shift": args.domain_shift,
    }
    summaries = report.summarize(rows, results)
    (pretrained,) = report.summarize([ROWS_BY_KEY[segment.SOURCE]], results)
    render = partial(report.segment_table, steps=args.segment_start)
    written = [
        report.write_markdown(args.out / "ablation.md", summaries, report.segment_header(setting, pretrained), render),
        report.write_results(args.out / "results.json", setting, results),
    ]
    print()
    print(render(summaries))
    for path in written:
        print(f"wrote {path}")
    return 0
