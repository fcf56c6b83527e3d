import os
from pathlib import Path

# One thread per process, set before torch is imported so that the processes tests start inherit it: the suite
# runs as one pytest-xdist worker per core, and a second OpenMP thread per worker spins against the other worker
# and runs ~10x slower than one.
os.environ["OMP_NUM_THREADS"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

# Tests run on the CPU and must never reach the network (wandb, weight downloads).
os.environ.setdefault("WANDB_MODE", "disabled")
# Where the tests marked ``gpu`` run their layers: the CPU, or MABN_TEST_DEVICE (cuda: `make test-gpu`).
DEVICE = os.environ.get("MABN_TEST_DEVICE", "cpu")
# MABN2d's Triton statistic kernels (CUDA) run on CPU tensors through Triton's interpreter, which must be chosen
# before Triton is first imported. On a GPU they run compiled.
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test marked ``gpu(cuda_only=True)`` has no CPU half: it is skipped unless MABN_TEST_DEVICE=cuda."""
    if DEVICE != "cuda" and any(m.kwargs.get("cuda_only") for m in item.iter_markers("gpu")):
        pytest.skip("needs a GPU: run with MABN_TEST_DEVICE=cuda (make test-gpu)")


@pytest.fixture(autouse=True, scope="session")
def _mask_cache_dir(tmp_path_factory):
    """The mask check's cache (``mabn.data.folder.cache_dir``) of every run the tests start, in this process or
    another, in a folder of the session's: never in the user's cache folder."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MABN_CACHE_DIR", str(tmp_path_factory.mktemp("mabn-cache")))
        yield


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def device() -> torch.device:
    """Where the reference-checked layers run: the CPU, or MABN_TEST_DEVICE (e.g. cuda) to hold a GPU's
    kernels to the same float64 references (`MABN_TEST_DEVICE=cuda pytest -m gpu`)."""
    return torch.device(DEVICE)


class GraphStandIn:
    """``torch.cuda.make_graphed_callables`` as a CPU can act it out, with what torch's does to memory:

    - ``num_warmup_iters`` real training forwards and backwards (gradients by autograd.grad, none accumulated)
      whose output gradients are NaN, as torch's ``torch.empty_like`` ones may read;
    - then the model's forward replaced by a "replay", an autograd Function over (input, *parameters) as torch's
      ``Graphed``: its forward copies the input into a static tensor and runs the eager forward, and returns
      detached views of static output buffers; its backward returns detached views of static gradient buffers,
      which autograd may adopt as ``.grad``;
    - each replay first fills the static gradient buffers with NaN: in torch the forward graph's temporaries may
      share their memory in the graphs' pool, and the backward graph rewrites them. A gradient kept in one across
      a replay is corrupted, as on a GPU.

    Records the shapes it captured and replayed, over all models."""

    def __init__(self) -> None:
        self.captured: list[tuple[int, ...]] = []
        self.replayed: list[tuple[int, ...]] = []

    def __call__(self, model, sample_args, num_warmup_iters, allow_unused_input, **options):
        leaves = torch.utils._pytree.tree_leaves
        params = tuple(model.parameters())
        trainable = [p for p in params if p.requires_grad]
        for _ in range(num_warmup_iters):
            outs = [o for o in leaves(model(*sample_args)) if o.requires_grad]
            nan = [torch.full_like(o, float("nan")) for o in outs]
            torch.autograd.grad(outs, trainable, nan, allow_unused=allow_unused_input)
        self.captured.append(tuple(sample_args[0].shape))
        eager, stand_in = model.forward, self
        static_input = sample_args[0].clone()
        static: dict[str, object] = {}  # outputs, their tree spec, gradient buffers: made by the first replay

        class Replay(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x, *inputs):
                static_input.copy_(x)
                for buf in static.get("grads", ()):
                    if buf is not None:
                        buf.fill_(float("nan"))
                with torch.enable_grad():
                    flat, spec = torch.utils._pytree.tree_flatten(eager(static_input))
                if "outputs" not in static:
                    static.update(outputs=[torch.empty_like(o) for o in flat], spec=spec)
                for buf, o in zip(static["outputs"], flat):
                    buf.copy_(o.detach())
                ctx.flat = flat
                return tuple(o.detach() for o in static["outputs"])

            @staticmethod
            @torch.autograd.function.once_differentiable
            def backward(ctx, *grads):
                grads_in = torch.autograd.grad(ctx.flat, trainable, grads, allow_unused=True)
                by_param = dict(zip(map(id, trainable), grads_in))
                if "grads" not in static:
                    static["grads"] = [None if by_param.get(id(p)) is None else torch.empty_like(p) for p in params]
                for buf, p in zip(static["grads"], params):
                    if buf is not None:
                        buf.copy_(by_param[id(p)])
                return (None, *(None if buf is None else buf.detach() for buf in static["grads"]))

        def replay(x):
            stand_in.replayed.append(tuple(x.shape))
            out = Replay.apply(x, *params)
            return torch.utils._pytree.tree_unflatten(list(out), static["spec"])

        model.forward = replay
        return model


@pytest.fixture
def graph_stand_in(monkeypatch) -> GraphStandIn:
    """CUDA-graph capture on the CPU: the GPU checks pass, a ``GraphStandIn`` replaces torch's capture, and the
    managed norms keep their non-finite verdicts in their flags as on a GPU (``reads_at_once``), where the
    warm-ups' NaN gradients would otherwise raise at once."""
    import mabn.norm.managed
    import mabn.tasks.base
    import mabn.tasks.cudagraph

    def no_check(model, device):
        return None

    monkeypatch.setattr(mabn.tasks.cudagraph, "check_capturable", no_check)
    monkeypatch.setattr(mabn.tasks.base, "check_capturable", no_check)
    monkeypatch.setattr(mabn.norm.managed, "reads_at_once", lambda device: False)
    stand_in = GraphStandIn()
    monkeypatch.setattr(torch.cuda, "make_graphed_callables", stand_in)
    return stand_in


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
