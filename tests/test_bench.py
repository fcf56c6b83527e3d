"""The norm benchmark keeps working: it measures every layer and reports finite ratios."""

import math
import re

import torch

from mabn.bench import norm


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
