"""What MABN2d and BatchRenorm2d share as layers that MABNCallback manages: a phase policy that also lives on the
device, statistics logging, and non-finite statistics reported without stalling a GPU.

Both layers refuse to store a non-finite statistic (one NaN would poison their moving averages for good). On
the CPU the verdict is read at once and the step raises. On CUDA reading it would stall the GPU at every layer,
so it is kept in sticky device flags, which each training forward copies to host memory without waiting: the
next training forward raises; so do ``raise_if_nonfinite`` and MABNCallback before every optimizer step. While
a CUDA graph is captured, and inside a region that ``torch.compile`` traces (on any device), nothing may read the
device from the host: the verdicts stay in the flags and MABNCallback's check before the optimizer step remains.

The flags and the policy's device copy exist from construction and move with the layer (``_apply``): a compiled
forward reads and updates them in place, where creating them would make them outputs of the traced graph.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import Tensor, nn

from ._checks import nonfinite_error


def _static(t: Tensor) -> Tensor:
    """``t``, marked as a tensor whose address stays: ``torch.compile(mode="reduce-overhead")`` replays CUDA
    graphs only when every input they update in place is such a tensor (parameters and buffers are)."""
    torch._dynamo.mark_static_address(t)
    return t


def _holds(t: Tensor, device: torch.device) -> bool:
    """Whether ``t`` is on ``device``, where ``cuda`` without an index names the current CUDA device (as
    ``cuda:0`` there): a flag tensor must stay the one a captured CUDA graph reads, whichever way the device is
    spelt."""
    if device.index is None and device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    return t.device == device


class ManagedNorm(nn.Module):
    """Base of the callback-managed norms. ``NONFINITE`` names the statistic of each checked direction."""

    NONFINITE: tuple[str, ...] = ("batch statistics",)

    def __init__(self) -> None:
        super().__init__()
        self._policy: tuple[bool, bool] | None = None
        # Whether a policy is set: what a training step reads on the host. A compiled step then depends on this
        # flag only, not on the policy's values (those it reads from _policy_flags), so phase switches recompile
        # nothing.
        self.has_policy = False
        self._policy_flags = self._new_policy_flags("cpu")  # the policy on the layer's device, read there
        # When set, each training step leaves its per-channel statistics in last_stats (for logging).
        self.track_stats = False
        self.last_stats: dict[str, Tensor] | None = None
        # Non-finite statistics met (see _check); on CUDA also their copy in host memory and the copy's event.
        self._flags = self._new_flags("cpu")
        self._host_flags: Tensor | None = None
        self._copied: torch.cuda.Event | None = None

    # -- the callback's policy -------------------------------------------------------------------------
    @property
    def policy(self) -> tuple[bool, bool] | None:
        """Set by MABNCallback: (use moving statistics, renormalize) instead of the layer's own timeline."""
        return self._policy

    @policy.setter
    def policy(self, value: tuple[bool, bool] | None) -> None:
        value = None if value is None else (bool(value[0]), bool(value[1]))
        if value is not None and value != self._policy:
            # In place: a captured CUDA graph reads the policy from this tensor's address.
            for i, on in enumerate(value):
                self._policy_flags[i].fill_(on)
        self._policy = value
        self.has_policy = value is not None

    def policy_flags(self, device: torch.device) -> Tensor:
        """(2,) int32 on ``device``: the policy (zeros without one), as a training step reads it."""
        if not _holds(self._policy_flags, device):  # an input on another device than the layer
            self._policy_flags = self._new_policy_flags(device)
        return self._policy_flags

    # -- inference ------------------------------------------------------------------------------------
    def inference_affine(self) -> tuple[Tensor, Tensor]:
        """(scale, shift) per channel such that the eval output is x * scale + shift."""
        raise NotImplementedError

    def inference(self, x: Tensor) -> Tensor:
        """The eval-mode output: the per-channel affine map ``inference_affine``, in x's dtype."""
        scale, shift = self.inference_affine()
        c = x.shape[1]
        return torch.addcmul(shift.to(x.dtype).view(1, c, 1, 1), x, scale.to(x.dtype).view(1, c, 1, 1))

    # -- non-finite statistics -------------------------------------------------------------------------
    def nonfinite_flags(self, device: torch.device) -> Tensor:
        """(len(NONFINITE),) bool on ``device``: a non-finite statistic was met, per direction. Sticky until
        reported."""
        if not _holds(self._flags, device):
            self._flags = self._new_flags(device)
        return self._flags

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> ManagedNorm:
        """``Module.to``, ``cuda``, ``to_empty``...: on another device, new flags there, as ``policy_flags`` and
        ``nonfinite_flags`` make them (the policy kept, no verdict); on the same device the same flags (a captured
        CUDA graph or a compiled step holds them)."""
        super()._apply(fn, recurse)
        device = fn(self._flags).device
        if device != self._flags.device:
            self._policy_flags, self._flags = self._new_policy_flags(device), self._new_flags(device)
        return self

    def _new_policy_flags(self, device: torch.device | str) -> Tensor:
        return _static(torch.tensor(self._policy or (0, 0), dtype=torch.int32, device=device))

    def _new_flags(self, device: torch.device | str) -> Tensor:
        return _static(torch.zeros(len(self.NONFINITE), dtype=torch.bool, device=device))

    def _check(self, ok: Tensor | None, direction: int, device: torch.device) -> None:
        """Record a statistic step's verdict: ``ok`` (a bool tensor), or None where a kernel wrote it into the
        flags already. The caller leaves every buffer unchanged when it is false."""
        read_now = device.type == "cpu" and not torch.compiler.is_compiling()
        if ok is None:  # a kernel's verdict, already in the flags
            if read_now:  # a kernel run on CPU tensors (Triton's interpreter, in tests)
                self._raise(self.nonfinite_flags(device).tolist())
        elif read_now:
            if not bool(ok):
                self._raise([i == direction for i in range(len(self.NONFINITE))])
        else:
            self.nonfinite_flags(device)[direction : direction + 1].logical_or_(ok.logical_not())

    def _begin_training_forward(self, x: Tensor) -> bool:
        """Raise what the previous training forward's copied flags hold (waits for that copy only); returns
        whether this forward may touch the host (False while a CUDA graph is captured or torch.compile traces)."""
        host = not (torch.compiler.is_compiling() or (x.is_cuda and torch.cuda.is_current_stream_capturing()))
        if host and self._host_flags is not None:
            self._copied.synchronize()
            self._raise(self._host_flags.tolist())
        return host

    def _end_training_forward(self, x: Tensor, host: bool) -> None:
        """On CUDA, start copying the flags to host memory, to be read by the next training forward."""
        if not (x.is_cuda and host):
            return
        if self._host_flags is None:
            self._host_flags = torch.zeros(len(self.NONFINITE), dtype=torch.bool, pin_memory=True)
            self._copied = torch.cuda.Event()
        self._host_flags.copy_(self.nonfinite_flags(x.device), non_blocking=True)
        self._copied.record()

    def raise_if_nonfinite(self) -> None:
        """Raise if a step since the last report met a non-finite statistic (on CUDA: waits for the device)."""
        self._raise(self._flags.tolist())

    def _raise(self, flags: list[bool]) -> None:
        if any(flags):
            self._flags.zero_()
            if self._host_flags is not None:
                self._host_flags.zero_()
            raise nonfinite_error(type(self).__name__, self.NONFINITE[flags.index(True)])

    # -- what the callbacks read -----------------------------------------------------------------------
    # The exponential moving averages that inference uses: under DDP the devices' mean replaces them for
    # validation and in checkpoints (mabn.callbacks.streams). Each layer names its own.
    ema_buffers: tuple[str, ...] = ()

    def summary(self) -> dict[str, float]:
        """Scalars of the last tracked step's statistics (``last_stats``), logged as ``norm/<layer>/<key>``."""
        raise NotImplementedError(f"{type(self).__name__} has no statistics summary")

    @staticmethod
    def channel_norm(t: Tensor) -> float:
        """l2 norm over channels of a statistic averaged over the step's normalization batches: the scalar of the
        paper's statistics figures."""
        return float(torch.linalg.vector_norm(t.float().reshape(-1, t.shape[-1]).mean(0)))


def raise_if_any_nonfinite(layers: Iterable[ManagedNorm]) -> None:
    """``raise_if_nonfinite`` of every layer, with one read of the device for all of them."""
    layers = list(layers)
    if layers and bool(torch.cat([layer._flags for layer in layers]).any()):
        for layer in layers:
            layer.raise_if_nonfinite()


def managed_norms(module: nn.Module) -> dict[str, ManagedNorm]:
    """The callback-managed norms (MABN2d, BatchRenorm2d) of ``module`` by qualified name, in module order."""
    return {name: m for name, m in module.named_modules() if isinstance(m, ManagedNorm)}
