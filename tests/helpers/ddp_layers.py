"""The synced layers of tests/test_ddp.py, in a module of their own: the processes ``mp.spawn`` starts for
them import this one (torch and mabn's layers, ~1.5 s) instead of test_ddp's Lightning and callbacks (~5 s)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from mabn import BatchRenorm2d, MABN2d

WORLD = 2
MABN_KW = dict(buffer_size=4, warmup_iters=3, renorm_warmup_iters=6, renorm_clip=1.5, momentum=0.9)
BRN_KW = dict(r_ramp=(2, 8), d_ramp=(2, 6), momentum=0.9)
G, B, C, H, W, STEPS = 2, 2, 3, 3, 4, 12  # per device: 2 ghost groups of 2 samples


def make_layer(kind: str, norm_batch_size: int, sync: bool) -> nn.Module:
    torch.manual_seed(0)
    if kind == "mabn":
        layer = MABN2d(C, norm_batch_size=norm_batch_size, sync_stats=sync, **MABN_KW)
    else:
        layer = BatchRenorm2d(C, norm_batch_size=norm_batch_size, sync_stats=sync, **BRN_KW)
    layer = layer.double()
    with torch.no_grad():
        layer.weight.uniform_(0.5, 1.5)
        layer.bias.uniform_(-0.5, 0.5)
    return layer


def layer_data() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per step, inputs and upstream gradients of shape (devices, G * B, C, H, W)."""
    gen = torch.Generator().manual_seed(0)
    shape = (WORLD, G * B, C, H, W)
    xs = [(1 + t % 3) * torch.randn(shape, generator=gen, dtype=torch.float64) + 0.5 for t in range(STEPS)]
    gs = [torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(STEPS)]
    return xs, gs


def run_layer(layer: nn.Module, xs: list[torch.Tensor], gs: list[torch.Tensor]) -> dict[str, list[torch.Tensor]]:
    out = {"out": [], "grad_x": [], "grad_w": [], "grad_b": []}
    for x, g in zip(xs, gs):
        layer.weight.grad = layer.bias.grad = None
        x = x.clone().requires_grad_()
        y = layer(x)
        y.backward(g)
        for key, value in zip(out, (y.detach(), x.grad, layer.weight.grad.clone(), layer.bias.grad.clone())):
            out[key].append(value)
    out["state"] = {k: v.clone() for k, v in layer.state_dict().items()}
    return out


def layer_worker(rank: int, path: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{path}/pg", rank=rank, world_size=WORLD)
    try:
        xs, gs = layer_data()
        results = {
            k: run_layer(make_layer(k, B, True), [x[rank] for x in xs], [g[rank] for g in gs]) for k in ("mabn", "brn")
        }
        torch.save(results, f"{path}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


# The flags each rank passes to ``mabn.distributed.agree``, twice (the second call reuses the first's host group).
AGREE_FLAGS = ([True, False, False], [False, False, True])


def agree_worker(rank: int, path: str) -> None:
    """``agree`` under a default group that says it is NCCL, as a GPU run's is: each all-reduce's tensor device and
    group backend are saved with the results, in ``agree<rank>.pt``, with whether the process still holds the
    host group before and after the hook it runs at exit."""
    from mabn import distributed
    from mabn.distributed import agree

    dist.init_process_group("gloo", init_method=f"file://{path}/pg", rank=rank, world_size=WORLD)
    get_backend, all_reduce = dist.get_backend, dist.all_reduce
    world = dist.group.WORLD
    seen = []

    def nccl_default(group=None):
        return "nccl" if group is None or group is world else get_backend(group)

    def recording(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        seen.append((tensor.device.type, "default" if group is None or group is world else get_backend(group)))
        return all_reduce(tensor, op=op, group=group, async_op=async_op)

    dist.get_backend, dist.all_reduce = nccl_default, recording
    try:
        results = [agree(AGREE_FLAGS[rank]) for _ in range(2)]
        dist.barrier()
    finally:
        dist.get_backend, dist.all_reduce = get_backend, all_reduce
    held = [bool(distributed._HOST_GROUP)]
    distributed._end_process_group()  # what the process runs at exit (end_process_group_at_exit)
    held.append(bool(distributed._HOST_GROUP))
    torch.save({"results": results, "seen": seen, "held": held}, f"{path}/agree{rank}.pt")
