"""Learning-rate schedules as per-iteration multipliers of the base lr (for ``LambdaLR``, stepped every
optimizer step: the factor at index i is the one used by optimizer step i, counting from 0)."""

from __future__ import annotations

from collections.abc import Sequence


def _linear_warmup(step: int, warmup_steps: int) -> float:
    return (step + 1) / warmup_steps if step < warmup_steps else 1.0


def warmup_multistep(step: int, warmup_steps: int, milestones: Sequence[int], gamma: float) -> float:
    """Optional linear warm-up, then gamma ** (milestones reached): the ImageNet recipe's lr / 10 drops."""
    return _linear_warmup(step, warmup_steps) * gamma ** sum(step >= m for m in milestones)


def warmup_poly(step: int, max_steps: int, warmup_steps: int, power: float = 0.9) -> float:
    """Linear warm-up from 0 to 1 over ``warmup_steps``, then poly decay (1 - step / max_steps) ** power."""
    if step < warmup_steps:
        return _linear_warmup(step, warmup_steps)
    return max(0.0, 1.0 - step / max_steps) ** power
