"""Collectives over the default process group: the norm layers' buffers, agreed flags (DDP on any backend).

Every function here is a collective: all processes must call it, in the same order, with tensors of the
same shapes and dtypes (the same model on every device). Without a process group of two or more they
return at once, so single-device runs pay nothing.
"""

from __future__ import annotations

import atexit
import functools
from collections import defaultdict
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import Tensor

from ..process import has_process_group, world_size


def _end_process_group() -> None:
    if has_process_group():
        dist.destroy_process_group()


@functools.cache  # once per process
def end_process_group_at_exit() -> None:
    """End this process's process group before interpreter shutdown. Lightning leaves it alive after fit;
    destroyed only while Python tears down, a gloo group can abort a finished worker ("terminate called
    without an active exception"), turning a successful run into a failed exit code. Not a collective."""
    atexit.register(_end_process_group)


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


def any_device(flag: bool, device: torch.device) -> bool:
    """Whether ``flag`` is set on any device (each device passes its own ``flag``)."""
    if world_size() == 1:
        return flag
    value = torch.tensor([int(flag)], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def gather_objects(obj: object) -> list[object]:
    """Every process's ``obj`` (picklable), by rank."""
    if world_size() == 1:
        return [obj]
    out: list[object] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out
