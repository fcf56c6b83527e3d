"""The history shift of MABN2d's statistic kernels (``_stream`` in mabn_kernels.py) where a forward's groups are
fewer than the history's rows (G < M): each launch moves every row of the chi^2 and psi histories G rows up in
place, the rows that leave read by other threads than the ones that overwrite them. Held to the float64 reference
over enough steps to fill the history and roll it: every output, gradient and both histories after every step.

On the CPU the kernels run through Triton's interpreter, which executes a program's loads before its stores as
whole tiles, so a missing barrier between them cannot show here; on a GPU (MABN_TEST_DEVICE=cuda) the same steps run
compiled, at the recipe's 32 channels per program.
"""

from __future__ import annotations

import pytest
import torch

from helpers.kernels import kernels, take
from helpers.marks import slow_where_interpreted
from helpers.reference import group_slices
from helpers.stream_runs import check_step, inputs, pair

pytestmark = pytest.mark.gpu

# name: (batch, norm_batch_size, buffer_size, channels, steps). Stage 2's shape: one group of 2 (G = 1), a history
# of 16; 40 channels are two programs of 32, the second partial. Then three groups of 2 in a history of 8, which
# they do not divide: a window spans rows of the history and of the new groups.
CASES = {
    "stage2-G1-B2-M16": (2, None, 16, 40, 22),
    "G3-B2-M8": (6, 2, 8, 40, 8),
}


# On a GPU the default suite runs every case; in Triton's interpreter, which cannot show a missing barrier, the slow
# suite does (the default suite's kernel tests shift histories of more rows than groups, test_mabn_kernels.py).
@slow_where_interpreted
@pytest.mark.parametrize("case", sorted(CASES))
def test_history_shift_matches_reference(case, device, monkeypatch):
    n, norm_batch_size, m, channels, steps = CASES[case]
    groups = len(group_slices(n, norm_batch_size))
    warmup = -(-m // groups) + 1  # the moving statistics from the first forward after the history is full
    cfg = dict(
        buffer_size=m, momentum=0.9, eps=1e-5, renorm_clip=1.5, norm_batch_size=norm_batch_size,
        warmup_iters=warmup, renorm_warmup_iters=warmup + 2,
    )  # fmt: skip
    take(monkeypatch, kernels())
    layer, ref = pair(channels, cfg, device)
    gen = torch.Generator().manual_seed(6)
    for step in range(1, steps + 1):
        check_step(layer, ref, *inputs(gen, n, channels), f"step {step}")
    # The run filled the history, used its moving average, rolled it past its first full window and renormalized.
    active = [a for record in ref.log for a in record["active"]]
    assert any(active) and not all(active)
    assert len(ref.chi2_stream) >= m + 3 * groups
    assert any(record["renorm_on"] for record in ref.log)
