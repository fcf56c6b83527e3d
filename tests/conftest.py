import os

import pytest
import torch

# Tests run on the CPU and must never reach the network (wandb, weight downloads).
os.environ.setdefault("WANDB_MODE", "disabled")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def device() -> torch.device:
    """Where the reference-checked layers run: the CPU, or MABN_TEST_DEVICE (e.g. cuda) to hold a GPU's
    kernels to the same float64 references (`MABN_TEST_DEVICE=cuda pytest tests/test_norm_reference.py`)."""
    return torch.device(os.environ.get("MABN_TEST_DEVICE", "cpu"))
