"""Paired comparison of two rows over the same seeds: Student's t-test and confidence interval.

Written from the formulas (the regularized incomplete beta function by its continued fraction) so the
ablation needs nothing beyond the standard library: with paired seeds the per-seed differences
``d_i = error(row, seed i) - error(reference, seed i)`` cancel what the seed does to both rows, and
``t = mean(d) / (sd(d) / sqrt(n))`` follows Student's t with ``n - 1`` degrees of freedom under "no
difference".
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass


def _beta_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of I_x(a, b) (modified Lentz), convergent for x < (a + 1) / (a + b + 2)."""
    tiny, c, d = 1e-300, 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    result = d
    for m in range(1, 1000):
        for numerator in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            result *= c * d
        if abs(c * d - 1.0) < 1e-15:
            return result
    raise ArithmeticError(f"incomplete beta fraction did not converge for a={a}, b={b}, x={x}")


def incomplete_beta(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b) for a, b > 0 and 0 <= x <= 1."""
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"incomplete_beta: x must lie in [0, 1], got {x}")
    if x in (0.0, 1.0):
        return x
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _beta_fraction(a, b, x) / a
    return 1.0 - math.exp(log_front) * _beta_fraction(b, a, 1.0 - x) / b  # symmetry: converges fast here


def t_two_sided_p(t: float, df: int) -> float:
    """P(|T| >= |t|) for Student's T with ``df`` degrees of freedom."""
    return incomplete_beta(df / 2.0, 0.5, df / (df + t * t))


def t_quantile(q: float, df: int) -> float:
    """The ``q`` quantile of Student's t with ``df`` degrees of freedom, for 0.5 <= q < 1 (bisection on
    the two-sided tail, which falls monotonically in t)."""
    if not 0.5 <= q < 1.0:
        raise ValueError(f"t_quantile: q must lie in [0.5, 1), got {q}")
    tail = 2.0 * (1.0 - q)
    lo, hi = 0.0, 1.0
    while t_two_sided_p(hi, df) > tail:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if t_two_sided_p(mid, df) > tail else (lo, mid)
    return 0.5 * (lo + hi)


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
    se = statistics.stdev(diffs) / math.sqrt(n)
    half = t_quantile(0.5 + confidence / 2.0, n - 1) * se
    if se == 0.0:  # identical differences: no spread to test against
        return Paired(n, mean, mean, mean, 1.0 if mean == 0.0 else 0.0)
    return Paired(n, mean, mean - half, mean + half, t_two_sided_p(mean / se, n - 1))
