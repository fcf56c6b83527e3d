import os

import pytest
import torch

# Tests run on the CPU and must never reach the network (wandb, weight downloads).
os.environ.setdefault("WANDB_MODE", "disabled")
# MABN2d's Triton statistic kernels (CUDA) run on CPU tensors through Triton's interpreter, which must be chosen
# before Triton is first imported. On a GPU (MABN_TEST_DEVICE=cuda) they run compiled.
if os.environ.get("MABN_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def device() -> torch.device:
    """Where the reference-checked layers run: the CPU, or MABN_TEST_DEVICE (e.g. cuda) to hold a GPU's
    kernels to the same float64 references (`MABN_TEST_DEVICE=cuda pytest tests/test_norm_reference.py`)."""
    return torch.device(os.environ.get("MABN_TEST_DEVICE", "cpu"))


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module's heavy models (`pytestmark = pytest.mark.usefixtures("one_thread")`): on
    2 shared cores, two OpenMP threads spin against the other load and run ~10x slower than one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
