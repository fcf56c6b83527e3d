"""What MABN2d and BatchRenorm2d share as layers that MABNCallback manages: a phase policy that also lives on the
device, statistics logging, and non-finite statistics reported without stalling a GPU.

Both layers refuse to store a non-finite statistic (one NaN would poison their moving averages for good). Where
``reads_at_once`` holds (the CPU, outside ``torch.compile``) the verdict is read at once and the step raises. On
CUDA reading it would stall the GPU at every layer, and while a CUDA graph is captured or ``torch.compile`` traces
nothing may read the device from the host: there the verdict stays in the layer's sticky device flags, and the
layer reads nothing on the host. MABNCallback reports them one optimizer step late (``LateNonfiniteCheck``: a
copy of every layer's flags into pinned host memory, read at the next step, when the GPU has long finished it); a
training loop without the callback calls ``raise_if_nonfinite`` or ``raise_if_any_nonfinite`` itself.

The flags and the policy's device copy exist from construction and move with the layer (``_apply``): a compiled
forward reads and updates them in place, where creating them would make them outputs of the traced graph.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch
from torch import Tensor, nn

from ..compat import DeviceMoves, mark_static_address
from ._checks import nonfinite_error


def reads_at_once(device: torch.device) -> bool:
    """Whether a layer on ``device`` reads a non-finite verdict on the host in the step that met it: on the CPU,
    where the read costs nothing, but not inside a region that ``torch.compile`` traces (no host read there). On
    CUDA it would stall the GPU at every layer: the verdict stays in the layer's device flags."""
    return device.type == "cpu" and not torch.compiler.is_compiling()


def _static(t: Tensor) -> Tensor:
    """``t``, marked as a tensor whose address stays: ``torch.compile(mode="reduce-overhead")`` replays CUDA
    graphs only when every input they update in place is such a tensor (parameters and buffers are)."""
    mark_static_address(t)
    return t


def _holds(t: Tensor, device: torch.device) -> bool:
    """Whether ``t`` is on ``device``, where ``cuda`` without an index names the current CUDA device (as
    ``cuda:0`` there): a flag tensor must stay the one a captured CUDA graph reads, whichever way the device is
    spelt."""
    if device.index is None and device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    return t.device == device


class ManagedNorm(DeviceMoves):
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
        # Non-finite statistics met and not yet reported (see _check).
        self._flags = self._new_flags("cpu")
        # The tickets with which the programs of a Triton statistic kernel agree on its verdict, per direction
        # (mabn_kernels): zero between launches.
        self._tickets = self._new_tickets("cpu")

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

    def tickets(self, device: torch.device) -> Tensor:
        """(len(NONFINITE),) int32 on ``device``, zero between launches: a statistic kernel's tickets."""
        if not _holds(self._tickets, device):
            self._tickets = self._new_tickets(device)
        return self._tickets

    def moved(self, fn: Callable[[Tensor], Tensor]) -> None:
        """``Module.to``, ``cuda``, ``to_empty``...: on another device, new flags there, as ``policy_flags`` and
        ``nonfinite_flags`` make them (the policy kept, no verdict); on the same device the same flags (a captured
        CUDA graph or a compiled step holds them)."""
        device = fn(self._flags).device
        if device != self._flags.device:
            self._policy_flags, self._flags = self._new_policy_flags(device), self._new_flags(device)
            self._tickets = self._new_tickets(device)

    def _new_policy_flags(self, device: torch.device | str) -> Tensor:
        return _static(torch.tensor(self._policy or (0, 0), dtype=torch.int32, device=device))

    def _new_flags(self, device: torch.device | str) -> Tensor:
        return _static(torch.zeros(len(self.NONFINITE), dtype=torch.bool, device=device))

    def _new_tickets(self, device: torch.device | str) -> Tensor:
        return _static(torch.zeros(len(self.NONFINITE), dtype=torch.int32, device=device))

    def _check(self, ok: Tensor | None, direction: int, device: torch.device) -> None:
        """Record a statistic step's verdict: ``ok`` (a bool tensor), or None where a kernel wrote it into the
        flags already. The caller leaves every buffer unchanged when it is false."""
        at_once = reads_at_once(device)
        if ok is None:  # a kernel's verdict, already in the flags
            if at_once:  # a kernel run on CPU tensors (Triton's interpreter, in tests)
                self._raise(self.nonfinite_flags(device).tolist())
        elif at_once:
            if not bool(ok):
                self._raise([i == direction for i in range(len(self.NONFINITE))])
        else:
            self.nonfinite_flags(device)[direction : direction + 1].logical_or_(ok.logical_not())

    def raise_if_nonfinite(self) -> None:
        """Raise if a step since the last report met a non-finite statistic (on CUDA: waits for the device)."""
        self._raise(self._flags.tolist())

    def _raise(self, flags: list[bool], where: str = "") -> None:
        """Raise the error of the first direction set in ``flags``, after clearing the layer's flags (a verdict is
        reported once); ``where`` ends the message."""
        if any(flags):
            self._flags.zero_()
            error = nonfinite_error(type(self).__name__, self.NONFINITE[flags.index(True)])
            raise FloatingPointError(f"{error}{where}")

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
    """``raise_if_nonfinite`` of every layer, with one read of the device for all of them (which waits for it)."""
    layers = list(layers)
    if layers and bool(torch.cat([layer._flags for layer in layers]).any()):
        for layer in layers:
            layer.raise_if_nonfinite()


class LateNonfiniteCheck:
    """The non-finite flags of ``layers`` (by name), read one optimizer step late so that the host never waits for
    the device: ``step(n)``, after the backward of optimizer step ``n``, raises what the previous call's copy
    holds, then copies every layer's flags (one gather) into host memory, pinned on CUDA, without waiting;
    ``check()`` raises what the last copy holds at once. The error names the step whose forward or backward met
    the statistic and the first layer (in module order) that met it. MABNCallback runs one."""

    def __init__(self, layers: Mapping[str, ManagedNorm]) -> None:
        self._layers = list(layers.items())
        self._host: Tensor | None = None  # the last copy
        self._copied: torch.cuda.Event | None = None  # where the device finished it (CUDA)
        self._step: int | None = None  # the optimizer step the last copy followed; None once it is read

    def step(self, n: int) -> None:
        """Raise what the previous copy holds, then start copying the flags as optimizer step ``n`` leaves them."""
        self.check()
        if not self._layers:
            return
        flags = torch.cat([layer._flags for _, layer in self._layers])
        if self._host is None:  # at the first step, not at construction: only then are the layers on their device
            self._host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=flags.is_cuda)
            self._copied = torch.cuda.Event() if flags.is_cuda else None
        self._host.copy_(flags, non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        self._step = n

    def check(self) -> None:
        """Raise what the last copy holds; waits for the device to finish that copy only."""
        if self._step is None:
            return
        step, self._step = self._step, None
        if self._copied is not None:
            self._copied.synchronize()
        flags = self._host.tolist()
        if not any(flags):
            return
        met, start = [], 0
        for name, layer in self._layers:  # each layer's share of the copy, in module order
            own = flags[start : start + len(layer.NONFINITE)]
            start += len(own)
            if any(own):
                met.append((name, layer, own))
            layer._flags.zero_()  # the error below reports every verdict of the copy
        name, layer, own = met[0]
        more = f" and {len(met) - 1} more" if len(met) > 1 else ""
        layer._raise(own, f" (at optimizer step {step}, layer {name}{more})")


def managed_norms(module: nn.Module) -> dict[str, ManagedNorm]:
    """The callback-managed norms (MABN2d, BatchRenorm2d) of ``module`` by qualified name, in module order."""
    return {name: m for name, m in module.named_modules() if isinstance(m, ManagedNorm)}
