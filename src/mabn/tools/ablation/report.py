"""The ablation's outputs: the markdown table (per row the error over seeds and the paired difference to
BN(32) with its confidence interval and p-value, beside the paper's numbers; with --warm-start the warm starts'
table against MABN(2) from scratch; with --segment-start the fine-tunes' mIoU against the converted start), the
results JSON and the raw per-step statistics as CSV, every file written
atomically."""

from __future__ import annotations

import csv
import json
import math
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ...run import write_atomic, write_text_atomic
from . import segment
from .rows import GRADIENT_BATCH, ROWS_BY_KEY, SMALL_BATCH, WARM_TARGET, Row
from .stats import Paired, paired_test
from .train import RunResult, TrainConfig, run_steps

REFERENCE_ROW = "bn32"  # the deltas are taken against BN at the regular batch, as in the paper
CONFIDENCE = 0.95
# Significance marks of the paired difference to BN(32), per row (no correction for the number of rows).
MARKS = ((0.01, "**"), (0.05, "*"))


@dataclass(frozen=True)
class Summary:
    """A row's validation errors over its seeds (diverged seeds left out of the mean); a fine-tune's
    (--segment-start) validation mIoU."""

    row: Row
    errors: tuple[float, ...]  # one per seed, NaN for a diverged seed
    diverged: int

    @property
    def finite(self) -> list[float]:
        return [e for e in self.errors if math.isfinite(e)]

    @property
    def mean(self) -> float:
        return statistics.fmean(self.finite) if self.finite else math.nan

    @property
    def std(self) -> float:
        """Sample standard deviation over the finite seeds; NaN with fewer than two."""
        return statistics.stdev(self.finite) if len(self.finite) > 1 else math.nan

    def paired(self, reference: Summary) -> Paired:
        """The paired difference to ``reference`` over the seeds where both runs finished."""
        pairs = [(a, b) for a, b in zip(self.errors, reference.errors) if math.isfinite(a) and math.isfinite(b)]
        return paired_test([a for a, _ in pairs], [b for _, b in pairs], CONFIDENCE)


def summarize(rows: list[Row], results: list[RunResult]) -> list[Summary]:
    """One summary per row that has results, in table order."""
    out = []
    for row in rows:
        mine = sorted((r for r in results if r.row == row.key), key=lambda r: r.seed)
        if mine:
            out.append(Summary(row, tuple(r.val_error for r in mine), sum(r.diverged is not None for r in mine)))
    return out


def _error_cell(s: Summary) -> str:
    if not s.finite:
        return f"diverged ({s.diverged}/{len(s.errors)})"
    cell = f"{s.mean:.2f}" if math.isnan(s.std) else f"{s.mean:.2f} ± {s.std:.2f}"
    return cell + (f" ({s.diverged}/{len(s.errors)} diverged)" if s.diverged else "")


def _seeds_cell(s: Summary) -> str:
    return ", ".join("div." if math.isnan(e) else f"{e:.2f}" for e in s.errors)


def _delta(value: float | None, reference: float | None) -> str:
    if value is None or reference is None or not (math.isfinite(value) and math.isfinite(reference)):
        return "–"
    return f"{value - reference:+.2f}"


def mark(p: float) -> str:
    """The significance mark of a p-value ("" when not significant at the widest level)."""
    return next((m for alpha, m in MARKS if p < alpha), "")


def _paired_cells(s: Summary, reference: Summary | None) -> str:
    """Δ (paired, with its CI) and p cells; "–" for the reference itself or without enough pairs."""
    if reference is None or s is reference:
        return "– | –"
    d = s.paired(reference)
    if d.n < 2:
        return f"{_delta(d.mean, 0.0)} | –"
    return f"{d.mean:+.2f} [{d.low:+.2f}, {d.high:+.2f}]{mark(d.p)} | {d.p:.2g}"


def table(summaries: list[Summary]) -> str:
    """The markdown table: our error per row (mean ± std over seeds, each seed) and its paired
    difference to BN(32), beside the paper's error and difference."""
    reference = next((s for s in summaries if s.row.key == REFERENCE_ROW), None)
    paper_ref = reference.row.paper_error if reference is not None else None
    lines = [
        "| row | preset | norm batch | top-1 error % (mean ± std) | per seed | "
        f"Δ vs BN(32), paired [{CONFIDENCE:.0%} CI] | p (paired t) | "
        "paper: ResNet-50 ImageNet top-1 error % | paper Δ | paper row |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summaries:
        row = s.row
        batch = "–" if row.preset == "gn" else str(row.norm_batch_size or "32")
        paper = "–" if row.paper_error is None else f"{row.paper_error:.2f}"
        lines.append(
            f"| {row.label} | `{row.preset}` | {batch} | {_error_cell(s)} | {_seeds_cell(s)} | "
            f"{_paired_cells(s, reference)} | {paper} | {_delta(row.paper_error, paper_ref)} | {row.paper_ref} |"
        )
    return "\n".join(lines) + "\n"


def warm_table(summaries: list[Summary], config: TrainConfig) -> str:
    """The warm-start table (--warm-start): per row where it started, its own steps and the steps in all (a warm
    start's own plus the BN(32) run it started from), its error, and its paired difference to MABN(2) from
    scratch."""
    reference = next((s for s in summaries if s.row.key == WARM_TARGET), None)
    own = {s.row.key: run_steps(s.row, config) for s in summaries}
    label = ROWS_BY_KEY[WARM_TARGET].label
    lines = [
        "| row | starts from | steps of its own | steps in all | top-1 error % (mean ± std) | per seed | "
        f"Δ vs {label} from scratch, paired [{CONFIDENCE:.0%} CI] | p (paired t) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in summaries:
        row = s.row
        source = row.warm_from
        start = f"{ROWS_BY_KEY[source].label} after {own.get(source, config.steps)} steps" if source else "random"
        total = own[row.key] + (own.get(source, config.steps) if source else 0)
        lines.append(
            f"| {row.label} | {start} | {own[row.key]} | {total} | {_error_cell(s)} | {_seeds_cell(s)} | "
            f"{_paired_cells(s, reference)} |"
        )
    return "\n".join(lines) + "\n"


def segment_table(summaries: list[Summary], steps: int) -> str:
    """The --segment-start table: per fine-tune how its encoder started from BN(32)'s weights, its head's norm, its
    validation mIoU, and its paired difference to stage 2's conversion (``segment.REFERENCE``)."""
    reference = next((s for s in summaries if s.row.key == segment.REFERENCE), None)
    label = reference.row.label if reference is not None else segment.REFERENCE
    starts = {
        segment.AS_IS: "loaded, then the norm swapped (convert_norm)",
        segment.KEPT: "keep_bn_function",
        segment.FOLDED: "keep_bn_function, then BN's variance as statistics",
        segment.CENTRED: "seed_from_bn (convs centred)",
    }
    lines = [
        f"| row | encoder from {ROWS_BY_KEY[segment.SOURCE].label}'s weights | head norm | fine-tune steps | "
        f"mIoU % (mean ± std) | per seed | Δ vs {label}, paired [{CONFIDENCE:.0%} CI] | p (paired t) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in summaries:
        start = segment.STARTS[s.row.key]
        head = s.row if start.head is None else ROWS_BY_KEY[start.head]
        lines.append(
            f"| {s.row.label} | {starts[start.how]} | {head.label.removesuffix(' (reference)')} | {steps} | "
            f"{_error_cell(s)} | {_seeds_cell(s)} | {_paired_cells(s, reference)} |"
        )
    return "\n".join(lines) + "\n"


def _setting_line(setting: dict[str, Any]) -> str:
    """The command and the setting every row shared, in one paragraph."""
    c = setting["config"]
    return (
        f"`{setting['command']}`: {setting['model']} on {setting['data']} ({setting['classes']} classes, "
        f"{setting['train_images']} training and {setting['val_images']} validation images, {c['image_size']} px "
        f"crops); gradient batch {GRADIENT_BATCH}, small normalization batch {SMALL_BATCH} through ghost batches; "
        f"SGD momentum {c['momentum']}, weight decay {c['weight_decay']}, lr {c['lr']} with "
        f"{c['warmup_fraction']:.0%} linear warm-up then cosine, {c['steps']} steps; seeds {setting['seeds']}; "
        f"{setting['wall_seconds'] / 60:.1f} min wall on {c['device']} ({setting['workers']} runs at a time, "
        f"{c['threads']} thread(s) each), torch {setting['torch']}."
    )


def header(setting: dict[str, Any]) -> list[str]:
    """The lines above the table: the command and the setting every row shared, then how to read it."""
    return [
        "# MABN ablation at small scale (paper Tables 2 and 6)",
        "",
        _setting_line(setting),
        "",
        "Top-1 error on the validation split after the last step (norms in inference mode); mean ± sample std "
        "over the seeds. Seeds are paired: with the same seed every row starts the layers they share from the "
        "same weights and sees the same batches and augmentations. Δ is the mean over seeds of the row's error "
        "minus BN(32)'s error with the same seed, with its confidence interval from Student's t; p is the "
        "two-sided paired t-test's (" + ", ".join(f"{m} p < {a}" for a, m in MARKS) + ", per row, not corrected "
        "for the number of rows). The paper's columns are ResNet-50 on ImageNet after 600,000 iterations: "
        "compare the ordering and the gaps, not the absolute values.",
    ]


def warm_header(setting: dict[str, Any]) -> list[str]:
    """The lines above the warm-start table: the setting, then what the rows are and how to read them."""
    return [
        "# MABN warm start at small scale (beyond the paper)",
        "",
        _setting_line(setting),
        "",
        "Each warm start is MABN(2) started from the BN(32) network of the same seed (convs centred, MABN's chi^2 "
        "statistics seeded from BN's running variance, affine and classifier copied: mabn.models.warm_start) and "
        "trained with the same loop (peak lr, warm-up and cosine decay) over its own steps; 0 steps: the seeded "
        "network as it starts. Top-1 error on the "
        "validation split after the last step; mean ± sample std over the seeds. Δ is the paired difference to "
        "MABN(2) from scratch (same seed) with its confidence interval from Student's t; p is the two-sided paired "
        "t-test's (" + ", ".join(f"{m} p < {a}" for a, m in MARKS) + ").",
    ]


def segment_header(setting: dict[str, Any], pretrained: Summary) -> list[str]:
    """The lines above the --segment-start table: the setting, the BN(32) networks the fine-tunes start from, and
    what the rows are."""
    return [
        "# Stage 2's start from BN weights at small scale (beyond the paper)",
        "",
        _setting_line(setting),
        "",
        f"The BN(32) networks after {setting['config']['steps']} steps: top-1 error {_error_cell(pretrained)} % "
        f"({_seeds_cell(pretrained)}). Each then starts segmentation fine-tunes of {setting['segment_steps']} steps "
        f"(mabn.tools.ablation.segment: {segment.TRAIN_IMAGES} training and {segment.VAL_IMAGES} validation images "
        f"of one shape each, {segment.NUM_CLASSES} classes with the background; encoder lr {segment.SEGMENT_LR}, "
        f"heads x {segment.HEAD_LR_MULT:g}, warm-up then poly {segment.POLY_POWER})"
        + (", its images domain-shifted (other colours, contrast and texture)" if setting.get("domain_shift") else "")
        + ". mIoU on the validation split after the last step; mean ± sample std over the seeds. Δ is the paired "
        "difference to stage 2's conversion (same seed) with its confidence interval from Student's t; p is the "
        "two-sided paired t-test's (" + ", ".join(f"{m} p < {a}" for a, m in MARKS) + ").",
    ]


def write_markdown(
    path: Path, summaries: list[Summary], header: list[str], render: Callable[[list[Summary]], str] = table
) -> Path:
    """``header`` lines (the setting), a blank line, then the table (``render``: the ablation's, or another)."""
    return write_text_atomic(path, "\n".join(header) + "\n\n" + render(summaries))


def write_results(path: Path, setting: dict[str, Any], results: list[RunResult]) -> Path:
    """Every run's outcome (the statistics go to their own CSV files) and the setting, as JSON."""
    ordered = sorted(results, key=lambda r: (r.row, r.seed))
    runs = [{k: v for k, v in asdict(r).items() if k not in ("stats", "state")} for r in ordered]
    for run in runs:  # JSON has no NaN
        run["val_error"] = run["val_error"] if math.isfinite(run["val_error"]) else None
        run["final_loss"] = run["final_loss"] if math.isfinite(run["final_loss"]) else None
    return write_text_atomic(path, json.dumps({"setting": setting, "runs": runs}, indent=2, default=str) + "\n")


def write_stats(path: Path, records: list[dict[str, float]]) -> Path:
    """Per-step probe records as CSV, one column per statistic."""

    def write(scratch: Path) -> None:
        with scratch.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(records[0]))
            writer.writeheader()
            writer.writerows(records)

    return write_atomic(path, write)
