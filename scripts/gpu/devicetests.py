"""The checkout's tests on the device, as parts of the GPU check: those of the default suite (``-m "gpu and not slow"``)
that hold the Triton kernels to the float64 references, and a compiled step against the eager one; ``make test-gpu``
runs every GPU test.

The chain compares a graphed fit with an eager one, and both run the same Triton kernels: a kernel that computes
something else on a GPU than in Triton's interpreter would pass it. These tests hold the compiled kernels to the
float64 references on the device itself, so the check's first section says whether its numbers are MABN's.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[2]  # the checkout: scripts/gpu/ -> .


@dataclass(frozen=True)
class Suite:
    """Tests the check runs on the device: their title in the report, node ids and marker expression."""

    title: str
    tests: tuple[str, ...]
    marks: str


# The default suite's kernel tests: the Triton kernels against the float64 references, in two suites. First every
# kernel variant the recipes run (their ghost batches, histories and widths, float32 and bfloat16, channels_last; a
# non-finite value in one program of 32; the direct launch against Triton's; CUDA graphs with accumulated
# micro-batches) and the history shift across programs, whose cases are slow only in Triton's interpreter: on the
# device the marker expression selects them all. Then the kernels' other configurations.
RECIPE_KERNELS = Suite(
    "Recipe kernel and history-shift tests on the device",
    ("tests/test_recipe_kernels.py", "tests/test_history_shift.py"),
    "gpu and not slow",
)
KERNELS = Suite(
    "Kernel tests on the device",
    (
        "tests/test_mabn_kernels.py::test_fused_matches_reference",
        "tests/test_mabn_kernels.py::test_fused_low_precision_input_equals_torch_ops",
        "tests/test_row_kernels.py",
        "tests/test_recentre_kernel.py",
    ),
    "gpu and not slow",
)
# A compiled MABN step against the eager one: on the device the compiled step calls the statistic kernels as custom
# operators (mabn.norm.mabn_ops) and the eager one launches them, which Triton's interpreter cannot tell apart from
# what a GPU runs. Slow on the CPU (the inductor's C++ builds), so named by its case.
COMPILED = Suite(
    "Compiled step against the eager one on the device",
    ("tests/test_compile.py::test_compiled_training_steps_match_eager[mabn]",),
    "gpu",
)


def command(suite: Suite) -> list[str]:
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", suite.marks, *suite.tests]


class Outcome(NamedTuple):
    """A suite's run: whether it passed, its one line (the command and its verdict) and its Markdown."""

    passed: bool
    line: str
    markdown: str


def run(suite: Suite, device: str, deadline: float) -> Outcome:
    """``suite`` with MABN_TEST_DEVICE=``device``, stopped at ``deadline`` (``time.monotonic()``)."""
    shown = f"`MABN_TEST_DEVICE={device} {shlex.join(['python', *command(suite)[1:]])}`"
    heading = f"### {suite.title}"
    env = {**os.environ, "MABN_TEST_DEVICE": device}
    env.pop("TRITON_INTERPRET", None)
    started = time.monotonic()
    try:
        done = subprocess.run(command(suite), cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=max(1.0, deadline - started))  # fmt: skip
        passed, out = done.returncode == 0, done.stdout + done.stderr
        verdict = "passed" if passed else f"failed (exit {done.returncode})"
    except subprocess.TimeoutExpired as stopped:
        passed, out = False, (stopped.stdout or b"").decode(errors="replace")
        verdict = "stopped at the section's limit"
    tail = "\n".join(line for line in out.strip().splitlines()[-15:])
    line = f"{shown}: {verdict} in {time.monotonic() - started:.0f} s"
    return Outcome(passed, line, f"{heading}\n\n{line}\n\n```text\n{tail}\n```")
