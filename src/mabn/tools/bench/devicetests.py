"""The checkout's kernel tests on the device, as a section of the GPU check: those of the default suite (``-m "gpu and
not slow"``) that hold the Triton kernels to the float64 references; ``make test-gpu`` runs every GPU test.

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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]  # the checkout: src/mabn/tools/bench/ -> .
TESTS = (
    "tests/test_mabn_kernels.py::test_fused_matches_reference",
    "tests/test_mabn_kernels.py::test_fused_low_precision_input_equals_torch_ops",
    "tests/test_row_kernels.py",
    "tests/test_recentre_kernel.py",
)


def command() -> list[str]:
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu and not slow", *TESTS]


def run(device: str, deadline: float) -> tuple[bool, str]:
    """(passed, the Markdown): the tests with MABN_TEST_DEVICE=``device``, stopped at ``deadline``
    (``time.monotonic()``)."""
    shown = f"`MABN_TEST_DEVICE={device} {shlex.join(['python', *command()[1:]])}`"
    if not all((ROOT / t.split("::")[0]).is_file() for t in TESTS):
        return False, f"### Kernel tests on the device\n\n{shown}: no checkout's tests beside the package ({ROOT})"
    env = {**os.environ, "MABN_TEST_DEVICE": device}
    env.pop("TRITON_INTERPRET", None)
    started = time.monotonic()
    try:
        done = subprocess.run(command(), cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=max(1.0, deadline - started))  # fmt: skip
        passed, out = done.returncode == 0, done.stdout + done.stderr
        verdict = "passed" if passed else f"failed (exit {done.returncode})"
    except subprocess.TimeoutExpired as stopped:
        passed, out = False, (stopped.stdout or b"").decode(errors="replace")
        verdict = "stopped at the section's limit"
    tail = "\n".join(line for line in out.strip().splitlines()[-15:])
    return passed, (
        f"### Kernel tests on the device\n\n{shown}: {verdict} in {time.monotonic() - started:.0f} s\n\n"
        f"```text\n{tail}\n```"
    )
