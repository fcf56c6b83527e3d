"""Per-step statistics of one norm layer, for the paper's Figures 2, 5 and 6.

Each probe keeps one record per training step: l2 norms over channels of per-channel statistics, taken
from the step's first normalization batch (what a batch of 2 sees in the small-batch runs) and, for
MABN2d, from the whole gradient batch of 32 (the "regular" statistic the paper compares with).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from ...norm import BatchRenorm2d, MABN2d


def _l2(t: Tensor) -> float:
    return float(torch.linalg.vector_norm(t.double()))


class BatchNormProbe:
    """mu_B, sigma^2_B (forward) and g_B = mean(dL/dy), psi_B = mean(dL/dy * y) (backward) of BN, with
    y = (x - mu_B) / sqrt(sigma^2_B + eps) the normalized input (paper, eq. 4): ``<stat>`` of the step's
    first normalization batch, ``<stat>_regular`` of the whole gradient batch (y still normalized per
    normalization batch, as the network sees it).

    For ``nn.BatchNorm2d`` and ghost-batch BN (``GhostBatchNorm2d``, or any ``BatchRenorm2d`` with r_max=1,
    d_max=0: r = 1 and out = gamma * y + beta, hence dL/dy = gamma * dL/dout). BRN proper scales y by r != 1: refused.
    """

    def __init__(self, layer: nn.Module) -> None:
        if isinstance(layer, BatchRenorm2d) and (layer.r_max != 1.0 or layer.d_max != 0.0):
            raise TypeError("BatchNormProbe: BatchRenorm2d renormalizes (r_max > 1 or d_max > 0); dL/dy needs r and d")
        if not isinstance(layer, nn.BatchNorm2d | BatchRenorm2d):
            raise TypeError(f"BatchNormProbe: expected a BatchNorm2d or ghost-batch BatchRenorm2d, got {type(layer)}")
        self.layer = layer
        self.records: list[dict[str, float]] = []
        self._current: dict[str, float] = {}
        self._handle: RemovableHandle = layer.register_forward_hook(self._forward)

    def _forward(self, layer: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> None:
        if not layer.training:
            return
        n, c, h, w = inputs[0].shape
        b = getattr(layer, "norm_batch_size", None) or n
        with torch.no_grad():
            x = inputs[0].detach().double()
            groups = x.view(n // b, b, c, h, w)
            var, mu = torch.var_mean(groups, dim=(1, 3, 4), correction=0, keepdim=True)  # (G, 1, C, 1, 1)
            y = (groups - mu) / (var + layer.eps).sqrt()
            var_all, mu_all = torch.var_mean(x, dim=(0, 2, 3), correction=0)
        self._current = {"mu": _l2(mu[0]), "var": _l2(var[0]), "mu_regular": _l2(mu_all), "var_regular": _l2(var_all)}
        gamma = layer.weight.detach().double().view(1, 1, c, 1, 1)

        def backward(grad: Tensor) -> None:
            dy = grad.double().view(n // b, b, c, h, w) * gamma
            g, psi = dy.mean((1, 3, 4)), (dy * y).mean((1, 3, 4))  # (G, C)
            self._current.update(g=_l2(g[0]), psi=_l2(psi[0]), g_regular=_l2(g.mean(0)), psi_regular=_l2(psi.mean(0)))

        output.register_hook(backward)

    def end_step(self, step: int) -> None:
        """File the statistics of training step ``step`` (call after backward)."""
        self.records.append({"step": step, **self._current})
        self._current = {}

    def close(self) -> None:
        self._handle.remove()


class MABNProbe:
    """chi^2 and psi of an MABN2d layer from its own ``last_stats``: the first normalization batch's batch
    statistic and the statistic it used (its SMA once the moving averages are active), beside the mean over
    the step's normalization batches, which is the statistic of the whole gradient batch (equal counts)."""

    def __init__(self, layer: MABN2d) -> None:
        if not isinstance(layer, MABN2d):
            raise TypeError(f"MABNProbe: expected an MABN2d, got {type(layer)}")
        self.layer = layer
        self.records: list[dict[str, float]] = []
        layer.track_stats = True

    def end_step(self, step: int) -> None:
        """File the statistics of training step ``step`` (call after backward)."""
        s = self.layer.last_stats
        if s is None or "psi_batch" not in s:
            raise RuntimeError(f"MABNProbe: no statistics of step {step}; call end_step after the backward")
        self.records.append(
            {
                "step": step,
                "chi2_batch": _l2(s["chi2_batch"][0]),
                "chi2_used": _l2(s["chi2_used"][0]),
                "chi2_regular": _l2(s["chi2_batch"].mean(0)),
                "psi_batch": _l2(s["psi_batch"][0]),
                "psi_used": _l2(s["psi_used"][0]),
                "psi_regular": _l2(s["psi_batch"].mean(0)),
                "moving": float(s["active"][0]),
            }
        )
        self.layer.last_stats = None

    def close(self) -> None:
        self.layer.track_stats = False


Probe = BatchNormProbe | MABNProbe


def make_probe(layer: nn.Module) -> Probe:
    """The probe for ``layer``'s type."""
    return MABNProbe(layer) if isinstance(layer, MABN2d) else BatchNormProbe(layer)
