"""RandomStateCallback: every device's random generators in the checkpoint, so a resume draws what an
uninterrupted run would have drawn."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from ..distributed import gather_objects
from .perdevice import PerDeviceState

RNG_KEY = "rng_states"


def collect_rng_states() -> dict[str, Any]:
    """This process's Python, NumPy and torch generators (CPU, and the current CUDA device if in use).

    Only plain types and tensors, so that checkpoints still load weights only (``mabn.run.load_weights_file``).
    """
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    states: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["torch.cuda"] = torch.cuda.get_rng_state()
    return states


def restore_rng_states(states: dict[str, Any]) -> None:
    """Set the generators saved by ``collect_rng_states``."""
    random.setstate(states["python"])
    kind, keys, pos, has_gauss, cached = states["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(states["torch"])
    if "torch.cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["torch.cuda"])


class RandomStateCallback(PerDeviceState):
    """Saves every device's random generator states in each checkpoint and restores them on the same rank.

    Lightning checkpoints no generator state, so after a resume the shuffling of a single-device
    ``RandomSampler`` and every dropout mask would come from wherever the generators stand after start-up.
    With the states saved at the checkpoint and restored at the resume, a run resumed from a checkpoint
    taken at an epoch boundary draws the same numbers as the uninterrupted run. The states of a different
    number of devices cannot be matched to ranks: then they are left alone, with a warning.
    """

    key = RNG_KEY
    what = "random states"
    otherwise = "random draws after the resume differ from an uninterrupted run"

    def gather_states(self) -> list[Any]:
        return gather_objects(collect_rng_states())

    def restore_state(self, state: Any) -> None:
        restore_rng_states(state)
