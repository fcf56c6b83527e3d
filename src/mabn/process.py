"""Which process of a launch this is: before any process group exists (the launcher's variables) and inside the
default process group once there is one; printing once per launch."""

from __future__ import annotations

import os

import torch.distributed as dist


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
