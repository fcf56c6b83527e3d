"""MABN2d's per-channel statistic steps as one Triton kernel per direction (CUDA).

``_forward_stats`` and ``_backward_stats`` in ``mabn.py`` define the semantics and stay the path for the CPU
and for ``sync_stats``. Written with torch ops they launch ~40 tiny kernels per layer and direction, which
leaves a GPU training step bound by the host launching them (about 4x BN's step time on an H200 at batch 2).
Here each direction is one launch over a grid of programs, each of a block of channels (channels are independent).
Each program loads its channels' inputs of every group, the history and the new statistics as tiles (G, B and M are
compile-time constants), computes its channels' statistics and outputs from registers and commits them to the
layer's buffers in place, keeping the values it overwrites in a scratch area. A non-finite statistic must leave
every buffer untouched, a verdict over all channels: each program takes a ticket (one atomic add on the layer's
``tickets``, which also counts whether it met a non-finite statistic), and the program that takes the last one
writes the kept values back to every channel and sets the layer's sticky flag if any program met one, else
advances the step counters; then it zeroes the tickets for the next launch (and every CUDA-graph replay). No
program waits for another, so the programs may run in any order: side by side on a GPU, one after another in
Triton's interpreter. A non-finite statistic is rare (an error, or an overflow that a loss scaler skips): the
usual launch writes each buffer once.

Scalars that enter float64 arithmetic are passed as fp64 and cast to the statistics' dtype inside, so a
float32 step rounds as torch does with Python scalars and a float64 step keeps float64 exactly; square
roots and divisions use the correctly rounded forms (``sqrt_rn``, ``div_rn``), as torch does.
"""

# No "from __future__ import annotations": Triton reads the tl.float64 annotations as objects.
import functools
import types
from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor, nn

from ._mabn_types import BackwardStats, ForwardStats, StepConfig
from .launcher import Launcher
from .phase import phase
from .row_kernels import grad_input, row_sums, scale_shift

# The statistic steps here; the passes over x they feed and follow, from row_kernels.
__all__ = ["backward_stats", "forward_stats", "grad_input", "row_sums", "scale_shift"]

STATS_CODE = {"batch": 0, "sma": 1, "ema": 2}

# The one phase rule, compiled into the kernel. Rebound to this module's globals: Triton's interpreter (the CPU tests)
# runs a jit function with the triton.language of its module, which phase.py, importable without Triton, lacks.
_phase = triton.jit(types.FunctionType(phase.__code__, globals(), "phase"))

# A program's ticket adds 1, and _BAD if it met a non-finite statistic: the sum counts the programs below _BAD and
# those that met one above it (in int32 for a grid of under 2^15 programs: a million channels).
_BAD = tl.constexpr(1 << 16)


@triton.jit
def _finite(v):
    return tl.abs(v) < float("inf")  # false for NaN too


@triton.jit
def _div(a, b):
    if a.dtype == tl.float32:
        return tl.div_rn(a, b)  # Triton's float32 "/" is approximate
    return a / b


@triton.jit
def _sqrt(a):
    if a.dtype == tl.float32:
        return tl.sqrt_rn(a)
    return tl.sqrt(a)


@triton.jit
def _row(tile, rows, k):
    """Row k of a (rows, BLOCK) tile held in registers."""
    return tl.sum(tl.where((rows == k)[:, None], tile, 0.0), axis=0)


@triton.jit
def _stream(
    hist_ptr,
    undo_ptr,
    new_ptr,
    new,
    active_ptr,
    gates,
    moving,
    count,
    ema_prev,
    momentum,
    cols,
    cmask,
    C,
    G: tl.constexpr,
    M: tl.constexpr,
    MP: tl.constexpr,
    STATS: tl.constexpr,
):
    """``_stream_stat`` of mabn.py for one block of channels: what each of the G groups uses (returned as a tile,
    with the stream EMA after the last group), the history shifted by G in place (its rows before, to ``undo``).

    ``new``: the groups' statistics (GP, BLOCK) in registers, also stored at ``new_ptr`` (read back for the shift).
    Group k uses the moving statistic when ``moving``, the stream holds M statistics before it (``count`` + k >=
    M) and ``gates[k]`` is set: scalars that every program evaluates alike, so none reads another's output.
    Program 0 writes these flags to ``active``. Every window is a masked sum of tiles in registers, so no load
    waits on another."""
    dt = ema_prev.dtype
    gk = tl.arange(0, new.shape[0])
    hi = tl.arange(0, MP)
    hmask = (hi < M)[:, None] & cmask[None, :]
    history = tl.load(hist_ptr + hi[:, None] * C + cols[None, :], mask=hmask, other=0.0)
    old = history.to(dt)
    used = new
    flags = tl.zeros(gk.shape, tl.int32)
    e = ema_prev
    for k in tl.static_range(G):
        row = _row(new, gk, k)
        if STATS == 1:  # SMA of the M statistics up to and including group k: rows k + 1 .. k + M of history ++ new
            in_history = tl.sum(tl.where((hi > k)[:, None], old, 0.0), axis=0)
            in_new = tl.sum(tl.where(((gk <= k) & (gk > k - M))[:, None], new, 0.0), axis=0)
            smoothed = _div(in_history + in_new, tl.full(row.shape, M, dt))
        elif STATS == 2:
            e = momentum * e + (1.0 - momentum) * row
            smoothed = e
        else:
            smoothed = row
        active = moving & (count + k >= M) & (tl.sum(tl.where(gk == k, gates, 0), axis=0) != 0)
        used = tl.where((gk == k)[:, None], tl.where(active, smoothed, row)[None, :], used)
        flags = tl.where(gk == k, active.to(tl.int32), flags)
    tl.store(active_ptr + gk, flags.to(active_ptr.dtype.element_ty), mask=(gk < G) & (tl.program_id(0) == 0))
    # Rows G .. G+M-1 of history ++ new become the history; every row is read before any is written.
    src = hi + G
    shifted = tl.load(hist_ptr + src[:, None] * C + cols[None, :], mask=hmask & (src < M)[:, None], other=0.0)
    later = tl.load(new_ptr + (src - M)[:, None] * C + cols[None, :], mask=hmask & (src >= M)[:, None], other=0.0)
    # Row i + G is loaded by the thread that holds element (i, c) of the tile and overwritten by the thread that holds
    # (i + G, c): the shift passes values between threads through memory, and one thread's program order does not
    # order another thread's accesses. The barrier completes every thread's loads of the history (above and at the
    # top) before any thread stores, whatever the warps and the layouts; without it the order would rest on a
    # program being one warp whose loads all issue first. It costs one bar.sync per program.
    tl.debug_barrier()
    tl.store(undo_ptr + hi[:, None] * C + cols[None, :], history, mask=hmask)
    # In the statistics' dtype, as the torch-op steps keep it (history ++ new in the statistics' dtype).
    tl.store(
        hist_ptr + hi[:, None] * C + cols[None, :], tl.where((src < M)[:, None], shifted.to(dt), later), mask=hmask
    )
    return used, e


@triton.jit
def _last_ticket(tickets_ptr, nbad):
    """Takes this program's ticket: (whether it is the launch's last program, whether every program found its
    statistics finite). One atomic add of 1, plus _BAD if the program met a non-finite statistic; its release
    publishes the program's writes (the barrier orders every thread's before it) to the last program."""
    tl.debug_barrier()
    mine = 1 + (nbad != 0).to(tl.int32) * _BAD
    total = tl.atomic_add(tickets_ptr, mine, sem="acq_rel") + mine
    return total % _BAD == tl.num_programs(0), total < _BAD


@triton.jit
def _restore(hist_ptr, running_ptr, undo_ptr, C, M: tl.constexpr, BLOCK: tl.constexpr):
    """Every channel's history and running average back to what the programs saved in ``undo`` (M history rows,
    then the running average), bit for bit."""
    for c0 in range(0, C, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        cmask = cols < C
        for i in tl.static_range(M):
            tl.store(hist_ptr + i * C + cols, tl.load(undo_ptr + i * C + cols, mask=cmask), mask=cmask)
        tl.store(running_ptr + cols, tl.load(undo_ptr + M * C + cols, mask=cmask), mask=cmask)


@triton.jit
def forward_kernel(
    norm_ptr,
    weight_ptr,
    hist_ptr,
    running_ptr,
    iters_ptr,
    count_ptr,
    undo_ptr,
    chi2_ptr,
    var_ptr,
    r_ptr,
    active_ptr,
    ema_ptr,
    scale_ptr,
    flags_ptr,
    tickets_ptr,
    policy_ptr,
    C,
    hw: tl.float64,
    momentum_: tl.float64,
    eps_: tl.float64,
    clip_: tl.float64,
    moving_first,
    renorm_first,
    G: tl.constexpr,
    B: tl.constexpr,
    M: tl.constexpr,
    GP: tl.constexpr,
    BP: tl.constexpr,
    MP: tl.constexpr,
    STATS: tl.constexpr,
    RENORM: tl.constexpr,
    POLICY: tl.constexpr,
    EMA_FIRST: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """norm (N, C): per-sample l2 norms over H*W, N = G * B -> ``_forward_stats``'s outputs and the per-sample
    scale weight * r / sqrt(var + eps) (N, C, in the statistics' dtype) for this program's BLOCK channels,
    committed unless some program met a non-finite chi^2: then the last program restores every buffer and sets
    flags[0] (sticky) instead of a verdict. ``undo``: (M + 1) * C of the buffers' dtype, scratch. GP, BP, MP: G, B
    and M rounded up to powers of 2, the tiles' extents."""
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    cmask = cols < C
    gk = tl.arange(0, GP)
    bj = tl.arange(0, BP)
    dt = norm_ptr.dtype.element_ty
    momentum, eps, clip = tl.full((), momentum_, dt), tl.full((), eps_, dt), tl.full((), clip_, dt)
    # The buffers' old values in their own dtype (the history's and the running average's, the layer's), so that a
    # restore is exact also where the buffers hold more bits than the statistics.
    undo = undo_ptr.to(hist_ptr.dtype)
    gmask = (gk < G)[:, None] & cmask[None, :]
    per_sample = ((gk * B)[:, None, None] + bj[None, :, None]) * C + cols[None, None, :]
    smask = gmask[:, None, :] & (bj < B)[None, :, None]
    # chi^2 of every group: equal counts, so the mean of per-sample chi^2
    v = tl.load(norm_ptr + per_sample, mask=smask, other=0.0)
    chi = _div(tl.sum(_div(v * v, tl.full(v.shape, hw, dt)), axis=1), tl.full((GP, BLOCK), B, dt))
    nbad = tl.sum(tl.sum((gmask & ~_finite(chi)).to(tl.int32), axis=1), axis=0)
    per_group = gk[:, None] * C + cols[None, :]
    tl.store(chi2_ptr + per_group, chi, mask=gmask)
    t = tl.load(iters_ptr) + 1
    count = tl.load(count_ptr)
    if POLICY:  # read here, not passed by value, so that a captured CUDA graph follows the callback
        moving = tl.load(policy_ptr) != 0
        renorm_on = tl.load(policy_ptr + 1) != 0
    else:
        moving, renorm_on = _phase(t, moving_first, renorm_first)
    tl.debug_barrier()  # chi^2 is read back by the history's shift
    running_old = tl.load(running_ptr + cols, mask=cmask, other=1.0)
    ema_prev = running_old.to(dt)  # what r compares with
    ema_base = ema_prev  # the EMA before this forward's update
    if EMA_FIRST:  # a stream's first forward starts the EMA at its groups' mean chi^2
        ema_base = tl.where(t == 1, _div(tl.sum(chi, axis=0), tl.full((BLOCK,), G, dt)), ema_prev)
    var, e = _stream(
        hist_ptr,
        undo,
        chi2_ptr,
        chi,
        active_ptr,
        tl.full((GP,), 1, tl.int32),
        moving & (STATS != 0),
        count,
        ema_base,
        momentum,
        cols,
        cmask,
        C,
        G,
        M,
        MP,
        STATS,
    )
    var = tl.where(gmask, var, 1.0)
    std = _sqrt(var + eps)
    r = tl.full((GP, BLOCK), 1.0, dt)
    if RENORM:
        lo = _div(tl.full((GP, BLOCK), 1.0, dt), tl.full((GP, BLOCK), clip, dt))
        clipped = tl.minimum(tl.maximum(_div(std, _sqrt(ema_prev + eps)[None, :]), lo), clip)
        r = tl.where(renorm_on, clipped, r)
    tl.store(var_ptr + per_group, var, mask=gmask)
    tl.store(r_ptr + per_group, r, mask=gmask)
    w = tl.load(weight_ptr + cols, mask=cmask, other=0.0).to(dt)
    scale = _div(w[None, :] * r, std)
    tl.store(scale_ptr + per_sample, tl.broadcast_to(scale[:, None, :], (GP, BP, BLOCK)), mask=smask)
    if STATS == 2:
        ema = e
    else:
        var_mean = _div(tl.sum(tl.where(gmask, var, 0.0), axis=0), tl.full((BLOCK,), G, dt))
        ema = momentum * ema_base + (1.0 - momentum) * var_mean
    tl.store(ema_ptr + cols, ema, mask=cmask)
    tl.store(undo + M * C + cols, running_old, mask=cmask)
    tl.store(running_ptr + cols, ema, mask=cmask)
    last, ok = _last_ticket(tickets_ptr, nbad)
    if last:
        if ok:
            tl.store(iters_ptr, t)
            tl.store(count_ptr, count + G)
        else:
            _restore(hist_ptr, running_ptr, undo, C, M, BLOCK)
            tl.store(flags_ptr, True)
        tl.store(tickets_ptr, 0)  # the next launch (or CUDA-graph replay) starts the count again


@triton.jit
def backward_kernel(
    dx_ptr,
    dsum_ptr,
    r_ptr,
    var_ptr,
    active_ptr,
    weight_ptr,
    hist_ptr,
    running_ptr,
    count_ptr,
    undo_ptr,
    psi_ptr,
    psi_bar_ptr,
    psi_active_ptr,
    coef_ptr,
    grad_weight_ptr,
    grad_bias_ptr,
    flags_ptr,
    tickets_ptr,
    scale_ptr,
    C,
    psi_count: tl.float64,
    momentum_: tl.float64,
    eps_: tl.float64,
    G: tl.constexpr,
    B: tl.constexpr,
    M: tl.constexpr,
    GP: tl.constexpr,
    BP: tl.constexpr,
    MP: tl.constexpr,
    STATS: tl.constexpr,
    SCALED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Per-(sample, channel) sums of dL/dout * x and of dL/dout (N, C) -> ``_backward_stats``'s outputs for this
    program's BLOCK channels (z = x / sqrt(var + eps): its group's std divides the sum; dL/dx's coefficient per
    sample, N * C, in the statistics' dtype), committed unless some program met a non-finite psi: then the last
    program restores every buffer and sets flags[1], except under a loss scale (SCALED: read from scale_ptr, as the
    policy is)."""
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    cmask = cols < C
    gk = tl.arange(0, GP)
    bj = tl.arange(0, BP)
    dt = var_ptr.dtype.element_ty
    momentum, eps = tl.full((), momentum_, dt), tl.full((), eps_, dt)
    undo = undo_ptr.to(hist_ptr.dtype)  # as in forward_kernel
    tickets = tickets_ptr + 1  # the backward's
    loss_scale = tl.full((), 1.0, dt)
    if SCALED:
        loss_scale = tl.load(scale_ptr).to(dt)
    gmask = (gk < G)[:, None] & cmask[None, :]
    per_sample = ((gk * B)[:, None, None] + bj[None, :, None]) * C + cols[None, None, :]
    smask = gmask[:, None, :] & (bj < B)[None, :, None]
    per_group = gk[:, None] * C + cols[None, :]
    w = tl.load(weight_ptr + cols, mask=cmask, other=0.0).to(dt)
    var = tl.load(var_ptr + per_group, mask=gmask, other=1.0)
    r = tl.load(r_ptr + per_group, mask=gmask, other=1.0)
    dz = _div(tl.sum(tl.load(dx_ptr + per_sample, mask=smask, other=0.0).to(dt), axis=1), _sqrt(var + eps))
    grad_bias = tl.sum(tl.sum(tl.load(dsum_ptr + per_sample, mask=smask, other=0.0).to(dt), axis=1), axis=0)
    psi = _div(w[None, :] * r * dz, tl.full((GP, BLOCK), psi_count, dt))
    if SCALED:
        psi = _div(psi, tl.full((GP, BLOCK), loss_scale, dt))
    nbad = tl.sum(tl.sum((gmask & ~_finite(psi)).to(tl.int32), axis=1), axis=0)
    tl.store(psi_ptr + per_group, psi, mask=gmask)
    tl.store(grad_weight_ptr + cols, tl.sum(r * dz, axis=0), mask=cmask)
    tl.store(grad_bias_ptr + cols, grad_bias, mask=cmask)
    count = tl.load(count_ptr)
    tl.debug_barrier()  # psi is read back by the history's shift
    running_old = tl.load(running_ptr + cols, mask=cmask, other=0.0)
    # psi_active[k] = active[k] (the forward's output) and the psi stream holds M statistics before group k.
    psi_bar, e = _stream(
        hist_ptr,
        undo,
        psi_ptr,
        psi,
        psi_active_ptr,
        tl.load(active_ptr + gk, mask=gk < G, other=0.0),
        True,
        count,
        running_old.to(dt),
        momentum,
        cols,
        cmask,
        C,
        G,
        M,
        MP,
        STATS,
    )
    tl.store(psi_bar_ptr + per_group, psi_bar, mask=gmask)
    if SCALED:
        psi_bar = psi_bar * loss_scale
    coef = _div(-psi_bar, var + eps)
    tl.store(coef_ptr + per_sample, tl.broadcast_to(coef[:, None, :], (GP, BP, BLOCK)), mask=smask)
    tl.store(undo + M * C + cols, running_old, mask=cmask)
    tl.store(running_ptr + cols, e, mask=cmask)
    last, ok = _last_ticket(tickets, nbad)
    if last:
        if ok:
            tl.store(count_ptr, count + G)
        else:
            _restore(hist_ptr, running_ptr, undo, C, M, BLOCK)
            if not SCALED:
                tl.store(flags_ptr + 1, True)
        tl.store(tickets, 0)


# Channels per program: at 32 channels a program the widest layers (4096 channels, 128 programs) still have an SM
# each on an H100 (132). A launch takes about one program's time, which is latency: written as a loop over the
# groups that loads each group's values inside it, each step waited for its loads, and a forward at G = 16, M = 16
# took 21 to 24 µs on an H200 at any width and block. The kernels above load every tile they need at once (the
# groups' samples, the history, the new statistics) and compute the groups from registers: two warps a program
# share those tiles, where one warp held twice as many values a thread (at stage 1's G = 16, M = 16: 204 and 209
# registers with Triton 3.8, 238 and 254 with Triton 3.6, and stage 2's G = 1 forward spilled on 3.6; with two
# warps at most 166 and no spill, tests/test_kernels_compile.py).
MAX_BLOCK = 32
STAT_WARPS = 2


@functools.cache  # triton.next_power_of_2 is a constexpr function, microseconds per host call
def _block(channels: int, max_block: int) -> int:
    return min(triton.next_power_of_2(channels), max_block)


@functools.cache
def _extents(groups: int, group_size: int, buffer_size: int) -> dict[str, int]:
    """The kernels' G, B, M and the tiles' extents, each rounded up to a power of 2 (GP, BP, MP)."""
    g, b, m = groups, group_size, buffer_size
    pow2 = triton.next_power_of_2
    return dict(G=g, B=b, M=m, GP=pow2(g), BP=pow2(b), MP=pow2(m))


@functools.cache
def _undo_size(m: int, channels: int, buffer_bytes: int, stat_bytes: int) -> int:
    """Elements of the statistics' dtype that hold (m + 1) * C of the buffers' dtype, rounded up to 16 bytes so
    that the outputs after them in the same allocation keep their alignment."""
    return -(-(m + 1) * channels * buffer_bytes // 16) * 16 // stat_bytes


def _grid(meta: dict) -> tuple[int]:
    return (triton.cdiv(meta["C"], meta["BLOCK"]),)


_forward = Launcher(forward_kernel, _grid, num_warps=STAT_WARPS)
_backward = Launcher(backward_kernel, _grid, num_warps=STAT_WARPS)


def forward_stats(
    norm: Tensor, hw: int, groups: int, weight: Tensor, layer: nn.Module, cfg: StepConfig
) -> tuple[Tensor, ForwardStats]:
    """``_forward_stats(_group_chi2(norm, groups, hw), ...)`` of mabn.py and the per-sample scale
    weight * r / sqrt(var + eps) (N * C, in the statistics' dtype, for ``row_kernels``) in one launch; the
    statistics flat (the (G, C) ones as G * C, ``active`` as 0/1 floats), the verdict in ``layer``'s flags
    (``ok`` None)."""
    streams, agreement = forward_state(layer, norm.device)
    sizes = forward_sizes(*norm.shape, groups, cfg.buffer_size, streams[0].dtype, norm.dtype)
    parts = norm.new_empty(sum(sizes)).split(sizes)
    forward_launch(parts, norm, hw, groups, weight, streams, agreement, cfg)
    return forward_record(parts)


def forward_state(layer: nn.Module, device: torch.device) -> tuple[tuple[Tensor, ...], tuple[Tensor, Tensor, Tensor]]:
    """What the forward kernel reads and updates of ``layer``: its chi^2 stream (history, EMA, step and statistic
    counters) and its (non-finite flags, tickets, policy flags) on ``device``."""
    streams = (layer.buffer_x2, layer.running_var, layer.iters, layer.count_x2)
    return streams, (layer.nonfinite_flags(device), layer.tickets(device), layer.policy_flags(device))


def backward_state(layer: nn.Module, device: torch.device) -> tuple[tuple[Tensor, ...], tuple[Tensor, Tensor]]:
    """What the backward kernel reads and updates of ``layer``: its psi stream (history, EMA, counter) and its
    (non-finite flags, tickets) on ``device``."""
    return (layer.buffer_gz, layer.running_psi, layer.count_gz), (layer.nonfinite_flags(device), layer.tickets(device))


@functools.cache
def forward_sizes(
    n: int, c: int, groups: int, buffer_size: int, history: torch.dtype, stat: torch.dtype
) -> tuple[int, ...]:
    """The sizes in ``forward_launch``'s one allocation, in the statistics' dtype: the kernel's scratch, chi2, var,
    r, ema, scale, active. One allocation, since host time, not memory, is what counts here; the scratch first,
    where its alignment is the allocation's."""
    gc = groups * c
    return (_undo_size(buffer_size, c, history.itemsize, stat.itemsize), gc, gc, gc, c, n * c, groups)


def forward_record(parts: Sequence[Tensor]) -> tuple[Tensor, ForwardStats]:
    """The scale and the statistics among the parts of ``forward_launch``'s allocation."""
    _, chi2, var, r, ema, scale, active = parts
    return scale, ForwardStats(chi2, var, r, active, ema, None)


def forward_launch(
    parts: Sequence[Tensor],
    norm: Tensor,
    hw: int,
    groups: int,
    weight: Tensor,
    streams: tuple[Tensor, Tensor, Tensor, Tensor],
    agreement: tuple[Tensor, Tensor, Tensor],
    cfg: StepConfig,
) -> None:
    """The forward kernel on a layer's chi^2 stream (history, EMA, step and statistic counters), updated in place,
    and its (non-finite flags, tickets, policy flags), with its outputs in ``parts``, the split of one allocation
    by ``forward_sizes``."""
    n, c = norm.shape
    undo, chi2, var, r, ema, scale, active = parts
    first_steps = cfg.first_steps()
    consts = dict(
        **_extents(groups, n // groups, cfg.buffer_size),
        STATS=STATS_CODE[cfg.stats],
        RENORM=cfg.renorm,
        POLICY=cfg.policy is not None,
        EMA_FIRST=cfg.ema_start == "first",
        BLOCK=_block(c, MAX_BLOCK),
    )
    _forward(
        (
            *(norm, weight, *streams, undo, chi2, var, r, active, ema, scale, *agreement),
            *(c, float(hw), cfg.momentum, cfg.eps, cfg.renorm_clip, *first_steps),
        ),
        consts,
    )


def backward_stats(
    dout_x: Tensor,
    psi_count: int,
    dout_sum: Tensor,
    r: Tensor,
    var: Tensor,
    active: Tensor,
    weight: Tensor,
    groups: int,
    layer: nn.Module,
    cfg: StepConfig,
    loss_scale: Tensor | None = None,
) -> BackwardStats:
    """``_backward_stats`` of mabn.py in one launch, from ``row_kernels.row_sums``' per-(sample, channel) sums of
    dL/dout * x (``dout_x``, N * C) and of dL/dout and ``forward_stats``' flat outputs; the same outputs, flat (the
    coefficient of dL/dx per sample, N * C, in the statistics' dtype), the verdict in the flags."""
    streams, agreement = backward_state(layer, var.device)
    history = streams[0]
    c = weight.numel()
    # The parameters' gradients share the allocation where they have the statistics' dtype (float32 both, the usual
    # case). It is new at every backward, so a second backward of the graph (retain_graph) never writes into
    # gradients already handed out.
    grads = None if weight.dtype == var.dtype else (weight.new_empty(c), weight.new_empty(c))
    sizes = backward_sizes(dout_x.numel() // c, c, groups, cfg.buffer_size, history.dtype, var.dtype, grads is not None)
    parts = var.new_empty(sum(sizes)).split(sizes)
    backward_launch(
        parts, grads, dout_x, psi_count, dout_sum, r, var, active, weight, groups, streams, agreement, cfg, loss_scale
    )
    return backward_record(parts, grads)


@functools.cache
def backward_sizes(
    n: int, c: int, groups: int, buffer_size: int, history: torch.dtype, stat: torch.dtype, apart: bool
) -> tuple[int, ...]:
    """The sizes in ``backward_launch``'s one allocation, in the statistics' dtype: the kernel's scratch, psi,
    psi_bar, the psi flags, dL/dx's coefficients and, unless the parameters' gradients are ``apart``, the weight's
    and the bias's."""
    gc = groups * c
    sizes = (_undo_size(buffer_size, c, history.itemsize, stat.itemsize), gc, gc, groups, n * c)
    return sizes if apart else (*sizes, c, c)


def backward_record(parts: Sequence[Tensor], grads: tuple[Tensor, Tensor] | None) -> BackwardStats:
    """The statistics among the parts of ``backward_launch``'s allocation, the gradients too unless apart."""
    _, psi, psi_bar, _, coef, *own = parts
    grad_weight, grad_bias = grads or own
    return BackwardStats(coef, grad_weight, grad_bias, psi, psi_bar, None)


def backward_launch(
    parts: Sequence[Tensor],
    grads: tuple[Tensor, Tensor] | None,
    dout_x: Tensor,
    psi_count: int,
    dout_sum: Tensor,
    r: Tensor,
    var: Tensor,
    active: Tensor,
    weight: Tensor,
    groups: int,
    streams: tuple[Tensor, Tensor, Tensor],
    agreement: tuple[Tensor, Tensor],
    cfg: StepConfig,
    loss_scale: Tensor | None,
) -> None:
    """The backward kernel on a layer's psi stream (history, EMA, counter), updated in place, and its (non-finite
    flags, tickets), with its outputs in ``parts``, the split of one allocation by ``backward_sizes``, and the
    parameters' gradients in ``grads`` where they are apart."""
    c = weight.numel()
    n = dout_x.numel() // c
    undo, psi, psi_bar, psi_active, coef, *own = parts
    grad_weight, grad_bias = grads or own
    consts = dict(
        **_extents(groups, n // groups, cfg.buffer_size),
        STATS=STATS_CODE[cfg.stats],
        SCALED=loss_scale is not None,
        BLOCK=_block(c, MAX_BLOCK),
    )
    flags = agreement[0]
    scale = flags if loss_scale is None else loss_scale  # any pointer when unscaled
    _backward(
        (
            *(dout_x, dout_sum, r, var, active, weight, *streams, undo),
            *(psi, psi_bar, psi_active, coef, grad_weight, grad_bias, *agreement, scale),
            *(c, float(psi_count), cfg.momentum, cfg.eps),
        ),
        consts,
    )
