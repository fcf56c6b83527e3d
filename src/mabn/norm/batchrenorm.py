"""Batch Renormalization (Ioffe, NeurIPS 2017) with its clipping ramps and ghost batches.

With ``sync_stats=True`` under ``torch.distributed``, group k of every device forms one normalization batch:
its mean and variance are combined over the devices in forward, and the two sums BN's gradient needs
(of dL/dxhat and dL/dxhat * xhat) in backward, as SyncBatchNorm does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..distributed import all_gather_stacked, all_reduce_sum_, sync_group
from ._checks import check_input, check_norm_args
from ._steps import per_sample, per_sample_bn_backward, stat_dtype, values_before_update
from .managed import ManagedNorm


def _ramp(t: Tensor, start: float, end: float, low: float, high: float) -> Tensor:
    """low until step ``start``, linear to high at step ``end``, high afterwards."""
    frac = ((t.to(torch.float64) - start) / max(end - start, 1)).clamp(0.0, 1.0)
    return low + (high - low) * frac


def _moments_across_devices(x: Tensor, groups: int) -> tuple[Tensor, Tensor]:
    """(mean, biased variance), each (G, C), of group k of every device's batch taken together.

    Each device contributes its groups' count, mean and variance (two passes over x, so no E[x^2] - mu^2
    cancellation), and they are merged by Chan's parallel formula after one all-gather.
    """
    n, c, h, w = x.shape
    xs = x.to(stat_dtype(x)).view(groups, n // groups, c, h, w)
    var, mu = torch.var_mean(xs, dim=(1, 3, 4), correction=0)
    count = mu.new_full((groups, 1), float((n // groups) * h * w))
    every = all_gather_stacked(torch.cat([mu, var, count], dim=1))  # (world, G, 2C + 1)
    mus, vars_, counts = every[..., :c], every[..., c : 2 * c], every[..., -1:]
    total = counts.sum(0)
    mean = (counts * mus).sum(0) / total
    var = (counts * (vars_ + (mus - mean).square())).sum(0) / total
    return mean, var


class _SyncBRNFunction(torch.autograd.Function):
    """out = weight * (r * xhat + d) + bias with xhat normalized by statistics over every device.

    r and d are constants (as in the single-device layer); the gradient flows through the shared mean and
    variance, which couples the devices: the backward all-reduces the per-group sums of dL/dout and of
    dL/dout * xhat, so each device's input gradient is that of the cross-device batch.
    """

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor, mu: Tensor, var: Tensor, r: Tensor, d: Tensor,
                eps: float) -> Tensor:  # fmt: skip
        groups, c = mu.shape
        b = x.shape[0] // groups
        sigma = (var + eps).sqrt()
        scale = weight.to(mu.dtype) * r / sigma
        shift = bias.to(mu.dtype) + weight.to(mu.dtype) * d - scale * mu
        ctx.save_for_backward(x, weight)
        ctx.stats, ctx.eps = (mu, var, sigma, r, d), eps
        return torch.addcmul(per_sample(shift, b).to(x.dtype), x, per_sample(scale, b).to(x.dtype))

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        x, weight = ctx.saved_tensors
        mu, var, sigma, r, d = ctx.stats
        n, c, h, w = x.shape
        groups = mu.shape[0]
        b = n // groups
        weight_r = weight.to(mu.dtype) * r

        # With the shared mean and variance and weight * r of each sample's group: dL/dxhat / sigma, and the
        # per-(sample, channel) sums of dL/dout * xhat and of dL/dout, in one fused pass.
        def sample_channel(t: Tensor) -> Tensor:
            return per_sample(t, b).reshape(n * c)

        g_scaled, dout_xhat, dout_sum = per_sample_bn_backward(
            grad_out, x, sample_channel(weight_r), sample_channel(mu), sample_channel(var), ctx.eps,
            ctx.needs_input_grad[0],
        )  # fmt: skip
        local_dxh = dout_xhat.view(groups, b, c).sum(1)
        local_d = dout_sum.view(groups, b, c).sum(1)
        count = float(b * h * w)
        packed = all_reduce_sum_(torch.cat([local_d, local_dxh, local_d.new_full((groups, 1), count)], dim=1))
        mean_d, mean_dxh = packed[:, :c] / packed[:, -1:], packed[:, c : 2 * c] / packed[:, -1:]
        # dL/dx = (weight r / sigma) (dL/dout - mean(dL/dout) - xhat mean(dL/dout xhat)) = g_scaled + x A + B
        k = weight_r / sigma
        slope = -k * mean_dxh / sigma
        offset = -k * (mean_d - mu * mean_dxh / sigma)
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = g_scaled.view(n, c, h, w).addcmul_(x, per_sample(slope, b).to(x.dtype))
            grad_x.add_(per_sample(offset, b).to(x.dtype))
        # This device's share of the affine gradients; DDP averages them like any other parameter's.
        grad_weight = (r * local_dxh + d * local_d).sum(0).to(weight.dtype)
        grad_bias = local_d.sum(0).to(weight.dtype)
        return grad_x, grad_weight, grad_bias, None, None, None, None, None


class BatchRenorm2d(ManagedNorm):
    """Batch Renormalization: BN whose training output is corrected towards the moving averages.

    Per normalization batch: xhat = (x - mu_B) / sigma_B with the exact BN gradient, then
    out = weight * (r * xhat + d) + bias with r = clip(sigma_B / sigma, 1/rmax, rmax) and
    d = clip((mu_B - mu) / sigma, -dmax, dmax) held constant in backward. rmax ramps 1 -> r_max over
    training forwards r_ramp, dmax 0 -> d_max over d_ramp (Ioffe's schedule by default).
    ``momentum`` uses the paper's convention: stat = momentum * stat + (1 - momentum) * batch_stat.
    With r_max=1 and d_max=0 this is plain BN over each normalization batch: ``GhostBatchNorm2d``.
    Inference: weight * (x - running_mean) / running_std + bias.
    ``sync_stats``: under ``torch.distributed`` with two or more processes, normalize group k of every
    device as one batch (its mean and second moment combined over the devices, and BN's gradient through
    them), so every device holds the same running statistics; every device must run the same number of
    groups. Off: each device normalizes and keeps statistics on its own. Without a process group it
    changes nothing.
    On CUDA non-finite batch statistics are reported without stalling the GPU (see ``ManagedNorm``).
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float = 0.99,
        r_max: float = 3.0,
        d_max: float = 5.0,
        r_ramp: tuple[int, int] = (5000, 40000),
        d_ramp: tuple[int, int] = (5000, 25000),
        norm_batch_size: int | None = None,
        sync_stats: bool = False,
    ) -> None:
        super().__init__()
        check_norm_args(type(self).__name__, momentum, norm_batch_size)
        if r_max < 1.0 or d_max < 0.0:
            raise ValueError(f"BatchRenorm2d: need r_max >= 1 and d_max >= 0, got {r_max}, {d_max}")
        self.num_features = num_features
        self.eps = eps
        self.momentum = momentum
        self.r_max = r_max
        self.d_max = d_max
        self.r_ramp = tuple(r_ramp)
        self.d_ramp = tuple(d_ramp)
        self.norm_batch_size = norm_batch_size
        self.sync_stats = sync_stats
        self.weight = nn.Parameter(torch.ones(num_features))
        self.bias = nn.Parameter(torch.zeros(num_features))
        self.register_buffer("running_mean", torch.zeros(num_features))
        self.register_buffer("running_std", torch.ones(num_features))  # includes eps, as sigma_B does
        self.register_buffer("num_batches_tracked", torch.zeros((), dtype=torch.long))

    def reset_stream(self, reset_ema: bool = False) -> None:
        """Restart the rmax/dmax ramps; ``reset_ema`` also returns the running statistics to their start."""
        self.num_batches_tracked.zero_()
        if reset_ema:
            self.running_mean.zero_()
            self.running_std.fill_(1.0)

    def limits(self, t: Tensor) -> tuple[Tensor, Tensor]:
        """(rmax, dmax) at training forward number t (1-based)."""
        rmax = _ramp(t, *self.r_ramp, 1.0, self.r_max)
        dmax = _ramp(t, *self.d_ramp, 0.0, self.d_max)
        return rmax, dmax

    def inference_affine(self) -> tuple[Tensor, Tensor]:
        """(scale, shift) per channel such that the eval output is x * scale + shift."""
        scale = self.weight / self.running_std
        return scale, self.bias - self.running_mean * scale

    def forward(self, x: Tensor) -> Tensor:
        groups = check_input(type(self).__name__, x, self.num_features, self.norm_batch_size, self.training)
        if not self.training:
            return self.inference(x)
        c = self.num_features
        n, _, h, w = x.shape
        b, sdt = n // groups, stat_dtype(x)
        synced = self.sync_stats and sync_group()
        with torch.no_grad():
            if synced:
                mu, var = _moments_across_devices(x, groups)
            else:
                # Each group's biased variance in two passes (var_mean): no E[x^2] - mu^2 cancellation when the
                # mean is large against the spread. xhat below gets BN's own exact statistics.
                var, mu = torch.var_mean(x.to(sdt).view(groups, b, c, h, w), dim=(1, 3, 4), correction=0)
            # var + mu^2 is the second moment: a batch whose E[x^2] overflows the statistics dtype is refused, as
            # when it was summed directly (var_mean alone keeps a finite mean and variance of |x| ~ 3e38).
            ok = torch.isfinite(var + mu * mu).all()
            self._check(ok, 0, x.device)  # the CPU raises here; CUDA commits nothing below when not ok
            sigma = (var + self.eps).sqrt()
            run_mean, run_std, tracked = values_before_update(
                self.running_mean, self.running_std, self.num_batches_tracked
            )
            run_mean, run_std = run_mean.to(sdt), run_std.to(sdt)
            rmax, dmax = self.limits(tracked + 1)
            if self.has_policy:
                # MABNCallback's (unused, renormalize): without renormalization r = 1 and d = 0 (plain BN). Read
                # from the device tensor, so that a captured CUDA graph follows the callback.
                renorm_on = self.policy_flags(x.device)[1] != 0
                rmax, dmax = torch.where(renorm_on, rmax, 1.0), torch.where(renorm_on, dmax, 0.0)
            r = torch.minimum(torch.maximum(sigma / run_std, 1.0 / rmax), rmax).to(sdt)
            d = torch.minimum(torch.maximum((mu - run_mean) / run_std, -dmax), dmax).to(sdt)
            if self.track_stats:
                # Copies: in float32 run_mean / run_std are the buffers themselves, updated in place below.
                self.last_stats = {"mu_batch": mu, "sigma_batch": sigma, "mu_ema": run_mean.clone(),
                                   "sigma_ema": run_std.clone(), "r": r, "d": d,
                                   "rmax": rmax, "dmax": dmax}  # fmt: skip
            self.num_batches_tracked.add_(ok.to(self.num_batches_tracked.dtype))
            for running, batch in ((self.running_mean, mu), (self.running_std, sigma)):
                updated = running.lerp(batch.mean(0).to(running.dtype), 1.0 - self.momentum)
                running.copy_(torch.where(ok, updated, running))

        if synced:
            return _SyncBRNFunction.apply(x, self.weight, self.bias, mu, var, r, d, self.eps)
        # BN's own fused kernel does xhat with the exact gradient; r and d enter as its affine.
        weight, bias = self.weight * r, self.weight * d + self.bias
        outs = [
            F.batch_norm(x[k * b : (k + 1) * b], None, None, weight[k], bias[k], True, 0.0, self.eps)
            for k in range(groups)
        ]
        return outs[0] if groups == 1 else torch.cat(outs)

    def extra_repr(self) -> str:
        return (
            f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, r_max={self.r_max}, "
            f"d_max={self.d_max}, r_ramp={self.r_ramp}, d_ramp={self.d_ramp}, norm_batch_size={self.norm_batch_size}"
            + (", sync_stats=True" if self.sync_stats else "")
        )

    ema_buffers = ("running_mean", "running_std")

    def summary(self) -> dict[str, float]:
        """The batch's mean and sigma against the running ones, r and d (mean, share of r at its bounds) and the
        step's limits rmax and dmax, of the last tracked step."""
        s, l2 = self.last_stats, self.channel_norm
        r, d = s["r"].float(), s["d"].float()
        rmax, dmax = float(s["rmax"]), float(s["dmax"])
        clipped = (r <= 1 / rmax + 1e-6) | (r >= rmax - 1e-6) if rmax > 1 else torch.zeros_like(r, dtype=torch.bool)
        return {
            "mu_batch": l2(s["mu_batch"]),
            "sigma_batch": l2(s["sigma_batch"]),
            "mu_ema": l2(s["mu_ema"]),
            "sigma_ema": l2(s["sigma_ema"]),
            "r_mean": float(r.mean()),
            "r_clipped": float(clipped.float().mean()),
            "d_abs_mean": float(d.abs().mean()),
            "rmax": rmax,
            "dmax": dmax,
        }


class GhostBatchNorm2d(BatchRenorm2d):
    """Ghost-batch BatchNorm: each batch normalized in groups of ``norm_batch_size`` samples with their own statistics
    and BN's exact gradient, the running mean and std (with eps) averaged over the groups, as ``BatchRenorm2d``
    with r = 1 and d = 0 throughout; its buffers and state dict are BatchRenorm2d's.

    ``momentum`` uses the paper's convention (the weight of the old value); ``sync_stats`` as in BatchRenorm2d.
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float = 0.99,
        norm_batch_size: int | None = None,
        sync_stats: bool = False,
    ) -> None:
        super().__init__(
            num_features, eps=eps, momentum=momentum, r_max=1.0, d_max=0.0, norm_batch_size=norm_batch_size,
            sync_stats=sync_stats,
        )  # fmt: skip

    def extra_repr(self) -> str:
        return (
            f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, norm_batch_size={self.norm_batch_size}"
            + (", sync_stats=True" if self.sync_stats else "")
        )
