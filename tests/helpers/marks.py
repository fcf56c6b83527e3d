"""Which cases of a parametrized test the default suite runs: the rest carry the ``slow`` marker, so
``make test-slow`` (CI runs both) still checks every case while ``make test`` stays short."""

from __future__ import annotations

from collections.abc import Iterable

import pytest


def default_suite_runs(
    cases: Iterable, keep: Iterable, ids: Iterable[str] | None = None, keep_compiled: Iterable = ()
) -> list:
    """``cases`` as ``pytest.param``s: those in ``keep`` unmarked, those in ``keep_compiled`` marked ``slow`` where
    Triton's interpreter runs the kernels (``where_interpreted``), every other one marked ``slow``."""
    cases, keep, keep_compiled = list(cases), list(keep), list(keep_compiled)
    missing = [k for k in keep + keep_compiled if k not in cases]
    assert not missing, f"kept cases that are not cases: {missing}"
    ids = list(ids) if ids is not None else [None] * len(cases)

    def marks(case) -> list[pytest.MarkDecorator]:
        if case in keep:
            return []
        return where_interpreted(pytest.mark.slow) if case in keep_compiled else [pytest.mark.slow]

    return [
        pytest.param(*(case if isinstance(case, tuple) else (case,)), id=i, marks=marks(case))
        for case, i in zip(cases, ids)
    ]


def slow_where_interpreted(test):
    """``test`` marked ``slow`` where Triton's interpreter runs the kernels (``where_interpreted``)."""
    for mark in where_interpreted(pytest.mark.slow):
        test = mark(test)
    return test


def where_interpreted(*marks: pytest.MarkDecorator) -> list[pytest.MarkDecorator]:
    """``marks`` where Triton's interpreter runs the kernels (the CPU, where a program takes milliseconds), none
    where they run compiled (MABN_TEST_DEVICE=cuda): there the GPU check's kernel section (``-m "gpu and not slow"``)
    runs the case."""
    import triton  # here: the modules that mark their cases otherwise need no Triton

    return list(marks) if triton.knobs.runtime.interpret else []
