"""Moving Average Batch Normalization (Yan et al., ICLR 2020), exact to the official implementation.

Per channel, with chi2 the second moment E[x^2] of a normalization batch (no mean subtraction):

    forward   z = x / sqrt(var + eps),  out = weight * r * z + bias
    backward  dL/dx = (g - z * psi_bar) / sqrt(var + eps),  g = r * weight * dL/dout

``var`` is the simple moving average (SMA) of the last ``buffer_size`` chi2 values once warmed up,
``psi_bar`` the SMA of psi = mean(g * z), and ``r`` renormalizes the forward to the exponential moving
average (EMA) used at inference, clipped to [1/renorm_clip, renorm_clip]. See DESIGN section 4.

The autograd Function saves the input and the weight (as ``nn.BatchNorm2d`` does) plus a few
per-channel vectors; z is recomputed in backward from x. Every reduction runs in float32 or better.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ._common import check_finite, check_input, per_sample, stat_dtype

STATS = ("batch", "sma", "ema")


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


class _MABNFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor, layer: MABN2d, groups: int) -> Tensor:
        n, c, h, w = x.shape
        b, sdt = n // groups, stat_dtype(x)
        # chi2 per sample and channel, then per normalization group (equal counts, so a plain mean).
        chi2 = torch.linalg.vector_norm(x, 2, dim=(2, 3), dtype=sdt).square_().div_(h * w)
        chi2 = chi2.view(groups, b, c).mean(1)
        check_finite(layer.__class__.__name__, "batch statistic chi^2", chi2)

        t = layer.iters + 1
        moving_ok, renorm_ok = (torch.as_tensor(v, device=x.device) for v in layer.phase(t))
        ks = torch.arange(groups, device=x.device)
        active = (layer.count_x2 + ks >= layer.buffer_size) & moving_ok
        if layer.stats == "batch":
            active = torch.zeros_like(active)
        ema_prev = layer.running_var.to(sdt)
        var, history, stream_ema = _stream_stat(
            layer.buffer_x2.to(sdt), chi2, active, layer.stats, layer.momentum, ema_prev
        )
        std = (var + layer.eps).sqrt()
        if layer.renorm:
            clipped = (std / (ema_prev + layer.eps).sqrt()).clamp(1.0 / layer.renorm_clip, layer.renorm_clip)
            r = torch.where(renorm_ok, clipped, torch.ones_like(clipped))
        else:
            r = torch.ones_like(std)
        if layer.stats == "ema":
            ema = stream_ema
        else:
            ema = layer.momentum * ema_prev + (1.0 - layer.momentum) * var.mean(0)

        scale = weight.to(sdt) * r / std
        out = torch.addcmul(bias.to(x.dtype).view(1, c, 1, 1), x, per_sample(scale.to(x.dtype), b))

        # Commit only now: every check above has passed.
        layer.iters.add_(1)
        layer.count_x2.add_(groups)
        layer.buffer_x2.copy_(history)
        layer.running_var.copy_(ema)

        ctx.save_for_backward(x, weight)
        ctx.layer, ctx.var, ctx.r, ctx.active = layer, var, r, active
        if layer.track_stats:
            layer.last_stats = {"chi2_batch": chi2, "chi2_used": var, "chi2_ema": ema_prev, "r": r, "active": active}
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        x, weight = ctx.saved_tensors
        layer, var, r, active = ctx.layer, ctx.var, ctx.r, ctx.active
        groups, c = var.shape
        n, _, h, w = x.shape
        b, eps = n // groups, layer.eps
        weight_r = weight.to(var.dtype) * r

        # The native BN backward in inference mode, run on x viewed as N*C channels of one sample with
        # running_var = var and weight = weight * r of each sample's group, gives in one fused pass
        # g / sqrt(var + eps), sum(dL/dout * z) and sum(dL/dout) per sample and channel.
        def flat(t: Tensor) -> Tensor:
            return t.contiguous().view(1, n * c, h, w)

        def per_channel(t: Tensor) -> Tensor:
            return per_sample(t, b).reshape(n * c)

        need_x = ctx.needs_input_grad[0]
        empty = var.new_empty(0)
        g_scaled, dout_z, dout_sum = torch.ops.aten.native_batch_norm_backward(
            flat(grad_out),
            flat(x),
            per_channel(weight_r),
            torch.zeros(n * c, dtype=var.dtype, device=var.device),
            per_channel(var),
            empty,  # no saved batch statistics: inference mode reads the running ones (CUDA needs them defined)
            empty,
            False,
            eps,
            [need_x, True, True],
        )
        dout_z = dout_z.view(groups, b, c).sum(1)
        dout_sum = dout_sum.view(n, c).sum(0)
        psi = weight_r * dout_z / (b * h * w)
        check_finite(layer.__class__.__name__, "gradient statistic psi", psi)

        ks = torch.arange(groups, device=x.device)
        psi_active = active & (layer.count_gz + ks >= layer.buffer_size)
        psi_bar, history, psi_ema = _stream_stat(
            layer.buffer_gz.to(var.dtype),
            psi,
            psi_active,
            layer.stats,
            layer.momentum,
            layer.running_psi.to(var.dtype),
        )
        layer.count_gz.add_(groups)
        layer.buffer_gz.copy_(history)
        layer.running_psi.copy_(psi_ema)
        if layer.track_stats and layer.last_stats is not None:
            layer.last_stats.update(psi_batch=psi.detach(), psi_used=psi_bar.detach())

        grad_x = None
        if need_x:  # dL/dx = g / sqrt(var + eps) - x * psi_bar / (var + eps)
            coef = (-psi_bar / (var + eps)).to(x.dtype)
            grad_x = g_scaled.view(n, c, h, w).addcmul_(x, per_sample(coef, b))
        grad_weight = (r * dout_z).sum(0).to(weight.dtype)
        return grad_x, grad_weight, dout_sum.to(weight.dtype), None, None


class MABN2d(nn.Module):
    """Moving Average Batch Normalization for NCHW input.

    Args:
        num_features: channels C.
        buffer_size: m, the number of normalization batches the simple moving averages span.
        momentum: EMA weight of the old value: ema = momentum * ema + (1 - momentum) * var
            (the opposite of ``nn.BatchNorm2d``'s convention, as in the paper).
        eps: added to the second moment inside every square root.
        warmup_iters: training forwards that use batch statistics before the SMAs take over.
        renorm_warmup_iters: r is 1 until this many training forwards (and until warmup_iters).
        renorm_clip: r is clipped to [1 / renorm_clip, renorm_clip] afterwards.
        norm_batch_size: split each batch into ghost batches of this many samples, normalized
            one after another as a stream (None: the whole batch is one normalization batch).
        stats: statistic for the normalizer and for psi: "batch", "sma" (MABN) or "ema".
        renorm: renormalize the forward to the EMA through r ("EMAS in FP").
    """

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
    ) -> None:
        super().__init__()
        if stats not in STATS:
            raise ValueError(f"MABN2d: stats must be one of {STATS}, got {stats!r}")
        if buffer_size < 1:
            raise ValueError(f"MABN2d: buffer_size must be >= 1, got {buffer_size}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"MABN2d: momentum must be in [0, 1), got {momentum}")
        if renorm_clip < 1.0:
            raise ValueError(f"MABN2d: renorm_clip must be >= 1, got {renorm_clip}")
        if norm_batch_size is not None and norm_batch_size < 1:
            raise ValueError(f"MABN2d: norm_batch_size must be >= 1 or None, got {norm_batch_size}")
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

        # Set by MABNCallback: (use moving statistics, renormalize) instead of the layer's own timeline.
        self.policy: tuple[bool, bool] | None = None
        # When set, each training step leaves its per-channel statistics in last_stats (for logging).
        self.track_stats = False
        self.last_stats: dict[str, Tensor] | None = None

    def phase(self, t: Tensor) -> tuple[Tensor | bool, Tensor | bool]:
        """Whether forward number t may use moving statistics and renormalize (before the buffer check)."""
        if self.policy is not None:
            return self.policy
        return t >= self.warmup_iters, t > max(self.renorm_warmup_iters, self.warmup_iters)

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

    def forward(self, x: Tensor) -> Tensor:
        groups = check_input(type(self).__name__, x, self.num_features, self.norm_batch_size, self.training)
        if not self.training:
            scale, shift = self.inference_affine()
            c = self.num_features
            return torch.addcmul(shift.to(x.dtype).view(1, c, 1, 1), x, scale.to(x.dtype).view(1, c, 1, 1))
        return _MABNFunction.apply(x, self.weight, self.bias, self, groups)

    def extra_repr(self) -> str:
        return (
            f"{self.num_features}, buffer_size={self.buffer_size}, momentum={self.momentum}, eps={self.eps}, "
            f"warmup_iters={self.warmup_iters}, renorm_warmup_iters={self.renorm_warmup_iters}, "
            f"renorm_clip={self.renorm_clip}, norm_batch_size={self.norm_batch_size}, stats={self.stats!r}, "
            f"renorm={self.renorm}"
        )
