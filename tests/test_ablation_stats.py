"""The ablation's statistics: Student's t written from the incomplete beta function, held to closed forms,
printed tables and scipy; the paired comparison in the report held to scipy's paired t-test."""

from __future__ import annotations

import math
import random

import pytest
from scipy import stats as scipy_stats

from mabn.ablation.report import Summary, mark, table
from mabn.ablation.rows import ROWS_BY_KEY
from mabn.ablation.stats import incomplete_beta, paired_test, t_quantile, t_two_sided_p


@pytest.mark.parametrize(("a", "b"), [(0.5, 0.5), (2.0, 0.5), (1.0, 3.0), (4.0, 1.0), (15.0, 0.5)])
def test_incomplete_beta_closed_forms(a: float, b: float) -> None:
    for x in (0.01, 0.2, 0.5, 0.8, 0.99):
        if b == 1.0:
            expected = x**a
        elif a == 1.0:
            expected = 1.0 - (1.0 - x) ** b
        else:
            expected = scipy_stats.beta.cdf(x, a, b)
        assert incomplete_beta(a, b, x) == pytest.approx(expected, rel=1e-10, abs=1e-14)
    assert incomplete_beta(a, b, 0.0) == 0.0 and incomplete_beta(a, b, 1.0) == 1.0
    with pytest.raises(ValueError, match="x must lie in"):
        incomplete_beta(a, b, 1.5)


@pytest.mark.parametrize("t", [0.0, 0.3, 1.0, 2.5, 9.0, 40.0])
def test_t_tail_matches_closed_forms(t: float) -> None:
    """df 1 (Cauchy) and df 2 have elementary two-sided tails."""
    assert t_two_sided_p(t, 1) == pytest.approx(1.0 - 2.0 / math.pi * math.atan(t), rel=1e-10, abs=1e-15)
    assert t_two_sided_p(t, 2) == pytest.approx(1.0 - t / math.sqrt(2.0 + t * t), rel=1e-10, abs=1e-15)
    assert t_two_sided_p(-t, 7) == t_two_sided_p(t, 7)


@pytest.mark.parametrize(
    ("q", "df", "printed"),
    [
        (0.975, 1, 12.706),
        (0.975, 2, 4.303),
        (0.975, 3, 3.182),
        (0.975, 4, 2.776),
        (0.995, 4, 4.604),
        (0.975, 30, 2.042),
    ],
)
def test_t_quantile_matches_printed_tables(q: float, df: int, printed: float) -> None:
    assert t_quantile(q, df) == pytest.approx(printed, abs=5e-4)
    assert t_quantile(q, df) == pytest.approx(scipy_stats.t.ppf(q, df), rel=1e-9)
    with pytest.raises(ValueError, match="q must lie in"):
        t_quantile(0.2, df)


def test_paired_test_matches_scipy() -> None:
    rng = random.Random(3)
    for n in (2, 3, 5, 8):
        reference = [rng.uniform(5, 15) for _ in range(n)]
        row = [r + rng.gauss(0.8, 1.0) for r in reference]
        got = paired_test(row, reference)
        want = scipy_stats.ttest_rel(row, reference)
        assert got.p == pytest.approx(want.pvalue, rel=1e-9)
        low, high = want.confidence_interval(0.95)
        assert (got.low, got.high) == (pytest.approx(low, rel=1e-9), pytest.approx(high, rel=1e-9))
        assert got.mean == pytest.approx(sum(row) / n - sum(reference) / n)
    assert math.isnan(paired_test([1.0], [2.0]).p)
    same = paired_test([3.0, 4.0], [1.0, 2.0])  # identical differences: no spread, a certain difference
    assert (same.mean, same.low, same.high, same.p) == (2.0, 2.0, 2.0, 0.0)
    with pytest.raises(ValueError, match="pair them by seed"):
        paired_test([1.0, 2.0], [1.0])


def test_table_reports_the_paired_difference_and_its_mark() -> None:
    """Δ, CI and p come from the same-seed pairs; a diverged seed drops out of its pair only."""
    bn32 = Summary(ROWS_BY_KEY["bn32"], (10.0, 12.0, 11.0, 13.0), 0)
    bn2 = Summary(ROWS_BY_KEY["bn2"], (20.1, 22.5, 20.6, 23.2), 0)  # far worse, consistently
    mabn2 = Summary(ROWS_BY_KEY["mabn2"], (11.0, 11.5, math.nan, 12.5), 1)  # close, one seed diverged
    lines = {line.split("|")[1].strip(): line.split("|") for line in table([bn32, bn2, mabn2]).splitlines()[2:]}

    want = scipy_stats.ttest_rel(bn2.errors, bn32.errors)
    low, high = want.confidence_interval(0.95)
    mean = sum(a - b for a, b in zip(bn2.errors, bn32.errors)) / 4
    assert lines["BN(2)"][6].strip() == f"{mean:+.2f} [{low:+.2f}, {high:+.2f}]**"
    assert float(lines["BN(2)"][7]) == pytest.approx(want.pvalue, rel=1e-2) and want.pvalue < 0.01

    kept = [0, 1, 3]
    want = scipy_stats.ttest_rel([mabn2.errors[i] for i in kept], [bn32.errors[i] for i in kept])
    assert lines["MABN(2)"][6].strip().endswith("]") and float(lines["MABN(2)"][7]) == pytest.approx(
        want.pvalue, rel=1e-2
    )
    assert "1/4 diverged" in lines["MABN(2)"][4] and "div." in lines["MABN(2)"][5]
    assert lines["BN(32)"][6].strip() == "–"
    assert (mark(0.005), mark(0.03), mark(0.2)) == ("**", "*", "")
