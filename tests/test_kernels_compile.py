"""Every Triton kernel configuration of the CUDA path compiles for an H100 (sm_90) to a cubin, without a GPU.

Triton's interpreter, which runs the kernels in the other tests on the CPU, executes their Python: it accepts code
that the compiler rejects or lowers differently (types, layouts, constexpr use). Compiling each kernel as the
training step launches it catches those before a GPU does. The compiler runs in a process of its own
(tests/helpers/compile_kernels.py), since this one interprets the kernels.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

HELPER = Path(__file__).parent / "helpers" / "compile_kernels.py"
ROOT = Path(__file__).parents[1]


@pytest.mark.slow  # Triton's compiler for sm_90, in another process
def test_every_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, str(HELPER)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    compiled = [line for line in done.stdout.splitlines() if line.startswith("compiled ")]
    # 4 groupings x 2 directions, 3 dtypes x (2 pointwise + 3 row sums), 2 re-centring dtypes
    assert len(compiled) == 8 + 15 + 2, done.stdout
