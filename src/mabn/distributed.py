"""Which process of a launch this is, and what the processes of a launch do together: the launcher's variables
before any process group exists, the default process group once there is one, printing once per launch, and the
collectives over that group (the norm layers' statistics and buffers, agreed flags, on any backend).

Every collective here must be called by all processes, in the same order, with tensors of the same shapes and
dtypes (the same model on every device). Without a process group of two or more the helpers that combine
tensors return at once, so single-device runs pay nothing.
"""

from __future__ import annotations

import atexit
import functools
import os
from collections import defaultdict
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import Tensor

# -- which process this is ----------------------------------------------------------------------------------


def launch_rank() -> int:
    """The global rank the launcher (torchrun, srun) gave this process, before any process group exists."""
    for var in ("RANK", "SLURM_PROCID"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


def first_process() -> bool:
    """True in the launch's first process. Lightning's DDP re-runs the command in each further local process
    with LOCAL_RANK set (and NODE_RANK on other nodes); torchrun and srun set RANK / SLURM_PROCID."""
    local = os.environ.get("LOCAL_RANK", "0") == "0" and os.environ.get("NODE_RANK", "0") == "0"
    return local and launch_rank() == 0


def say(message: str) -> None:
    """Print once per launch: the other processes of a launch need no second copy of the messages."""
    if first_process():
        print(message, flush=True)


def has_process_group() -> bool:
    """Whether this process is in a default ``torch.distributed`` process group (DDP, torchrun)."""
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    """Processes in the default process group; 1 without one."""
    return dist.get_world_size() if has_process_group() else 1


def rank() -> int:
    """This process's rank in the default process group; 0 without one."""
    return dist.get_rank() if has_process_group() else 0


def sync_group() -> bool:
    """Whether statistics can be combined across processes: a default process group of two or more.

    Without one (a single process, or ``torch.distributed`` not initialized) a layer built with
    ``sync_stats=True`` normalizes over its own batch, exactly like one built without it.
    """
    return world_size() > 1


def _end_process_group() -> None:
    if has_process_group():
        dist.destroy_process_group()
    _HOST_GROUP.clear()  # the last reference to ``agree``'s gloo group


@functools.cache  # once per process
def end_process_group_at_exit() -> None:
    """End this process's process groups (the default one and ``agree``'s) before interpreter shutdown. Lightning
    leaves the default group alive after fit, and a destroyed group this module holds lives on; freed only while
    Python tears down, a gloo group's pending work takes the GIL being torn down and aborts a finished worker
    ("terminate called without an active exception"), turning a successful run into a failed exit code. Not a
    collective."""
    atexit.register(_end_process_group)


# -- the norm layers' collectives, inside a forward or backward -----------------------------------------------


def all_reduce_sum_(t: Tensor) -> Tensor:
    """Sum ``t`` over every process of the default group, in place; returns ``t``.

    Every process must call this in the same order (once per layer and direction), as with SyncBatchNorm:
    a layer skipped on one device leaves the others waiting.
    """
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_gather_stacked(t: Tensor) -> Tensor:
    """``t`` of every process of the default group, stacked along a new first dimension (rank order)."""
    parts = [torch.empty_like(t) for _ in range(world_size())]
    dist.all_gather(parts, t.contiguous())
    return torch.stack(parts)


# -- the callbacks' collectives: buffers, checkpoints, agreed flags -------------------------------------------


def _by_kind(tensors: Mapping[str, Tensor]) -> dict[tuple[torch.dtype, torch.device], list[str]]:
    """Names grouped by (dtype, device), so each group travels as one flat tensor: one collective per
    group instead of one per buffer."""
    groups: dict[tuple[torch.dtype, torch.device], list[str]] = defaultdict(list)
    for name, t in tensors.items():
        groups[(t.dtype, t.device)].append(name)
    return groups


def device_mean(tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The mean over the devices of each tensor, as new tensors (the inputs are left as they are)."""
    world = world_size()
    if world == 1:
        return {name: t.clone() for name, t in tensors.items()}
    out: dict[str, Tensor] = {}
    for names in _by_kind(tensors).values():
        flat = torch.cat([tensors[n].detach().reshape(-1) for n in names])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        flat /= world
        for name, part in zip(names, flat.split([tensors[n].numel() for n in names])):
            out[name] = part.view_as(tensors[name]).clone()
    return out


def gather_to_cpu(tensors: Mapping[str, Tensor]) -> list[dict[str, Tensor]]:
    """Every device's copy of ``tensors``, by rank, on the CPU (for a checkpoint)."""
    world = world_size()
    if world == 1:
        return [{name: t.detach().cpu().clone() for name, t in tensors.items()}]
    per_rank: list[dict[str, Tensor]] = [{} for _ in range(world)]
    for names in _by_kind(tensors).values():
        flat = torch.cat([tensors[n].detach().reshape(-1) for n in names])
        parts = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(parts, flat)
        for r, part in enumerate(parts):
            pieces = part.cpu().split([tensors[n].numel() for n in names])
            for name, piece in zip(names, pieces):
                per_rank[r][name] = piece.view_as(tensors[name]).clone()
    return per_rank


_HOST_GROUP: dict[str, object] = {}  # "world": the default group, "group": its gloo group for host values


def _host_group() -> dist.ProcessGroup | None:
    """The group that ``agree`` combines host values over: the default group where it takes CPU tensors (gloo, or
    "cpu:gloo,cuda:nccl"), else a gloo group over the same processes, made at the first call under each default
    group (a collective: every process reaches ``agree`` at the same points)."""
    world = dist.group.WORLD
    if "gloo" in dist.get_backend(world):
        return None
    if _HOST_GROUP.get("world") is not world:
        end_process_group_at_exit()  # this group too: held here, it would be freed only as Python tears down
        _HOST_GROUP.update(world=world, group=dist.new_group(backend="gloo"))
    return _HOST_GROUP["group"]


def agree(flags: list[bool]) -> list[bool]:
    """Whether each of ``flags`` is set on any process (each passes its own), by one all-reduce of host memory over
    a gloo group: no copy to a device, and no wait for the kernels a device has queued (NCCL's all-reduce of a
    device tensor, read back by the host, waits for the whole step)."""
    if world_size() == 1:
        return list(flags)
    value = torch.tensor([int(flag) for flag in flags])
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=_host_group())
    return [bool(v) for v in value.tolist()]


def gather_objects(obj: object) -> list[object]:
    """Every process's ``obj`` (picklable), by rank."""
    if world_size() == 1:
        return [obj]
    out: list[object] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out
