import gc
import os
from pathlib import Path

# One thread per process, set before torch is imported so that the processes tests start inherit it: the suite
# runs as one pytest-xdist worker per core, and a second OpenMP thread per worker spins against the other worker
# and runs ~10x slower than one.
os.environ["OMP_NUM_THREADS"] = "1"

import pytest  # noqa: E402

# The cyclic garbage collector runs after every 700 net allocations by default, and the tests' parsers, networks
# and Trainers allocate millions of long-lived objects: over tests/test_docs_commands.py, test_scaling.py and
# test_runs.py it ran 3281 times for 2.3 s of 40 s, at 50,000 it runs 34 times for 0.7 s. What a test must see
# collected it collects itself (gc.collect).
gc.set_threshold(50_000, 20, 20)

# torch is imported by the tests, not here: pytest-xdist's controller loads this file before it starts the workers,
# and runs no test itself.

# Tests run on the CPU and must never reach the network (wandb, weight downloads).
os.environ.setdefault("WANDB_MODE", "disabled")
# Where the tests marked ``gpu`` run their layers: the CPU, or MABN_TEST_DEVICE (cuda: `make test-gpu`).
DEVICE = os.environ.get("MABN_TEST_DEVICE", "cpu")
# MABN2d's Triton statistic kernels (CUDA) run on CPU tensors through Triton's interpreter, which must be chosen
# before Triton is first imported. On a GPU they run compiled.
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_finish(session: pytest.Session) -> None:
    """The modules imported by collection (torch, Lightning, torchvision, smp: millions of objects that live as long
    as the process) leave the collector's generations: each full collection of the tests would walk them again."""
    gc.freeze()


def pytest_unconfigure(config: pytest.Config) -> None:
    """At a pytest-xdist worker's exit Python's finalization collects every object still alive, the imported
    modules' with them: a second or more, which the controller waits out for each worker. Frozen, they are left to
    the process's end."""
    gc.freeze()


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test marked ``gpu(cuda_only=True)`` has no CPU half: it is skipped unless MABN_TEST_DEVICE=cuda."""
    if DEVICE != "cuda" and any(m.kwargs.get("cuda_only") for m in item.iter_markers("gpu")):
        pytest.skip("needs a GPU: run with MABN_TEST_DEVICE=cuda (make test-gpu)")


@pytest.fixture(autouse=True, scope="session")
def _mask_cache_dir(tmp_path_factory):
    """The mask check's cache (``mabn.data.masks.cache_dir``) of every run the tests start, in this process or
    another, in a folder of the session's: never in the user's cache folder."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MABN_CACHE_DIR", str(tmp_path_factory.mktemp("mabn-cache")))
        yield


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    """One torch thread, also where torch was imported before OMP_NUM_THREADS was set."""
    import torch

    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    import torch

    torch.manual_seed(0)


@pytest.fixture
def device():
    """Where the reference-checked layers run (a ``torch.device``): the CPU, or MABN_TEST_DEVICE (e.g. cuda) to hold
    a GPU's kernels to the same float64 references (`MABN_TEST_DEVICE=cuda pytest -m gpu`)."""
    import torch

    return torch.device(DEVICE)


@pytest.fixture
def graph_stand_in(monkeypatch, request):
    """CUDA-graph capture on the CPU: the GPU checks pass, a ``GraphStandIn`` replaces torch's capture, and the
    managed norms keep their non-finite verdicts in their flags as on a GPU (``reads_at_once``), where the
    warm-ups' NaN gradients would otherwise raise at once. Parametrized indirectly with False, the stand-in is the
    ``make_graphed_callables`` of a torch without ``capture_error_mode`` (2.11 and before)."""
    import torch

    import mabn.norm.managed
    import mabn.tasks.base
    import mabn.tasks.cudagraph
    from helpers.graphs import GraphStandIn

    def no_check(model, device):
        return None

    monkeypatch.setattr(mabn.tasks.cudagraph, "check_capturable", no_check)
    monkeypatch.setattr(mabn.tasks.base, "check_capturable", no_check)
    monkeypatch.setattr(mabn.norm.managed, "reads_at_once", lambda device: False)
    stand_in = GraphStandIn(takes_mode=getattr(request, "param", True))
    monkeypatch.setattr(torch.cuda, "make_graphed_callables", stand_in)
    return stand_in


@pytest.fixture
def decoded(monkeypatch) -> list[Path]:
    """The masks whose values a dataset check decodes, in order (``mabn.data.masks.unknown_in`` counted)."""

    from mabn.data import masks

    paths: list[Path] = []
    unknown_in = masks.unknown_in

    def counting(path, classes):
        paths.append(path)
        return unknown_in(path, classes)

    monkeypatch.setattr(masks, "unknown_in", counting)
    return paths


@pytest.fixture(scope="session")
def tiny_cityscapes(tmp_path_factory) -> Path:
    """The generated Cityscapes layout of the short stage-2 fits: 4 training and 2 validation scenes of 32x64."""
    from mabn.data.synthetic import cityscapes as demo_cityscapes

    return demo_cityscapes.generate(tmp_path_factory.mktemp("data") / "cs", n_train=4, n_val=2, size=(32, 64))


@pytest.fixture(scope="session")
def tiny_imagenet(tmp_path_factory) -> Path:
    """The generated ImageNet layout of the short stage-1 and ablation fits: 4 training and 2 validation images
    per class, 40x40."""
    from mabn.data.synthetic import imagenet as demo_imagenet

    return demo_imagenet.generate(tmp_path_factory.mktemp("data") / "cls", n_train=4, n_val=2, size=40)


@pytest.fixture(scope="session")
def backbones(tmp_path_factory):
    """Light backbone files (``helpers.backbone_files.Backbones``), built once per session."""
    from helpers.backbone_files import Backbones

    return Backbones(tmp_path_factory.mktemp("backbones"))


@pytest.fixture(scope="session")
def stage2_run(tmp_path_factory):
    """A short stage-2 fit (``helpers.fits.TINY``: MABN, PSPNet on ResNet-18, crop 32) of ``python -m mabn
    cityscapes`` on a generated Cityscapes (``helpers.fits.shared_fit``), made once for the whole test run: test,
    predict, export, plots and the docs' commands read it; a test that writes into it works on a
    ``helpers.fits.copy_run``."""
    from helpers.fits import shared_fit

    return shared_fit(tmp_path_factory, "cityscapes")


@pytest.fixture(scope="session")
def segment_run(tmp_path_factory):
    """The same fit of ``python -m mabn segment`` on a generated dataset of one's own, one training image below
    the crop (``helpers.fits.shared_fit``)."""
    from helpers.fits import shared_fit

    return shared_fit(tmp_path_factory, "segment")
