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


class GraphStandIn:
    """``torch.cuda.make_graphed_callables`` as a CPU can act it out: ``num_warmup_iters`` real training forwards
    and backwards (gradients by autograd.grad, none accumulated), then the model's forward replaced by a
    "replay" that runs the eager forward. Records the shapes it captured and replayed, over all models."""

    def __init__(self) -> None:
        self.captured: list[tuple[int, ...]] = []
        self.replayed: list[tuple[int, ...]] = []

    def __call__(self, model, sample_args, num_warmup_iters, allow_unused_input):
        params = [p for p in model.parameters() if p.requires_grad]
        for _ in range(num_warmup_iters):
            outs = torch.utils._pytree.tree_leaves(model(*sample_args))
            torch.autograd.grad(outs, params, [torch.ones_like(o) for o in outs], allow_unused=allow_unused_input)
        self.captured.append(tuple(sample_args[0].shape))
        eager = model.forward

        def replay(x):
            self.replayed.append(tuple(x.shape))
            return eager(x)

        model.forward = replay
        return model


@pytest.fixture
def graph_stand_in(monkeypatch) -> GraphStandIn:
    """CUDA-graph capture on the CPU: the GPU checks pass and a ``GraphStandIn`` replaces torch's capture."""
    import mabn.cudagraph
    import mabn.tasks.base

    def no_check(model, device):
        return None

    monkeypatch.setattr(mabn.cudagraph, "check_capturable", no_check)
    monkeypatch.setattr(mabn.tasks.base, "check_capturable", no_check)
    stand_in = GraphStandIn()
    monkeypatch.setattr(torch.cuda, "make_graphed_callables", stand_in)
    return stand_in


@pytest.fixture(scope="session")
def backbones(tmp_path_factory):
    """Light backbone files (``backbone_files.Backbones``), built once per session."""
    from backbone_files import Backbones

    return Backbones(tmp_path_factory.mktemp("backbones"))
