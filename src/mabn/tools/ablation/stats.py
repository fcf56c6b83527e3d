"""Paired comparison of two rows over the same seeds: Student's t-test and confidence interval (scipy's).

With paired seeds the per-seed differences ``d_i = error(row, seed i) - error(reference, seed i)`` cancel what
the seed does to both rows, and ``t = mean(d) / (sd(d) / sqrt(n))`` follows Student's t with ``n - 1`` degrees
of freedom under "no difference": ``scipy.stats.ttest_rel``.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from scipy import stats


@dataclass(frozen=True)
class Paired:
    """The paired difference of a row to the reference over ``n`` common seeds."""

    n: int
    mean: float  # mean difference (row - reference), in the units of the inputs
    low: float  # the confidence interval of the mean difference
    high: float
    p: float  # two-sided paired t-test p-value; NaN with fewer than two seeds

    def significant(self, alpha: float) -> bool:
        return self.p < alpha


def paired_test(row: list[float], reference: list[float], confidence: float = 0.95) -> Paired:
    """Paired t-test and ``confidence`` interval of ``row - reference`` (same seeds in the same order)."""
    if len(row) != len(reference):
        raise ValueError(f"paired_test: {len(row)} values against {len(reference)}; pair them by seed")
    diffs = [a - b for a, b in zip(row, reference)]
    n = len(diffs)
    mean = statistics.fmean(diffs) if diffs else math.nan
    if n < 2:
        return Paired(n, mean, math.nan, math.nan, math.nan)
    if statistics.stdev(diffs) == 0.0:  # identical differences: no spread to test against (scipy gives NaN)
        return Paired(n, mean, mean, mean, 1.0 if mean == 0.0 else 0.0)
    result = stats.ttest_rel(row, reference)
    low, high = result.confidence_interval(confidence)
    return Paired(n, mean, float(low), float(high), float(result.pvalue))
