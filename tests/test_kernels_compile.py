"""Every Triton kernel configuration of the CUDA path compiles for an H100 (sm_90) to a cubin, without a GPU, with
each Triton the supported torch releases bring: 3.6.0 (torch 2.11) and 3.8.0 (the pinned torch).

Triton's interpreter, which runs the kernels in the other tests on the CPU, executes their Python: it accepts code
that the compiler rejects or lowers differently (types, layouts, constexpr use). Compiling each kernel as the
training step launches it catches those before a GPU does, and ptxas's report of each (``ptxas -v``, Triton's own
ptxas) holds the recipe's shapes to what keeps them fast: at most 168 registers a thread and no spill. The passes
over x divide no element's index and load 16 bytes at a time where the row length allows. The compiler runs in a
process of its own (tests/helpers/compile_kernels.py), since this one interprets the kernels; a Triton other than
the environment's comes from ``.venv-triton<version>/`` (``make triton-compilers``).
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

HELPER = Path(__file__).parent / "helpers" / "compile_kernels.py"
ROOT = Path(__file__).parents[1]
TRITONS = ("3.6.0", "3.8.0")
# 5 groupings x 2 directions; 3 dtypes x 3 row lengths x (2 pointwise + 1 row sums); 2 re-centring dtypes
CONFIGURATIONS = 10 + 27 + 2
MAX_REGISTERS = 168  # a thread's: 3 programs of 4 warps (6 of 2) fit in an SM's 65536 registers


def _triton_path(version: str) -> list[str] | None:
    """The folders to put before the checkout's src/ for Triton ``version``: none for the environment's own, its
    ``make triton-compilers`` folder otherwise; None where it is not installed."""
    if importlib.metadata.version("triton") == version:
        return []
    folder = ROOT / f".venv-triton{version}"
    return [str(folder)] if (folder / "triton").is_dir() else None


def _report(stdout: str) -> dict[str, dict[str, str]]:
    """Each compiled configuration's fields, by its name: registers, spilled, divisions, widest_load, recipe."""
    rows = {}
    for line in stdout.splitlines():
        if line.startswith("compiled "):
            name, *fields = line.removeprefix("compiled ").split(" | ")
            rows[name] = dict(field.split("=", 1) for field in fields)
    return rows


@pytest.mark.slow  # Triton's compiler for sm_90, in another process, ~1 minute a Triton
@pytest.mark.parametrize("version", TRITONS)
def test_every_kernel_compiles_for_sm90_within_its_registers(version, tmp_path):
    path = _triton_path(version)
    if path is None:
        pytest.skip(f"Triton {version} is not installed here: make triton-compilers")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([*path, str(ROOT / "src"), env.get("PYTHONPATH", "")])
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # empty: every configuration compiles, and ptxas reports it
    done = subprocess.run([sys.executable, str(HELPER)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith(f"triton {version}\n"), done.stdout[:200]
    rows = _report(done.stdout)
    assert len(rows) == CONFIGURATIONS, done.stdout
    recipe = {name: row for name, row in rows.items() if row["recipe"] != "-"}
    assert {row["recipe"] for row in recipe.values()} == {"stage 1", "stage 2"}
    too_many = {
        n: (row["registers"], row["spilled"])
        for n, row in recipe.items()
        if int(row["registers"]) > MAX_REGISTERS or row["spilled"] != "0"
    }
    assert not too_many, f"(registers, bytes spilled) a thread at the recipe's shapes: {too_many}"
    passes = {name: row for name, row in rows.items() if name.startswith(("affine", "row sums"))}
    assert {name: row["divisions"] for name, row in passes.items() if row["divisions"] != "0"} == {}
    # Rows of 8100 float32 elements start 16-byte aligned: four elements a load.
    assert {name: row["widest_load"] for name, row in passes.items() if "fp32" in name and "L=8100" in name} == {
        "affine fp32 two=True L=8100": "v4",
        "affine fp32 two=False L=8100": "v4",
        "row sums fp32 L=8100": "v4",
    }
