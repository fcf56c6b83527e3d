"""The norm benchmark keeps working: it measures every layer and reports finite ratios."""

import math
import re

import torch

from mabn.tools.bench import norm


def test_norm_bench_reports_finite_ratios_for_each_shape():
    shapes = [("tiny", 4, 8, 6, 6, None), ("tiny ghost", 4, 8, 6, 6, 2)]
    table = norm.run(torch.device("cpu"), repeats=2, shapes=shapes)
    rows = [line for line in table.splitlines() if line.startswith("| tiny")]
    assert len(rows) == 2
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        ratios = [float(c) for c in cells[1:]]
        assert all(math.isfinite(r) and r > 0 for r in ratios), row
    assert re.search(r"CPU \(\d+ threads\), torch 2\.", table)


def test_interleaved_repeats_vary_who_runs_before_whom():
    """An order effect (a heavy candidate slowing the next one) must not always hit the same candidate."""
    from mabn.tools.bench.measure import median_times

    calls = []
    fns = {name: (lambda name=name: calls.append(name)) for name in "abcd"}
    times = median_times(fns, torch.device("cpu"), repeats=12, warmup=0)
    assert set(times) == set("abcd") and len(calls) == 48
    rounds = [calls[i : i + 4] for i in range(0, 48, 4)]
    assert all(sorted(r) == list("abcd") for r in rounds)  # every round runs each candidate once
    predecessors = {name: {r[r.index(name) - 1] for r in rounds if r.index(name) > 0} for name in "abcd"}
    assert all(len(p) >= 2 for p in predecessors.values()), predecessors
