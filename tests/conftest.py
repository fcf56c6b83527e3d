import os

import pytest
import torch

# Tests run on the CPU and must never reach the network (wandb, weight downloads).
os.environ.setdefault("WANDB_MODE", "disabled")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
