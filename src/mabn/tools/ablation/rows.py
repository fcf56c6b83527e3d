"""The rows of the paper's ImageNet ablation (Tables 2 and 6), each mapped to a norm preset.

Every row trains the same network with the same loop at gradient batch 32; rows differ only in the norm
preset and the normalization batch. ``paper_error`` is the row's top-1
error (%) of ResNet-50 on ImageNet in the paper, beside which the small-scale result is reported.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ...errors import ConfigError
from ...models import norm_kwargs_for
from ...norm import NORM_PRESETS

GRADIENT_BATCH = 32  # samples per optimizer step, as per device in the paper
SMALL_BATCH = 2  # the paper's small normalization batch, simulated with ghost batches
BUFFER_SIZE = GRADIENT_BATCH // SMALL_BATCH  # m = 16: the SMA spans one gradient batch of groups


@dataclass(frozen=True)
class Row:
    """One configuration: ``key`` names it on the command line, ``label`` in the table."""

    key: str
    label: str
    preset: str  # a key of mabn.norm.NORM_PRESETS
    norm_batch_size: int | None  # None: the whole gradient batch (or, for GN, no batch at all)
    paper_error: float | None  # ResNet-50 ImageNet top-1 error (%), None where the paper has no such row
    paper_ref: str
    warm_from: str | None = None  # the row whose trained network (same seed) this row starts from (--warm-start)
    steps: int | None = None  # its own optimizer steps; None: the run's --steps


ROWS: tuple[Row, ...] = (
    Row("bn32", "BN(32)", "bn", None, 23.41, "Table 2 (1)"),
    Row("mbn32", "modified BN(32)", "mbn", GRADIENT_BATCH, 23.53, "Table 2 (2)"),
    Row("bn2", "BN(2)", "bn", SMALL_BATCH, 35.22, "Table 2 (3), Table 6 (9)"),
    Row("brn2", "BRN(2)", "brn", SMALL_BATCH, 30.29, "Table 2 (4)"),
    Row("mbn2", "modified BN(2), batch statistics", "mbn", SMALL_BATCH, 29.68, "Table 2 (6), Table 6 (5)"),
    Row("mbn_emas2", "modified BN(2) + EMAS in FP", "mbn_emas", SMALL_BATCH, 27.03, "Table 2 (7), Table 6 (4)"),
    Row("mabn2", "MABN(2)", "mabn", SMALL_BATCH, 23.58, "Table 2 (8), Table 6 (1)"),
    Row("mabn_nowc2", "MABN(2) w/o weight centralization", "mabn_nowc", SMALL_BATCH, 25.45, "Table 6 (6)"),
    Row("mabn_smas2", "SMAS in FP / SMAS in BP (2)", "mabn_smas", SMALL_BATCH, 26.63, "Table 6 (2)"),
    Row("mabn_emas2", "EMAS in FP / EMAS in BP (2)", "mabn_emas", SMALL_BATCH, 24.83, "Table 6 (3)"),
    Row("gn2", "GN (reference)", "gn", None, None, "not in Tables 2 and 6"),
)
ROWS_BY_KEY = {row.key: row for row in ROWS}
# The default run: the reference, the small-batch baselines the paper compares with, the modified
# normalization alone and MABN (Table 2 rows 1, 3, 4, 6 and 8).
KEY_ROWS = ("bn32", "bn2", "brn2", "mbn2", "mabn2")
ALL = "all"  # the --rows value for every row of Tables 2 and 6 (and GN)

# Momentum of every running average (paper's convention: the weight of the old value). The paper uses 0.98
# with SMA statistics and 0.9 otherwise, over 600,000 iterations; in a run of a few hundred steps an EMA
# of time constant 1 / (1 - 0.98) = 50 steps still remembers its start value (1) when renormalization
# begins, which jolts the forward, so every row uses 0.9 (10 steps), as the product's demo profile does.
MOMENTUM = 0.9

# Fractions of the run at which the norms' timelines switch. The paper's absolute counts (MABN: moving
# averages after 100 and renormalization after 1000 of 600,000 iterations; BRN: Ioffe's ramps from step
# 5,000 to 25,000 / 40,000) would never switch, or switch at once, in a run of a few hundred steps; these
# keep each phase long enough to matter, and give the EMA (time constant 1 / (1 - momentum) steps) time
# to settle before r uses it.
MOVING_STATS_FROM = 0.05
RENORM_FROM = 0.2
BRN_RAMP_START, BRN_D_FULL, BRN_R_FULL = 0.05, 0.25, 0.4


# The warm start (beyond the paper, docs/ablation/warm-start.md): MABN(2) started from the BN(32) network of the same
# seed (``mabn.models.warm_start``) for a few short schedules, against MABN(2) from scratch.
WARM_SOURCE, WARM_TARGET = "bn32", "mabn2"
DEFAULT_WARM_STEPS = (0, 60, 150, 300)  # 0: the seeded network, untrained


def warm_rows(steps: list[int]) -> list[Row]:
    """BN(32), MABN(2) from scratch, and MABN(2) warm-started from BN(32) for each of ``steps``."""
    target = ROWS_BY_KEY[WARM_TARGET]
    warm = [
        replace(target, key=f"{target.key}-warm{k}", label=f"{target.label} warm start, {k} steps", paper_error=None,
                paper_ref="beyond the paper", warm_from=WARM_SOURCE, steps=k)
        for k in steps
    ]  # fmt: skip
    return [ROWS_BY_KEY[WARM_SOURCE], target, *warm]


def select(keys: list[str] | None) -> list[Row]:
    """The rows named by ``keys`` in table order: KEY_ROWS for None, every row for ``[ALL]``; unknown
    keys raise a ConfigError."""
    if keys is None:
        keys = list(KEY_ROWS)
    if keys == [ALL]:
        return list(ROWS)
    unknown = [k for k in keys if k not in ROWS_BY_KEY]
    if unknown:
        raise ConfigError(f"unknown rows {unknown}; choose from {', '.join(ROWS_BY_KEY)} or {ALL}")
    return [row for row in ROWS if row.key in keys]


def layer_options(row: Row, steps: int) -> dict[str, Any]:
    """Arguments for ``convert_norm`` of this row in a run of ``steps`` optimizer steps (one forward each)."""
    kind = NORM_PRESETS[row.preset].kind
    options: dict[str, Any] = {} if kind in ("gn", "frozenbn") else {"momentum": MOMENTUM}
    if kind == "mabn":
        options.update(
            buffer_size=BUFFER_SIZE,
            # A warm start's SMA is full of BN's seeded statistics: moving averages from the first forward.
            warmup_iters=1 if row.warm_from else max(1, round(MOVING_STATS_FROM * steps)),
            renorm_warmup_iters=max(1, round(RENORM_FROM * steps)),
        )
    elif kind == "brn":
        start = round(BRN_RAMP_START * steps)
        options.update(
            r_ramp=(start, max(start + 1, round(BRN_R_FULL * steps))),
            d_ramp=(start, max(start + 1, round(BRN_D_FULL * steps))),
        )
    return norm_kwargs_for(row.preset, row.norm_batch_size, {kind: options})
