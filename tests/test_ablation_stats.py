"""The ablation's statistics: the paired comparison (scipy's paired t-test) against the values the hand-written
incomplete beta function gave, and as the report prints it."""

from __future__ import annotations

import math
import random

import pytest
from scipy import stats as scipy_stats

from mabn.tools.ablation.report import Summary, mark, table
from mabn.tools.ablation.rows import ROWS_BY_KEY
from mabn.tools.ablation.stats import paired_test

# (row, reference, p, low, high) as the hand-written incomplete beta function computed them before the ablation
# switched to scipy's t-test: the switch must not move a reported p-value or interval.
HAND_WRITTEN = [
    ([20.1, 22.5, 20.6, 23.2], [10.0, 12.0, 11.0, 13.0], 1.3998210579973034e-05, 9.504618813691192, 10.695381186308811),
    ([11.0, 11.5, 12.5], [10.0, 12.0, 13.0], 1.0, -2.1513263648747296, 2.1513263648747296),
    ([31.2, 30.8, 32.0, 31.5, 30.9, 31.7, 32.2, 31.1], [30.9, 31.0, 31.2, 31.4, 30.5, 31.6, 31.8, 31.3],
     0.11648622439735044, -0.06813240103668239, 0.4931324010366831),
    ([5.0, 7.5], [4.0, 5.0], 0.25776211681831307, -7.779653552131014, 11.279653552131014),
]  # fmt: skip


@pytest.mark.parametrize(("row", "reference", "p", "low", "high"), HAND_WRITTEN)
def test_p_values_and_intervals_unchanged_by_the_switch_to_scipy(row, reference, p, low, high) -> None:
    got = paired_test(row, reference)
    assert got.p == pytest.approx(p, rel=1e-9, abs=1e-15)
    assert (got.low, got.high) == (pytest.approx(low, rel=1e-9), pytest.approx(high, rel=1e-9))


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
