"""Compile every Triton kernel configuration of the CUDA path for an H100 (sm_90), without a GPU: run as a script
in a process without TRITON_INTERPRET (tests/test_kernels_compile.py), where ``triton.jit`` gives compiler
functions, not the interpreter's. Prints one line per kernel configuration compiled to a cubin."""

from __future__ import annotations

import os
import sys

assert "TRITON_INTERPRET" not in os.environ, "the kernels must be compiled, not interpreted"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from mabn.norm import cenconv_kernels, mabn_kernels, row_kernels  # noqa: E402

H100 = GPUTarget("cuda", 90, 32)
F64 = {name: "fp64" for name in ("hw", "momentum_", "eps_", "clip_", "psi_count")}
I32 = {name: "i32" for name in ("C", "moving_first", "renorm_first", "numel", "L", "R", "CONVS", "MAX_FILTERS")}
COUNTERS = {"iters_ptr": "*i64", "count_ptr": "*i64", "flags_ptr": "*i1", "tickets_ptr": "*i32"}
# (groups, samples a group, stats): stage 1's ghost batches of 2 at 32 a device with the SMA; a whole batch; the EMA
# and batch statistics, at group counts that are not powers of 2.
GROUPINGS = [(16, 2, 1), (1, 32, 1), (3, 2, 2), (5, 3, 0)]


def _compile(name: str, fn, types: dict[str, str], constexprs: dict[str, object], num_warps: int) -> None:
    names = fn.arg_names
    signature = {n: "constexpr" if n in constexprs else types.get(n, F64.get(n, I32.get(n, "*fp32"))) for n in names}
    src = ASTSource(fn=fn, signature=signature, constexprs={(names.index(k),): v for k, v in constexprs.items()})
    compiled = triton.compile(src, target=H100, options={"num_warps": num_warps})
    assert compiled.asm["cubin"], name
    print(f"compiled {name}", flush=True)


def main() -> None:
    for groups, size, stats in GROUPINGS:
        extents = mabn_kernels._extents(groups, size, 16)
        tag = f"G{groups}-B{size}-stats{stats}"
        forward = dict(**extents, STATS=stats, RENORM=True, POLICY=True, EMA_FIRST=stats == 2, BLOCK=32)
        _compile(f"forward {tag}", mabn_kernels.forward_kernel, {**COUNTERS, "policy_ptr": "*i32"}, forward, 1)
        backward = dict(**extents, STATS=stats, SCALED=stats == 1, BLOCK=32)
        _compile(f"backward {tag}", mabn_kernels.backward_kernel, COUNTERS, backward, 1)
    for dtype in ("fp32", "bf16", "fp64"):
        pointers = {n: f"*{dtype}" for n in ("a_ptr", "b_ptr", "out_ptr", "g_ptr", "x_ptr")}
        for two in (True, False):
            consts = dict(TWO=two, BLOCK=row_kernels.AFFINE_BLOCK)
            _compile(f"affine {dtype} two={two}", row_kernels.affine_kernel, pointers, consts, 4)
        for length in (49, 3136, 127449):
            rows, block = row_kernels._tile(length)
            consts = dict(ROWS=rows, BLOCK=block)
            _compile(f"row sums {dtype} L={length}", row_kernels.row_sums_kernel, pointers, consts, 4)
    for dtype in ("fp32", "fp64"):
        consts = dict(FILTERS=cenconv_kernels.FILTERS, BLOCK=cenconv_kernels.BLOCK)
        types = {"table_ptr": "*i64", "like_ptr": f"*{dtype}"}
        _compile(f"recentre {dtype}", cenconv_kernels.recentre_kernel, types, consts, 4)


if __name__ == "__main__":
    sys.exit(main())
