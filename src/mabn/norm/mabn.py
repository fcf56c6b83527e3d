"""Moving Average Batch Normalization (Yan et al., ICLR 2020), exact to the official implementation.

Per channel, with chi2 the second moment E[x^2] of a normalization batch (no mean subtraction):

    forward   z = x / sqrt(var + eps),  out = weight * r * z + bias
    backward  dL/dx = (g - z * psi_bar) / sqrt(var + eps),  g = r * weight * dL/dout

``var`` is the simple moving average (SMA) of the last ``buffer_size`` chi2 values once warmed up,
``psi_bar`` the SMA of psi = mean(g * z), and ``r`` renormalizes the forward to the exponential moving
average (EMA) used at inference, clipped to [1/renorm_clip, renorm_clip]. See docs/library.md, "MABN2d semantics",
and docs/design.md for the official code's two timelines (detection and ImageNet).

The autograd Function saves the input and the weight (as ``nn.BatchNorm2d`` does) plus a few
per-channel vectors; z is recomputed in backward from x. Every reduction runs in float32 or better.

Under DDP each device keeps its own statistic streams by default, as in the paper. With
``sync_stats=True`` every normalization batch spans all devices: chi^2 (forward) and psi (backward) of
group k are combined over the devices' group k before they enter the streams, a few floats per layer.
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import Tensor, nn

from ..distributed import all_reduce_sum_, sync_group
from . import fused
from ._checks import check_input, check_norm_args
from ._mabn_types import EMA_STARTS, STATS, BackwardStats, ForwardStats, NativeBackward, StepConfig
from ._steps import per_sample, per_sample_bn_backward, stat_dtype, values_before_update
from .fused import kernels_for
from .managed import ManagedNorm
from .phase import phase


class MABN2d(ManagedNorm):
    """Moving Average Batch Normalization for NCHW input.

    On CUDA a non-finite statistic is reported without stalling the GPU (see ``ManagedNorm``).

    ``loss_scale`` (set by MABNCallback under a GradScaler, e.g. ``precision="16-mixed"``): a 0-d float tensor
    on the layer's device holding the scale S of the gradients that backward receives. psi is kept in the
    loss's own units (psi / S), so its moving average stays exact when the scaler changes S, and a non-finite
    psi is left out of the streams without an error: the scaler skips that optimizer step.

    Args:
        num_features: channels C.
        buffer_size: m, the number of normalization batches the simple moving averages span.
        momentum: EMA weight of the old value: ema = momentum * ema + (1 - momentum) * var
            (the opposite of ``nn.BatchNorm2d``'s convention, as in the paper).
        eps: added to the second moment inside every square root.
        warmup_iters: the first training forward that may use the SMAs (they also need m recorded statistics).
        renorm_warmup_iters: r is 1 until this many training forwards (and until warmup_iters).
        renorm_clip: r is clipped to [1 / renorm_clip, renorm_clip] afterwards.
        norm_batch_size: split each batch into ghost batches of this many samples, normalized
            one after another as a stream (None: the whole batch is one normalization batch).
        stats: statistic for the normalizer and for psi: "batch", "sma" (MABN) or "ema".
        renorm: renormalize the forward to the EMA through r ("EMAS in FP").
        sync_stats: under ``torch.distributed`` with two or more processes, combine each normalization
            group's chi^2 and psi over the devices (group k of every device forms one normalization batch),
            so every device holds the same streams; every device must then run the same number of groups.
            Off (the paper's setting): each device keeps its own streams. Without a process group it
            changes nothing.
        ema_start: where the EMA of chi^2 starts. "one": at 1 (the official detection code). "first": at the
            first training forward's statistic of the stream (the official ImageNet code): that forward's
            EMA update takes the groups' mean chi^2 as the previous value, and a restarted stream
            (``reset_stream``) starts it again. r always compares with the EMA the layer held before the forward.
    """

    NONFINITE = ("batch statistic chi^2", "gradient statistic psi")
    ema_buffers = ("running_var", "running_psi")

    def __init__(
        self,
        num_features: int,
        buffer_size: int = 16,
        momentum: float = 0.98,
        eps: float = 1e-5,
        warmup_iters: int = 100,
        renorm_warmup_iters: int = 1000,
        renorm_clip: float = 5.0,
        norm_batch_size: int | None = None,
        stats: str = "sma",
        renorm: bool = True,
        sync_stats: bool = False,
        ema_start: str = "one",
    ) -> None:
        super().__init__()
        name = type(self).__name__
        check_norm_args(name, momentum, norm_batch_size)
        if stats not in STATS:
            raise ValueError(f"{name}: stats must be one of {STATS}, got {stats!r}")
        if ema_start not in EMA_STARTS:
            raise ValueError(f"{name}: ema_start must be one of {EMA_STARTS}, got {ema_start!r}")
        if buffer_size < 1:
            raise ValueError(f"{name}: buffer_size must be >= 1, got {buffer_size}")
        if renorm_clip < 1.0:
            raise ValueError(f"{name}: renorm_clip must be >= 1, got {renorm_clip}")
        self.num_features = num_features
        self.buffer_size = buffer_size
        self.momentum = momentum
        self.eps = eps
        self.warmup_iters = warmup_iters
        self.renorm_warmup_iters = renorm_warmup_iters
        self.renorm_clip = renorm_clip
        self.norm_batch_size = norm_batch_size
        self.stats = stats
        self.renorm = renorm
        self.sync_stats = sync_stats
        self.ema_start = ema_start
        self.weight = nn.Parameter(torch.ones(num_features))
        self.bias = nn.Parameter(torch.zeros(num_features))
        # EMA of the normalizing second moment: what inference divides by.
        self.register_buffer("running_var", torch.ones(num_features))
        # EMA of psi, used by the stats="ema" ablation.
        self.register_buffer("running_psi", torch.zeros(num_features))
        # The last m group statistics of chi^2 and psi, oldest first.
        self.register_buffer("buffer_x2", torch.zeros(buffer_size, num_features))
        self.register_buffer("buffer_gz", torch.zeros(buffer_size, num_features))
        self.register_buffer("iters", torch.zeros((), dtype=torch.long))  # training forwards t
        self.register_buffer("count_x2", torch.zeros((), dtype=torch.long))  # chi^2 stats recorded
        self.register_buffer("count_gz", torch.zeros((), dtype=torch.long))  # psi stats recorded
        self.loss_scale: Tensor | None = None

    def step_config(self, device: torch.device) -> StepConfig:
        # The policy as the device tensor the callback updates in place: a captured CUDA graph follows it.
        policy = self.policy_flags(device) if self.has_policy else None
        return StepConfig(
            self.stats,
            self.momentum,
            self.eps,
            self.renorm,
            self.renorm_clip,
            self.buffer_size,
            self.ema_start,
            policy,
            self.warmup_iters,
            self.renorm_warmup_iters,
        )

    def reset_stream(self, reset_ema: bool = False) -> None:
        """Forget the statistic streams (ring buffers, counters) so warm-up starts again, e.g. when
        fine-tuning from a pre-trained backbone; ``reset_ema`` also returns the EMAs to their start."""
        for buf in (self.buffer_x2, self.buffer_gz, self.iters, self.count_x2, self.count_gz):
            buf.zero_()
        if reset_ema:
            self.running_var.fill_(1.0)
            self.running_psi.zero_()

    def inference_affine(self) -> tuple[Tensor, Tensor]:
        """(scale, shift) per channel such that the eval output is x * scale + shift."""
        scale = self.weight / (self.running_var + self.eps).sqrt()
        return scale, self.bias

    @torch.no_grad()
    def _statistics(
        self, x: Tensor, groups: int, synced: bool, kernels: ModuleType | None
    ) -> tuple[Tensor, ForwardStats, NativeBackward | None]:
        """A training forward's statistic step, committed to the buffers: the per-sample scale
        weight * r / sqrt(var + eps) (N, C, 1, 1) in x's dtype, the statistics, and the native backward's inputs;
        with ``kernels`` the scale flat (N * C) in the statistics' dtype, for the row kernels, and no native
        inputs."""
        n, _, h, w = x.shape
        # The one pass over x: per sample and channel, in float32 or better.
        norm = torch.linalg.vector_norm(x, 2, dim=(2, 3), dtype=stat_dtype(x))
        cfg = self.step_config(x.device)
        if kernels is not None:
            return *kernels.forward_stats(norm, h * w, groups, self.weight, self, cfg), None
        chi2 = _group_chi2(norm, groups, h * w)
        if synced:  # the chi^2 of group k over every device, weighted by the devices' element counts
            count = (n // groups) * h * w
            total, counts = _sum_across_devices(chi2 * count, count)
            chi2 = total / counts
        stats = _forward_stats(chi2, self.buffer_x2, self.running_var, self.iters, self.count_x2, cfg)
        scale, native = _scale_and_native_inputs(self.weight, stats, self.eps, n // groups, x.dtype)
        return scale, stats, native

    def forward(self, x: Tensor) -> Tensor:
        groups = check_input(type(self).__name__, x, self.num_features, self.norm_batch_size, self.training)
        if not self.training:
            return self.inference(x)
        c = self.num_features
        synced = self.sync_stats and sync_group()
        kernels = None if synced else _fused_kernels(x)
        scale, stats, native = self._statistics(x, groups, synced, kernels)
        self._check(stats.ok, 0, x.device)
        if self.track_stats:
            per_group = {"chi2_batch": stats.chi2, "chi2_used": stats.var, "r": stats.r}
            self.last_stats = {k: v.view(groups, c) for k, v in per_group.items()}
            self.last_stats.update(chi2_ema=stats.ema, active=stats.active.view(groups) != 0)
        # Tensors only through apply (autograd and torch.compile see each one); the records are rebuilt inside.
        saved = (*(native or (None, None, None)), stats.var, stats.r, stats.active)
        return _MABNFunction.apply(x, self.weight, self.bias, scale, *saved, self, groups, synced, kernels)

    def extra_repr(self) -> str:
        return (
            f"{self.num_features}, buffer_size={self.buffer_size}, momentum={self.momentum}, eps={self.eps}, "
            f"warmup_iters={self.warmup_iters}, renorm_warmup_iters={self.renorm_warmup_iters}, "
            f"renorm_clip={self.renorm_clip}, norm_batch_size={self.norm_batch_size}, stats={self.stats!r}, "
            f"renorm={self.renorm}"
            + (", sync_stats=True" if self.sync_stats else "")
            + (f", ema_start={self.ema_start!r}" if self.ema_start != "one" else "")
        )

    def summary(self) -> dict[str, float]:
        """chi^2 of the batch, its SMA and EMA, psi and psi_bar, r's mean and share at the clip bounds, and the
        phase (0 batch statistics, 1 moving averages, 2 renormalized) of the last tracked step."""
        s, l2 = self.last_stats, self.channel_norm
        moving = bool(s["active"].any())
        r = s["r"].float()
        renorm = bool((r != 1).any())
        clip = self.renorm_clip
        out = {
            "chi2_batch": l2(s["chi2_batch"]),
            "chi2_sma": l2(s["chi2_used"]),
            "chi2_ema": l2(s["chi2_ema"]),
            "r_mean": float(r.mean()),
            "r_clipped": float(((r <= 1 / clip + 1e-6) | (r >= clip - 1e-6)).float().mean()) if renorm else 0.0,
            "phase": 0.0 + moving + renorm,
        }
        if "psi_batch" in s:  # left by the backward: not before it runs, nor under torch.compile (forward only)
            out.update(psi_batch=l2(s["psi_batch"]), psi_bar=l2(s["psi_used"]))
        return out


class _MABNFunction(torch.autograd.Function):
    """out = bias + x * scale with MABN's backward; the statistic step (``MABN2d._statistics``, no gradient flows
    through it) runs before and hands over what the backward needs. With ``kernels`` (CUDA) the passes over x are
    Triton's row kernels, else torch ops and the native BN backward."""

    @staticmethod
    def forward(
        ctx,
        x: Tensor,
        weight: Tensor,
        bias: Tensor,
        scale: Tensor,
        native_weight: Tensor | None,
        native_var: Tensor | None,
        native_mean: Tensor | None,
        var: Tensor,
        r: Tensor,
        active: Tensor,
        layer: MABN2d,
        groups: int,
        synced: bool,
        kernels: ModuleType | None,
    ) -> Tensor:
        ctx.save_for_backward(x, weight, scale, native_weight, native_var, native_mean, var, r, active)
        ctx.layer, ctx.synced, ctx.kernels, ctx.groups = layer, synced, kernels, groups
        if kernels is not None:
            return kernels.scale_shift(x, scale, bias)
        c = x.shape[1]
        return torch.addcmul((bias if bias.dtype == x.dtype else bias.to(x.dtype)).view(1, c, 1, 1), x, scale)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        x, weight, scale, native_weight, native_var, native_mean, var, r, active = ctx.saved_tensors
        layer, kernels = ctx.layer, ctx.kernels
        n, c, h, w = x.shape
        groups = ctx.groups
        psi_count = n // groups * h * w  # elements behind each group's sum of dL/dout * z
        cfg = layer.step_config(x.device)
        need_x = ctx.needs_input_grad[0]
        if kernels is not None:  # per sample and channel the sums of dL/dout * x and dL/dout, in one pass
            dout_x, dout_sum = kernels.row_sums(grad_out, x, var.dtype)
            stats = kernels.backward_stats(
                dout_x, psi_count, dout_sum, r, var, active, weight, groups, layer, cfg, layer.loss_scale
            )
            grad_x = kernels.grad_input(grad_out, x, scale, stats.coef) if need_x else None
        else:
            stats, g_scaled = _torch_op_backward(
                ctx, grad_out, x, weight, NativeBackward(native_weight, native_var, native_mean), var, r, active,
                psi_count, cfg, need_x,
            )  # fmt: skip
            grad_x = g_scaled.view(n, c, h, w).addcmul_(x, stats.coef) if need_x else None
        if layer.loss_scale is None:  # under a loss scaler a non-finite gradient skips the step instead
            layer._check(stats.ok, 1, x.device)
        # Under torch.compile the backward cannot hand tensors to the host side: only the forward's are logged.
        if layer.track_stats and layer.last_stats is not None and not torch.compiler.is_compiling():
            layer.last_stats.update(psi_batch=stats.psi.view(groups, c), psi_used=stats.psi_bar.view(groups, c))
        return grad_x, stats.grad_weight, stats.grad_bias, *[None] * 11


def _torch_op_backward(
    ctx,
    grad_out: Tensor,
    x: Tensor,
    weight: Tensor,
    native: NativeBackward,
    var: Tensor,
    r: Tensor,
    active: Tensor,
    psi_count: int,
    cfg: StepConfig,
    need_x: bool,
) -> tuple[BackwardStats, Tensor | None]:
    """The backward's statistics on the torch-op path, and dL/dout * weight * r / sqrt(var + eps) (when ``need_x``)."""
    layer, groups = ctx.layer, ctx.groups
    c = x.shape[1]
    # With mean 0, var and weight * r of each sample's group: g / sqrt(var + eps), and sum(dL/dout * z)
    # and sum(dL/dout) per sample and channel, in one fused pass.
    g_scaled, dout_z, dout_sum = per_sample_bn_backward(
        grad_out, x, native.weight, native.mean, native.var, layer.eps, need_x
    )
    dout_z = dout_z.view(groups, -1, c).sum(1)  # per group
    local_dout_z = None
    if ctx.synced:  # psi of the cross-device normalization batch: over every device's group k
        local_dout_z = dout_z
        dout_z, psi_count = _sum_across_devices(dout_z, psi_count)
    streams = (layer.buffer_gz, layer.running_psi, layer.count_gz)
    stats = _backward_stats(
        dout_z, psi_count, dout_sum, r, var, active, weight, *streams, cfg, x.dtype, local_dout_z, layer.loss_scale
    )
    return stats, g_scaled


def _fused_kernels(x: Tensor) -> ModuleType | None:
    """The one-launch Triton statistic steps for ``x`` (``mabn_kernels``), or inside a region ``torch.compile``
    traces the same launches as custom operators (``_compiled_kernels``); None for the torch-op steps below: on the
    CPU, without Triton, with MABN_FUSED=0."""
    if torch.compiler.is_compiling():
        return _compiled_kernels(x)
    return kernels_for(x, "mabn_kernels")


def _compiled_kernels(x: Tensor) -> ModuleType | None:
    """``mabn_ops`` for a CUDA ``x``: its statistic steps are operators the compiler calls, its passes over x torch
    ops it fuses with their neighbours. Imported by a plain import statement, which Dynamo traces (``fused.load``'s
    importlib call it cannot); the compiler's CUDA code needs Triton anyway."""
    if not (x.is_cuda and fused.enabled()):
        return None
    from . import mabn_ops

    return mabn_ops


# -- the statistic steps: the semantics, and the path for the CPU, sync_stats and torch.compile ---------------


def _stream_stat(
    history: Tensor, new: Tensor, active: Tensor, stats: str, momentum: float, ema_prev: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Append G new group statistics to a stream and return what each group uses.

    history: (m, C) the last m statistics, oldest first; new: (G, C); active: (G,) bool.
    Returns (used (G, C), history after the append (m, C), stream EMA after the last group (C,)).
    An inactive group uses its own statistic; an active one the SMA of the last m statistics up to
    and including itself ("sma") or the stream EMA up to and including itself ("ema").
    """
    m = history.shape[0]
    seq = torch.cat([history, new])
    emas = []
    e = ema_prev
    if stats == "ema":
        for k in range(new.shape[0]):
            e = momentum * e + (1.0 - momentum) * new[k]
            emas.append(e)
    if stats == "sma":
        smoothed = seq.unfold(0, m, 1)[1:].mean(-1)  # window k ends at group k
    elif stats == "ema":
        smoothed = torch.stack(emas)
    else:
        smoothed = new
    used = torch.where(active.unsqueeze(1), smoothed, new)
    return used, seq[-m:], e


def _phase(t: Tensor, cfg: StepConfig) -> tuple[Tensor, Tensor]:
    """Whether training forward number t may use moving statistics and renormalize (before the buffer
    check): the callback's policy (``MABN2d.policy_flags``) when one is set, else the layer's own timeline."""
    if cfg.policy is not None:
        return cfg.policy[0] != 0, cfg.policy[1] != 0
    return phase(t, *cfg.first_steps())


def _group_chi2(norm: Tensor, groups: int, hw: int) -> Tensor:
    """chi^2 (G, C) of each normalization group from the per-sample l2 norms (N, C) over H*W."""
    n, c = norm.shape
    chi2 = norm.square() / hw  # per sample; equal counts, so the group's chi^2 is their plain mean
    return chi2.view(groups, n // groups, c).mean(1)


def _sum_across_devices(sums: Tensor, count: int) -> tuple[Tensor, Tensor]:
    """Per-group sums (G, C), over ``count`` elements each on this device -> (the sums over group k of every
    device, their element counts (G, 1)), in one all-reduce of G * (C + 1) floats."""
    packed = all_reduce_sum_(torch.cat([sums, sums.new_full((sums.shape[0], 1), float(count))], dim=1))
    return packed[:, :-1], packed[:, -1:]


def _forward_stats(
    chi2: Tensor, buffer_x2: Tensor, running_var: Tensor, iters: Tensor, count_x2: Tensor, cfg: StepConfig
) -> ForwardStats:
    """The per-channel statistics of a training forward from the groups' chi^2 (G, C).

    Commits the new statistics to the buffers (in place) only when every group's chi^2 is finite, and
    returns that verdict as a tensor, so that the caller decides when to read it (see MABN2d).
    """
    old_x2, old_var, old_iters, old_count = values_before_update(buffer_x2, running_var, iters, count_x2)
    moving_ok, renorm_ok = _phase(old_iters + 1, cfg)
    groups = chi2.shape[0]
    ok = torch.isfinite(chi2).all()
    ks = torch.arange(groups, device=chi2.device)
    active = moving_ok & (old_count + ks >= cfg.buffer_size)
    if cfg.stats == "batch":
        active = torch.zeros_like(active)
    ema_prev = old_var.to(chi2.dtype)  # what r compares with: the EMA the layer holds
    ema_base = ema_prev  # the EMA before this forward's update
    if cfg.ema_start == "first":
        ema_base = torch.where(old_iters == 0, chi2.mean(0), ema_prev)
    var, history, stream_ema = _stream_stat(old_x2.to(chi2.dtype), chi2, active, cfg.stats, cfg.momentum, ema_base)
    r = torch.ones_like(var)
    if cfg.renorm:
        clipped = ((var + cfg.eps).sqrt() / (ema_prev + cfg.eps).sqrt()).clamp(1.0 / cfg.renorm_clip, cfg.renorm_clip)
        r = torch.where(renorm_ok, clipped, r)
    if cfg.stats == "ema":
        ema = stream_ema
    else:
        ema = cfg.momentum * ema_base + (1.0 - cfg.momentum) * var.mean(0)

    iters.add_(ok.to(iters.dtype))
    count_x2.add_(ok.to(count_x2.dtype) * groups)
    buffer_x2.copy_(torch.where(ok, history.to(buffer_x2.dtype), buffer_x2))
    running_var.copy_(torch.where(ok, ema.to(running_var.dtype), running_var))
    return ForwardStats(chi2, var, r, active, ema, ok)


def _scale_and_native_inputs(
    weight: Tensor, stats: ForwardStats, eps: float, b: int, x_dtype: torch.dtype
) -> tuple[Tensor, NativeBackward]:
    """From the statistics to what the forward and the native BN backward use, per sample (b per group):
    the scale weight * r / sqrt(var + eps) (N, C, 1, 1) in x's dtype, and the native backward's inputs."""
    weight_r = weight.to(stats.var.dtype) * stats.r
    scale = per_sample((weight_r / (stats.var + eps).sqrt()).to(x_dtype), b)
    nc = scale.numel()
    native_var = per_sample(stats.var, b).reshape(nc)
    return scale, NativeBackward(per_sample(weight_r, b).reshape(nc), native_var, torch.zeros_like(native_var))


def _backward_stats(
    dout_z: Tensor,
    psi_count: int | Tensor,
    dout_sum: Tensor,
    r: Tensor,
    var: Tensor,
    active: Tensor,
    weight: Tensor,
    buffer_gz: Tensor,
    running_psi: Tensor,
    count_gz: Tensor,
    cfg: StepConfig,
    x_dtype: torch.dtype,
    local_dout_z: Tensor | None = None,
    loss_scale: Tensor | None = None,
) -> BackwardStats:
    """The per-channel part of the backward, from the sums of dL/dout * z per group (G, C), over
    ``psi_count`` elements each, and the native kernel's per-(sample, channel) sums of dL/dout.

    With ``loss_scale`` S (a 0-d tensor) the incoming gradients are S times the loss's: psi enters the
    streams as psi / S, and psi_bar * S meets the scaled gradient. Commits psi to its buffers only when it
    is finite, like ``_forward_stats``.
    """
    groups, c = var.shape
    b = dout_sum.numel() // (groups * c)
    weight_r = weight.to(var.dtype) * r
    psi = weight_r * dout_z / psi_count
    if loss_scale is not None:
        psi = psi / loss_scale.to(var.dtype)
    ok = torch.isfinite(psi).all()
    ks = torch.arange(groups, device=var.device)
    psi_active = active & (count_gz + ks >= cfg.buffer_size)
    psi_bar, history, psi_ema = _stream_stat(
        buffer_gz.to(var.dtype), psi, psi_active, cfg.stats, cfg.momentum, running_psi.to(var.dtype)
    )
    psi_bar_g = psi_bar if loss_scale is None else psi_bar * loss_scale.to(var.dtype)  # in the gradient's scale
    coef = per_sample((-psi_bar_g / (var + cfg.eps)).to(x_dtype), b)  # dL/dx = g / sqrt(var + eps) + x * coef
    # The weight's gradient is this device's share; DDP averages it like any other parameter's.
    local = dout_z if local_dout_z is None else local_dout_z
    grad_weight = (r * local).sum(0).to(weight.dtype)
    grad_bias = dout_sum.view(-1, c).sum(0).to(weight.dtype)

    count_gz.add_(ok.to(count_gz.dtype) * groups)
    buffer_gz.copy_(torch.where(ok, history.to(buffer_gz.dtype), buffer_gz))
    running_psi.copy_(torch.where(ok, psi_ema.to(running_psi.dtype), running_psi))
    return BackwardStats(coef, grad_weight, grad_bias, psi, psi_bar, ok)
