"""Which cases of a parametrized test the default suite runs: the rest carry the ``slow`` marker, so
``make test-slow`` (CI runs both) still checks every case while ``make test`` stays short."""

from __future__ import annotations

from collections.abc import Iterable

import pytest


def default_suite_runs(cases: Iterable, keep: Iterable, ids: Iterable[str] | None = None) -> list:
    """``cases`` as ``pytest.param``s: those in ``keep`` unmarked, every other one marked ``slow``."""
    cases, keep = list(cases), list(keep)
    missing = [k for k in keep if k not in cases]
    assert not missing, f"kept cases that are not cases: {missing}"
    ids = list(ids) if ids is not None else [None] * len(cases)
    return [
        pytest.param(
            *(case if isinstance(case, tuple) else (case,)), id=i, marks=() if case in keep else pytest.mark.slow
        )
        for case, i in zip(cases, ids)
    ]


def where_interpreted(*marks: pytest.MarkDecorator) -> list[pytest.MarkDecorator]:
    """``marks`` where Triton's interpreter runs the kernels (the CPU, where a program takes milliseconds), none
    where they run compiled (MABN_TEST_DEVICE=cuda): there the GPU check's kernel section (``-m "gpu and not slow"``)
    runs the case."""
    import triton  # here: the modules that mark their cases otherwise need no Triton

    return list(marks) if triton.knobs.runtime.interpret else []
