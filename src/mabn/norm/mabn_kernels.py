"""MABN2d's per-channel statistic steps as one Triton kernel per direction (CUDA).

``_forward_stats`` and ``_backward_stats`` in ``mabn.py`` define the semantics and stay the path for the CPU
and for ``sync_stats``. Written with torch ops they launch ~40 tiny kernels per layer and direction, which
leaves a GPU training step bound by the host launching them (about 4x BN's step time on an H200 at batch 2).
Here each direction is one launch over a grid of programs, each of a block of channels (channels are independent).
Each program computes its channels' statistics and outputs and commits them to the layer's buffers in place,
keeping the values it overwrites in a scratch area. A non-finite statistic must leave every buffer untouched, a
verdict over all channels: each program takes a ticket (one atomic add on the layer's ``tickets``, which also
counts whether it met a non-finite statistic), and the program that takes the last one writes the kept values
back to every channel and sets the layer's sticky flag if any program met one, else advances the step counters;
then it zeroes the tickets for the next launch (and every CUDA-graph replay). No program waits for another, so
the programs may run in any order: side by side on a GPU, one after another in Triton's interpreter. A
non-finite statistic is rare (an error, or an overflow that a loss scaler skips): the usual launch writes each
buffer once.

Scalars that enter float64 arithmetic are passed as fp64 and cast to the statistics' dtype inside, so a
float32 step rounds as torch does with Python scalars and a float64 step keeps float64 exactly; square
roots and divisions use the correctly rounded forms (``sqrt_rn``, ``div_rn``), as torch does.
"""

# No "from __future__ import annotations": Triton reads the tl.float64 annotations as objects.
import functools
import types

import triton
import triton.language as tl
from torch import Tensor, nn

from ._mabn_types import BackwardStats, ForwardStats, StepConfig
from .fused import Launcher, aligned, key_of
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
def _seq(hist_ptr, new_ptr, idx, cols, cmask, C, M: tl.constexpr, dt: tl.constexpr):
    """Row idx of (history (M rows, oldest first) ++ new rows)."""
    old = tl.load(hist_ptr + idx * C + cols, mask=cmask & (idx < M), other=0.0).to(dt)
    new = tl.load(new_ptr + (idx - M) * C + cols, mask=cmask & (idx >= M), other=0.0).to(dt)
    return tl.where(idx < M, old, new)


@triton.jit
def _stream(
    hist_ptr,
    undo_ptr,
    new_ptr,
    used_ptr,
    active_ptr,
    gate_ptr,
    moving,
    count,
    ema_prev,
    momentum,
    cols,
    cmask,
    C,
    G,
    M: tl.constexpr,
    STATS: tl.constexpr,
    GATED: tl.constexpr,
):
    """``_stream_stat`` of mabn.py for one block of channels: writes what each of the G groups uses, shifts the
    history by G in place (its rows before, to ``undo``) and returns the stream EMA after the last group.

    Group k uses the moving statistic when ``moving`` and the stream holds M statistics before it (``count`` + k
    >= M), and, if GATED, ``gate[k]`` is set: scalars that every program evaluates alike, so none reads another's
    output. Program 0 writes these flags to ``active``."""
    dt = ema_prev.dtype
    e = ema_prev
    for k in range(G):
        new = tl.load(new_ptr + k * C + cols, mask=cmask, other=0.0)
        if STATS == 1:  # SMA of the M statistics up to and including group k
            acc = tl.zeros_like(new)
            for j in tl.static_range(M):
                acc += _seq(hist_ptr, new_ptr, k + 1 + j, cols, cmask, C, M, dt)
            smoothed = _div(acc, tl.full(acc.shape, M, dt))
        elif STATS == 2:
            e = momentum * e + (1.0 - momentum) * new
            smoothed = e
        else:
            smoothed = new
        active = moving & (count + k >= M)
        if GATED:
            active = active & (tl.load(gate_ptr + k) != 0)
        tl.store(active_ptr + k, active.to(active_ptr.dtype.element_ty), mask=tl.program_id(0) == 0)
        tl.store(used_ptr + k * C + cols, tl.where(active, smoothed, new), mask=cmask)
    # Rows G .. G+M-1 of the sequence; row i is written after row G + i >= i was read.
    for i in tl.static_range(M):
        old = tl.load(hist_ptr + i * C + cols, mask=cmask)
        row = _seq(hist_ptr, new_ptr, G + i, cols, cmask, C, M, dt)
        tl.store(undo_ptr + i * C + cols, old, mask=cmask)
        tl.store(hist_ptr + i * C + cols, row, mask=cmask)
    return e


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
    G,
    B,
    hw: tl.float64,
    momentum_: tl.float64,
    eps_: tl.float64,
    clip_: tl.float64,
    moving_first,
    renorm_first,
    M: tl.constexpr,
    STATS: tl.constexpr,
    RENORM: tl.constexpr,
    POLICY: tl.constexpr,
    EMA_FIRST: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """norm (N, C): per-sample l2 norms over H*W, N = G * B -> ``_forward_stats``'s outputs and the per-sample
    scale weight * r / sqrt(var + eps) (N, C, in the statistics' dtype) for this program's BLOCK channels,
    committed unless some program met a non-finite chi^2: then the last program restores every buffer and sets
    flags[0] (sticky) instead of a verdict. ``undo``: (M + 1) * C of the buffers' dtype, scratch."""
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    cmask = cols < C
    dt = norm_ptr.dtype.element_ty
    momentum, eps, clip = tl.full((), momentum_, dt), tl.full((), eps_, dt), tl.full((), clip_, dt)
    # The buffers' old values in their own dtype (the history's and the running average's, the layer's), so that a
    # restore is exact also where the buffers hold more bits than the statistics.
    undo = undo_ptr.to(hist_ptr.dtype)
    nbad = 0
    for k in range(G):  # chi^2 of every group: equal counts, so the mean of per-sample chi^2
        acc = tl.zeros((BLOCK,), dt)
        for j in range(B):
            v = tl.load(norm_ptr + (k * B + j) * C + cols, mask=cmask, other=0.0)
            acc += _div(v * v, tl.full((BLOCK,), hw, dt))
        chi = _div(acc, tl.full((BLOCK,), B, dt))
        nbad += tl.sum((cmask & ~_finite(chi)).to(tl.int32), axis=0)
        tl.store(chi2_ptr + k * C + cols, chi, mask=cmask)
    t = tl.load(iters_ptr) + 1
    count = tl.load(count_ptr)
    if POLICY:  # read here, not passed by value, so that a captured CUDA graph follows the callback
        moving = tl.load(policy_ptr) != 0
        renorm_on = tl.load(policy_ptr + 1) != 0
    else:
        moving, renorm_on = _phase(t, moving_first, renorm_first)
    tl.debug_barrier()  # chi^2 is read back below
    lo = _div(tl.full((BLOCK,), 1.0, dt), tl.full((BLOCK,), clip, dt))
    running_old = tl.load(running_ptr + cols, mask=cmask, other=1.0)
    ema_prev = running_old.to(dt)  # what r compares with
    ema_base = ema_prev  # the EMA before this forward's update
    if EMA_FIRST:  # a stream's first forward starts the EMA at its groups' mean chi^2
        chi_sum = tl.zeros((BLOCK,), dt)
        for k in range(G):
            chi_sum += tl.load(chi2_ptr + k * C + cols, mask=cmask, other=0.0)
        ema_base = tl.where(t == 1, _div(chi_sum, tl.full((BLOCK,), G, dt)), ema_prev)
    e = _stream(
        hist_ptr,
        undo,
        chi2_ptr,
        var_ptr,
        active_ptr,
        active_ptr,  # unread: GATED off
        moving & (STATS != 0),
        count,
        ema_base,
        momentum,
        cols,
        cmask,
        C,
        G,
        M,
        STATS,
        False,
    )
    w = tl.load(weight_ptr + cols, mask=cmask, other=0.0).to(dt)
    ema_std = _sqrt(ema_prev + eps)
    var_sum = tl.zeros((BLOCK,), dt)
    for k in range(G):
        var = tl.load(var_ptr + k * C + cols, mask=cmask, other=1.0)
        std = _sqrt(var + eps)
        r = tl.full((BLOCK,), 1.0, dt)
        if RENORM:
            clipped = tl.minimum(tl.maximum(_div(std, ema_std), lo), clip)
            r = tl.where(renorm_on, clipped, r)
        tl.store(r_ptr + k * C + cols, r, mask=cmask)
        scale = _div(w * r, std)
        for j in range(B):
            tl.store(scale_ptr + (k * B + j) * C + cols, scale, mask=cmask)
        var_sum += var
    if STATS == 2:
        ema = e
    else:
        ema = momentum * ema_base + (1.0 - momentum) * _div(var_sum, tl.full((BLOCK,), G, dt))
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
    dz_ptr,
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
    G,
    B,
    psi_count: tl.float64,
    momentum_: tl.float64,
    eps_: tl.float64,
    M: tl.constexpr,
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
    dt = var_ptr.dtype.element_ty
    momentum, eps = tl.full((), momentum_, dt), tl.full((), eps_, dt)
    undo = undo_ptr.to(hist_ptr.dtype)  # as in forward_kernel
    tickets = tickets_ptr + 1  # the backward's
    loss_scale = tl.full((), 1.0, dt)
    if SCALED:
        loss_scale = tl.load(scale_ptr).to(dt)
    nbad = 0
    w = tl.load(weight_ptr + cols, mask=cmask, other=0.0).to(dt)
    grad_weight = tl.zeros((BLOCK,), dt)
    grad_bias = tl.zeros((BLOCK,), dt)
    for k in range(G):
        dz = tl.zeros((BLOCK,), dt)
        for j in range(B):
            n = k * B + j
            dz += tl.load(dz_ptr + n * C + cols, mask=cmask, other=0.0).to(dt)
            grad_bias += tl.load(dsum_ptr + n * C + cols, mask=cmask, other=0.0).to(dt)
        dz = _div(dz, _sqrt(tl.load(var_ptr + k * C + cols, mask=cmask, other=1.0) + eps))
        r = tl.load(r_ptr + k * C + cols, mask=cmask, other=1.0)
        psi = _div(w * r * dz, tl.full((BLOCK,), psi_count, dt))
        if SCALED:
            psi = _div(psi, tl.full((BLOCK,), loss_scale, dt))
        nbad += tl.sum((cmask & ~_finite(psi)).to(tl.int32), axis=0)
        tl.store(psi_ptr + k * C + cols, psi, mask=cmask)
        grad_weight += r * dz
    tl.store(grad_weight_ptr + cols, grad_weight, mask=cmask)
    tl.store(grad_bias_ptr + cols, grad_bias, mask=cmask)
    count = tl.load(count_ptr)
    tl.debug_barrier()  # psi is read back below
    running_old = tl.load(running_ptr + cols, mask=cmask, other=0.0)
    ema_prev = running_old.to(dt)
    # psi_active[k] = active[k] (the forward's output) and the psi stream holds M statistics before group k.
    e = _stream(
        hist_ptr,
        undo,
        psi_ptr,
        psi_bar_ptr,
        psi_active_ptr,
        active_ptr,
        True,
        count,
        ema_prev,
        momentum,
        cols,
        cmask,
        C,
        G,
        M,
        STATS,
        True,
    )
    for k in range(G):
        psi_bar = tl.load(psi_bar_ptr + k * C + cols, mask=cmask, other=0.0)
        var = tl.load(var_ptr + k * C + cols, mask=cmask, other=1.0)
        if SCALED:
            psi_bar = psi_bar * loss_scale
        coef = _div(-psi_bar, var + eps)
        for j in range(B):
            tl.store(coef_ptr + (k * B + j) * C + cols, coef, mask=cmask)
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


# Channels per program, one warp's lanes. A channel's statistics are a chain of dependent loads and arithmetic (G * M
# loads for the SMA), so a launch takes about one chain's time while its programs run side by side: at 32 channels a
# program the widest layers (4096 channels, 128 programs) still have an SM each on an H100 (132). On an H200 at G = 16,
# M = 16 a forward took 21 µs at any width up to 4096 channels (one program: 263 µs at 4096); 16, 64 (2 warps) or 128
# (4 warps) channels a program took 22 to 24 µs.
MAX_BLOCK = 32


@functools.cache  # triton.next_power_of_2 is a constexpr function, microseconds per host call
def _block(channels: int, max_block: int) -> int:
    return min(triton.next_power_of_2(channels), max_block)


@functools.cache
def _undo_size(m: int, channels: int, buffer_bytes: int, stat_bytes: int) -> int:
    """Elements of the statistics' dtype that hold (m + 1) * C of the buffers' dtype, rounded up to 16 bytes so
    that the outputs after them in the same allocation keep their alignment."""
    return -(-(m + 1) * channels * buffer_bytes // 16) * 16 // stat_bytes


def _grid(meta: dict) -> tuple[int]:
    return (triton.cdiv(meta["C"], meta["BLOCK"]),)


# One warp per program (MAX_BLOCK).
_forward = Launcher(forward_kernel, _grid, num_warps=1)
_backward = Launcher(backward_kernel, _grid, num_warps=1)


def forward_stats(
    norm: Tensor, hw: int, groups: int, weight: Tensor, layer: nn.Module, cfg: StepConfig
) -> tuple[Tensor, ForwardStats]:
    """``_forward_stats(_group_chi2(norm, groups, hw), ...)`` of mabn.py and the per-sample scale
    weight * r / sqrt(var + eps) (N * C, in the statistics' dtype, for ``row_kernels``) in one launch; the
    statistics flat (the (G, C) ones as G * C, ``active`` as 0/1 floats), the verdict in ``layer``'s flags
    (``ok`` None)."""
    n, c = norm.shape
    gc, nc = groups * c, n * c
    history = layer.buffer_x2  # a module attribute lookup costs host time too: once
    u = _undo_size(cfg.buffer_size, c, history.dtype.itemsize, norm.dtype.itemsize)
    # One allocation for the statistic-dtype outputs and the kernel's scratch (host time, not memory, is what
    # counts here); the scratch first, where its alignment is the allocation's.
    outs = norm.new_empty(u + 3 * gc + c + nc + groups).split((u, gc, gc, gc, c, nc, groups))
    undo, chi2, var, r, ema, scale, active = outs
    ints = (c, groups, n // groups)
    first_steps = cfg.first_steps()
    consts = dict(
        M=cfg.buffer_size,
        STATS=STATS_CODE[cfg.stats],
        RENORM=cfg.renorm,
        POLICY=cfg.policy is not None,
        EMA_FIRST=cfg.ema_start == "first",
        BLOCK=_block(c, MAX_BLOCK),
    )
    device = norm.device
    key = key_of(norm, weight.dtype, history.dtype, aligned(weight), *ints, *first_steps, *consts.values())
    _forward(
        key,
        (
            *(norm, weight, history, layer.running_var, layer.iters, layer.count_x2, undo),
            *(chi2, var, r, active, ema, scale),
            *(layer.nonfinite_flags(device), layer.tickets(device), layer.policy_flags(device)),
            *(*ints, float(hw), cfg.momentum, cfg.eps, cfg.renorm_clip, *first_steps),
        ),
        consts,
    )
    return scale, ForwardStats(chi2, var, r, active, ema, None)


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
    c = weight.numel()
    n = dout_x.numel() // c
    gc = groups * c
    # One allocation for psi, psi_bar, the psi flags, dL/dx's coefficients and, where the parameters have the
    # statistics' dtype (float32 both, the usual case), the parameters' gradients: each allocation is an operator
    # call on the host. It is new at every backward, so a second backward of the graph (retain_graph) never writes
    # into gradients already handed out. The kernel's scratch comes first, as in forward_stats.
    with_grads = weight.dtype == var.dtype
    history = layer.buffer_gz
    u = _undo_size(cfg.buffer_size, c, history.dtype.itemsize, var.dtype.itemsize)
    sizes = (u, gc, gc, groups, n * c, c, c) if with_grads else (u, gc, gc, groups, n * c)
    undo, psi, psi_bar, psi_active, coef, *grads = var.new_empty(sum(sizes)).split(sizes)
    grad_weight, grad_bias = grads if with_grads else (weight.new_empty(c), weight.new_empty(c))
    ints = (c, groups, n // groups)
    consts = dict(
        M=cfg.buffer_size, STATS=STATS_CODE[cfg.stats], SCALED=loss_scale is not None, BLOCK=_block(c, MAX_BLOCK)
    )
    flags = layer.nonfinite_flags(var.device)
    scale = flags if loss_scale is None else loss_scale  # any pointer when unscaled
    key = key_of(
        var,
        weight.dtype,
        history.dtype,
        scale.dtype,
        aligned(weight),
        aligned(scale),
        *ints,
        *consts.values(),
    )
    _backward(
        key,
        (
            *(dout_x, dout_sum, r, var, active, weight, history, layer.running_psi, layer.count_gz, undo),
            *(psi, psi_bar, psi_active, coef, grad_weight, grad_bias, flags, layer.tickets(var.device), scale),
            *(*ints, float(psi_count), cfg.momentum, cfg.eps),
        ),
        consts,
    )
    return BackwardStats(coef, grad_weight, grad_bias, psi, psi_bar, None)
