"""Compile every Triton kernel configuration of the CUDA path for an H100 (sm_90), without a GPU: run as a script
in a process without TRITON_INTERPRET (tests/test_kernels_compile.py), where ``triton.jit`` gives compiler
functions, not the interpreter's, and with whichever Triton comes first on the path. Prints the Triton version,
then one line per kernel configuration compiled to a cubin, with the registers a thread and the bytes a thread
spilled that Triton's own ptxas reports (``ptxas -v``, its log printed with TRITON_DUMP_PTXAS_LOG=1), the integer
divisions and remainders in its PTX, its widest global load (v4: four elements at a time) and which of the
recipe's shapes it is."""

from __future__ import annotations

import contextlib
import io
import os
import re
import sys

assert "TRITON_INTERPRET" not in os.environ, "the kernels must be compiled, not interpreted"
os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"  # read when Triton compiles: ptxas -v's log on stdout

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from mabn.norm import cenconv_kernels, mabn_kernels, row_kernels  # noqa: E402

H100 = GPUTarget("cuda", 90, 32)
F64 = {name: "fp64" for name in ("hw", "momentum_", "eps_", "clip_", "psi_count")}
I32 = {name: "i32" for name in ("C", "moving_first", "renorm_first", "R", "LV", "CONVS", "MAX_FILTERS")}
COUNTERS = {"iters_ptr": "*i64", "count_ptr": "*i64", "flags_ptr": "*i1", "tickets_ptr": "*i32"}
# (groups, samples a group, stats): stage 1's ghost batches of 2 at 32 a device with the SMA; stage 2's 2 a device;
# a whole batch; the EMA and batch statistics, at group counts that are not powers of 2.
GROUPINGS = [(16, 2, 1), (1, 2, 1), (1, 32, 1), (3, 2, 2), (5, 3, 0)]
RECIPE = {(16, 2, 1): "stage 1", (1, 2, 1): "stage 2"}
# Rows of the passes over x: ResNet's last stage at 224 px (7 x 7), stage 2's features at output stride 8 (90 x 90)
# and its stem's output at crop 713 (357 x 357, odd).
LENGTHS = {49: "stage 1", 8100: "stage 2", 127449: "stage 2"}
USAGE = re.compile(r"Used (\d+) registers")
SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
DIVISIONS = re.compile(r"\b(?:div|rem)\.[su]")  # integer division and remainder instructions of the PTX
VECTOR_LOADS = re.compile(r"ld\.global(?:\.\w+)*?\.v(\d)")


def _compile(name: str, fn, types: dict[str, str], constexprs: dict, num_warps: int, recipe: str = "-") -> None:
    names = fn.arg_names
    signature = {n: "constexpr" if n in constexprs else types.get(n, F64.get(n, I32.get(n, "*fp32"))) for n in names}
    # Every pointer 16-byte aligned, as Triton specializes a launch on a fresh allocation: what lets it vectorize.
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if signature[n].startswith("*")}
    constants = {(names.index(k),): v for k, v in constexprs.items()}
    src = ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=aligned)
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        compiled = triton.compile(src, target=H100, options={"num_warps": num_warps})
    assert compiled.asm["cubin"], name
    registers, spills = USAGE.search(log.getvalue()), SPILLS.search(log.getvalue())
    assert registers and spills, f"{name}: no ptxas -v log (a cached compile?)\n{log.getvalue()}"
    spilled = int(spills[1]) + int(spills[2])
    ptx = compiled.asm["ptx"]
    divisions = len(DIVISIONS.findall(ptx))
    vector = max((int(v) for v in VECTOR_LOADS.findall(ptx)), default=1)
    print(
        f"compiled {name} | registers={registers[1]} | spilled={spilled} | divisions={divisions} | "
        f"widest_load=v{vector} | recipe={recipe}",
        flush=True,
    )


def main() -> None:
    print(f"triton {triton.__version__}", flush=True)
    for groups, size, stats in GROUPINGS:
        extents = mabn_kernels._extents(groups, size, 16)
        tag, recipe = f"G{groups}-B{size}-stats{stats}", RECIPE.get((groups, size, stats), "-")
        block, warps = mabn_kernels.MAX_BLOCK, mabn_kernels.STAT_WARPS
        forward = dict(**extents, STATS=stats, RENORM=True, POLICY=True, EMA_FIRST=stats == 2, BLOCK=block)
        types = {**COUNTERS, "policy_ptr": "*i32"}
        _compile(f"forward {tag}", mabn_kernels.forward_kernel, types, forward, warps, recipe)
        backward = dict(**extents, STATS=stats, SCALED=stats == 1, BLOCK=block)
        _compile(f"backward {tag}", mabn_kernels.backward_kernel, COUNTERS, backward, warps, recipe)
    for dtype, itemsize in (("fp32", 4), ("bf16", 2), ("fp64", 8)):
        pointers = {n: f"*{dtype}" for n in ("a_ptr", "b_ptr", "out_ptr", "g_ptr", "x_ptr")}
        for length, stage in LENGTHS.items():
            recipe = stage if dtype != "fp64" else "-"  # the recipe trains in float32 or bf16-mixed
            vec = row_kernels._vec(length, itemsize)
            for two in (True, False):
                rows, block = row_kernels._tile(length, row_kernels.AFFINE_TILE)
                consts = dict(TWO=two, VEC=vec, ROWS=rows, BLOCK=block)
                _compile(f"affine {dtype} two={two} L={length}", row_kernels.affine_kernel, pointers, consts, 4, recipe)
            rows, block = row_kernels._tile(length)
            consts = dict(VEC=vec, ROWS=rows, BLOCK=block)
            _compile(f"row sums {dtype} L={length}", row_kernels.row_sums_kernel, pointers, consts, 4, recipe)
    for dtype in ("fp32", "fp64"):
        consts = dict(FILTERS=cenconv_kernels.FILTERS, BLOCK=cenconv_kernels.BLOCK)
        types = {"table_ptr": "*i64", "like_ptr": f"*{dtype}"}
        _compile(f"recentre {dtype}", cenconv_kernels.recentre_kernel, types, consts, 4)


if __name__ == "__main__":
    sys.exit(main())
