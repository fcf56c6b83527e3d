"""Slow, readable float64 references for MABN2d and BatchRenorm2d.

Written from the specification (docs/library.md, "MABN2d semantics", and the paper's equations), never from the
library code, so that tests comparing the two are an independent check. Everything is float64; loops run over groups in
Python, per-channel quantities are (C,) tensors. No torch.autograd: every backward formula is written by hand.

Both classes hold their own state and offer:
    forward(x) -> out                                   (a training-mode forward; advances the state)
    backward(grad_out) -> (grad_x, grad_weight, grad_bias)   (for the last forward)
    eval(x) -> out                                      (inference; changes no state)
"""

from __future__ import annotations

import torch

REDUCE_DIMS = (0, 2, 3)  # per-channel mean/sum over samples, H and W


def group_slices(batch_size: int, norm_batch_size: int | None) -> list[slice]:
    """Consecutive ghost groups [k*b, (k+1)*b); one group holding the whole batch when b is None."""
    if norm_batch_size is None:
        return [slice(0, batch_size)]
    if batch_size % norm_batch_size != 0:
        raise ValueError("batch not divisible by norm_batch_size")
    return [slice(k * norm_batch_size, (k + 1) * norm_batch_size) for k in range(batch_size // norm_batch_size)]


def per_channel(v: torch.Tensor) -> torch.Tensor:
    """(C,) -> (1, C, 1, 1) for broadcasting against (N, C, H, W)."""
    return v.view(1, -1, 1, 1)


def channel_mean(t: torch.Tensor) -> torch.Tensor:
    return t.mean(dim=REDUCE_DIMS)


def channel_sum(t: torch.Tensor) -> torch.Tensor:
    return t.sum(dim=REDUCE_DIMS)


class RefMABN:
    """Reference MABN2d (moving average batch normalization, ICLR 2020), following docs/library.md, "MABN2d semantics".

    Streams: every ghost group of every training forward appends its chi2 (mean of x^2) to `chi2_stream`;
    every group of every backward appends its psi to `psi_stream`. `log` records, per forward, which groups
    used the moving statistics ("active") and the raw (unclipped) and applied r values, so tests can assert
    that the phases of the schedule were really crossed.
    """

    def __init__(
        self,
        weight,
        bias,
        *,
        buffer_size=16,
        momentum=0.98,
        eps=1e-5,
        warmup_iters=100,
        renorm_warmup_iters=1000,
        renorm_clip=5.0,
        norm_batch_size=None,
        stats="sma",
        renorm=True,
        ema_start="one",
    ):
        assert stats in ("batch", "sma", "ema") and ema_start in ("one", "first")
        self.weight = weight.detach().to(torch.float64).clone()
        self.bias = bias.detach().to(torch.float64).clone()
        self.m = buffer_size
        self.momentum = momentum
        self.eps = eps
        self.warmup_iters = warmup_iters
        self.renorm_warmup_iters = renorm_warmup_iters
        self.renorm_clip = renorm_clip
        self.norm_batch_size = norm_batch_size
        self.stats = stats
        self.renorm = renorm
        self.ema_start = ema_start

        num_features = self.weight.numel()
        self.t = 0  # training forwards so far
        self.chi2_stream: list[torch.Tensor] = []  # one (C,) per group, all forwards
        self.psi_stream: list[torch.Tensor] = []  # one (C,) per group, all backwards
        self.ema = torch.ones(num_features, dtype=torch.float64)  # running second moment (running_var)
        self.psi_ema = torch.zeros(num_features, dtype=torch.float64)  # running psi EMA (stats == "ema")
        self.saved: list[dict] = []  # per group of the last forward
        self.log: list[dict] = []

    # ----------------------------------------------------------------------------------------------- forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.detach().to(torch.float64)
        self.t += 1
        t = self.t
        ema_prev = self.ema.clone()  # what r compares with
        slices = group_slices(x.shape[0], self.norm_batch_size)
        # The EMA before this forward's update: with ema_start "first", the first forward takes its chi2_B (the
        # groups' mean) as the previous EMA.
        if self.ema_start == "first" and t == 1:
            ema_base = sum(channel_mean(x[sl] * x[sl]) for sl in slices) / len(slices)
        else:
            ema_base = ema_prev
        stream_ema = ema_base.clone()  # e_{-1} for the stream EMA over this forward's groups
        renorm_on = self.renorm and t > max(self.renorm_warmup_iters, self.warmup_iters)

        out = torch.empty_like(x)
        self.saved = []
        record = {"t": t, "active": [], "r_raw": [], "r": []}
        for sl in slices:
            xg = x[sl]
            chi2 = channel_mean(xg * xg)
            recorded_before = len(self.chi2_stream)
            active = self.stats != "batch" and recorded_before >= self.m and t >= self.warmup_iters
            self.chi2_stream.append(chi2)
            stream_ema = self.momentum * stream_ema + (1.0 - self.momentum) * chi2

            if not active:
                var = chi2
            elif self.stats == "sma":
                last = self.chi2_stream[-self.m :]
                var = sum(last) / self.m
            else:  # "ema"
                var = stream_ema.clone()

            std = torch.sqrt(var + self.eps)
            r_raw = std / torch.sqrt(ema_prev + self.eps)
            if not self.renorm:
                r = torch.ones_like(r_raw)
            elif not renorm_on:
                r = torch.ones_like(r_raw)
            else:
                r = torch.minimum(
                    torch.maximum(r_raw, torch.full_like(r_raw, 1.0 / self.renorm_clip)),
                    torch.full_like(r_raw, self.renorm_clip),
                )

            z = xg / per_channel(std)
            out[sl] = per_channel(self.weight) * per_channel(r) * z + per_channel(self.bias)

            self.saved.append({"slice": sl, "z": z, "std": std, "r": r, "active": active, "var": var})
            record["active"].append(active)
            record["r_raw"].append(r_raw)
            record["r"].append(r)

        if self.stats == "ema":
            self.ema = stream_ema
        else:
            mean_var = sum(g["var"] for g in self.saved) / len(self.saved)
            self.ema = self.momentum * ema_base + (1.0 - self.momentum) * mean_var
        record["renorm_on"] = renorm_on
        self.log.append(record)
        return out

    # ---------------------------------------------------------------------------------------------- backward
    def backward(self, grad_out: torch.Tensor):
        grad_out = grad_out.detach().to(torch.float64)
        grad_x = torch.empty_like(grad_out)
        grad_w = torch.zeros_like(self.weight)
        grad_b = torch.zeros_like(self.bias)
        stream_psi = self.psi_ema.clone()  # p_{-1}
        for g in self.saved:
            sl, z, std, r = g["slice"], g["z"], g["std"], g["r"]
            go = grad_out[sl]
            gy = per_channel(r) * per_channel(self.weight) * go  # dL/dY, Y = z (before r * weight)
            psi = channel_mean(gy * z)
            psi_active = g["active"] and len(self.psi_stream) >= self.m
            self.psi_stream.append(psi)
            stream_psi = self.momentum * stream_psi + (1.0 - self.momentum) * psi

            if not psi_active:
                psi_bar = psi
            elif self.stats == "sma":
                psi_bar = sum(self.psi_stream[-self.m :]) / self.m
            else:  # "ema"
                psi_bar = stream_psi.clone()

            grad_x[sl] = (gy - z * per_channel(psi_bar)) / per_channel(std)
            grad_w = grad_w + channel_sum(go * per_channel(r) * z)
            grad_b = grad_b + channel_sum(go)
        if self.stats == "ema":
            self.psi_ema = stream_psi
        return grad_x, grad_w, grad_b

    # -------------------------------------------------------------------------------------------------- eval
    def eval(self, x: torch.Tensor) -> torch.Tensor:
        x = x.detach().to(torch.float64)
        scale = self.weight / torch.sqrt(self.ema + self.eps)
        return per_channel(scale) * x + per_channel(self.bias)


class RefBRN:
    """Reference batch renormalization (Ioffe 2017) with linear r_max / d_max ramps and ghost groups.

    Running statistics are running_mean (init 0) and running_std (init 1); r and d are computed from the
    running statistics before this forward and are constants in backward. `log` records the per-group raw
    and clipped r and d together with the bounds in force, for phase assertions.
    """

    def __init__(
        self,
        weight,
        bias,
        *,
        eps=1e-5,
        momentum=0.99,
        r_max=3.0,
        d_max=5.0,
        r_ramp=(5000, 40000),
        d_ramp=(5000, 25000),
        norm_batch_size=None,
    ):
        self.weight = weight.detach().to(torch.float64).clone()
        self.bias = bias.detach().to(torch.float64).clone()
        self.eps = eps
        self.momentum = momentum
        self.r_max = r_max
        self.d_max = d_max
        self.r_ramp = r_ramp
        self.d_ramp = d_ramp
        self.norm_batch_size = norm_batch_size

        num_features = self.weight.numel()
        self.t = 0
        self.running_mean = torch.zeros(num_features, dtype=torch.float64)
        self.running_std = torch.ones(num_features, dtype=torch.float64)
        self.saved: list[dict] = []
        self.log: list[dict] = []

    @staticmethod
    def _ramp(t: int, ramp: tuple[int, int]) -> float:
        start, end = ramp
        return min(max((t - start) / (end - start), 0.0), 1.0)

    def bounds(self, t: int) -> tuple[float, float]:
        """(rmax_t, dmax_t) for training forward number t (1-based)."""
        rmax = 1.0 + (self.r_max - 1.0) * self._ramp(t, self.r_ramp)
        dmax = self.d_max * self._ramp(t, self.d_ramp)
        return rmax, dmax

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.detach().to(torch.float64)
        self.t += 1
        rmax, dmax = self.bounds(self.t)
        mean_prev = self.running_mean.clone()
        std_prev = self.running_std.clone()

        out = torch.empty_like(x)
        self.saved = []
        record = {"t": self.t, "rmax": rmax, "dmax": dmax, "r_raw": [], "r": [], "d_raw": [], "d": []}
        for sl in group_slices(x.shape[0], self.norm_batch_size):
            xg = x[sl]
            mu = channel_mean(xg)
            var = channel_mean((xg - per_channel(mu)) ** 2)  # biased variance
            sigma = torch.sqrt(var + self.eps)
            r_raw = sigma / std_prev
            d_raw = (mu - mean_prev) / std_prev
            r = torch.clamp(r_raw, min=1.0 / rmax, max=rmax)
            d = torch.clamp(d_raw, min=-dmax, max=dmax)
            xhat = (xg - per_channel(mu)) / per_channel(sigma)
            out[sl] = per_channel(self.weight) * (xhat * per_channel(r) + per_channel(d)) + per_channel(self.bias)

            self.saved.append({"slice": sl, "xhat": xhat, "sigma": sigma, "mu": mu, "r": r, "d": d})
            record["r_raw"].append(r_raw)
            record["r"].append(r)
            record["d_raw"].append(d_raw)
            record["d"].append(d)

        n_groups = len(self.saved)
        mean_mu = sum(g["mu"] for g in self.saved) / n_groups
        mean_sigma = sum(g["sigma"] for g in self.saved) / n_groups
        self.running_mean = self.momentum * mean_prev + (1.0 - self.momentum) * mean_mu
        self.running_std = self.momentum * std_prev + (1.0 - self.momentum) * mean_sigma
        self.log.append(record)
        return out

    def backward(self, grad_out: torch.Tensor):
        grad_out = grad_out.detach().to(torch.float64)
        grad_x = torch.empty_like(grad_out)
        grad_w = torch.zeros_like(self.weight)
        grad_b = torch.zeros_like(self.bias)
        for g in self.saved:
            sl, xhat, sigma, r, d = g["slice"], g["xhat"], g["sigma"], g["r"], g["d"]
            go = grad_out[sl]
            dxhat = go * per_channel(self.weight) * per_channel(r)
            mean_dxhat = channel_mean(dxhat)
            mean_dxhat_xhat = channel_mean(dxhat * xhat)
            grad_x[sl] = (dxhat - per_channel(mean_dxhat) - xhat * per_channel(mean_dxhat_xhat)) / per_channel(sigma)
            grad_w = grad_w + channel_sum(go * (xhat * per_channel(r) + per_channel(d)))
            grad_b = grad_b + channel_sum(go)
        return grad_x, grad_w, grad_b

    def eval(self, x: torch.Tensor) -> torch.Tensor:
        x = x.detach().to(torch.float64)
        xhat = (x - per_channel(self.running_mean)) / per_channel(self.running_std)
        return per_channel(self.weight) * xhat + per_channel(self.bias)


class RefOfficialImageNetMABN:
    """The official ImageNet MABN (megvii-model/MABN, ``cls/networks/MABN.py``) in float64, written as that code
    computes: 16 groups of 2 samples per forward, the SMAs as a (B, 2B) averaging matrix over the previous
    forward's B group statistics and this forward's, batch statistics at iteration 1 only, r clipped to
    [1/5, 5] from iteration 100, and the EMA set to the first iteration's mean statistic. Its timeline is the
    official code's constants; only B (the window, also the number of groups per forward) varies."""

    RENORM_FROM = 100  # r = 1 while iters < 100
    CLIP = 5.0

    def __init__(self, weight, bias, *, buffer_size=16, momentum=0.98, eps=1e-5):
        self.weight = weight.detach().to(torch.float64).clone()
        self.bias = bias.detach().to(torch.float64).clone()
        c, b = self.weight.numel(), buffer_size
        self.B, self.momentum, self.eps = b, momentum, eps
        self.running_var = torch.ones(c, dtype=torch.float64)
        # Row i averages columns i+1 .. B+i of [previous forward's B statistics; this forward's B].
        self.sta_matrix = torch.zeros(b, 2 * b, dtype=torch.float64)
        for i in range(b):
            self.sta_matrix[i, i + 1 : b + i + 1] = 1.0 / b
        self.pre_x2 = torch.ones(b, c, dtype=torch.float64)
        self.pre_gz = torch.zeros(b, c, dtype=torch.float64)
        self.iters = 0
        self.saved: dict = {}
        self.log: list[dict] = []  # per forward: iteration, batch statistics used, r applied

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.detach().to(torch.float64)
        self.iters += 1
        n, c, h, w = x.shape
        assert n == 2 * self.B, "the official layer needs exactly 2 * buffer_size samples per forward"
        xg = x.view(n // 2, 2, c, h, w)
        x2 = (xg * xg).mean(dim=(1, 3, 4))  # (B, C)
        var = self.sta_matrix @ torch.cat([self.pre_x2, x2])
        if self.iters == 1:
            var = x2
        var = var.view(n // 2, 1, c, 1, 1)
        z = xg / (var + self.eps).sqrt()
        r = (var + self.eps).sqrt() / (self.running_var.view(1, 1, c, 1, 1) + self.eps).sqrt()
        r = torch.ones_like(r) if self.iters < self.RENORM_FROM else r.clamp(1 / self.CLIP, self.CLIP)
        if self.iters == 1:
            self.running_var = var.mean(dim=0).view(-1)
        self.running_var = self.momentum * self.running_var + (1 - self.momentum) * var.mean(dim=0).view(-1)
        self.pre_x2 = x2
        self.saved = {"z": z, "var": var, "r": r}
        self.log.append({"t": self.iters, "batch_stats": self.iters == 1, "r": r.view(n // 2, c)})
        y = (r * z).view(n, c, h, w)
        return self.weight.view(1, c, 1, 1) * y + self.bias.view(1, c, 1, 1)

    def backward(self, grad_out: torch.Tensor):
        grad_out = grad_out.detach().to(torch.float64)
        n, c, h, w = grad_out.shape
        z, var, r = self.saved["z"], self.saved["var"], self.saved["r"]
        g = (grad_out * self.weight.view(1, c, 1, 1)).view(n // 2, 2, c, h, w) * r
        gz = (g * z).mean(dim=(1, 3, 4))
        mean_gz = self.sta_matrix @ torch.cat([self.pre_gz, gz])
        if self.iters == 1:
            mean_gz = gz
        grad_x = ((g - z * mean_gz.view(n // 2, 1, c, 1, 1)) / (var + self.eps).sqrt()).view(n, c, h, w)
        self.pre_gz = gz
        y = (r * z).view(n, c, h, w)
        return grad_x, (grad_out * y).sum(dim=(0, 2, 3)), grad_out.sum(dim=(0, 2, 3))
