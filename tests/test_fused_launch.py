"""The Triton launches' safety: a process where Triton cannot launch the kernels trains on the torch-op path after
one warning, and a compiled kernel serves only launches of the configuration it was compiled for (the statistics'
dtype, the pointers' alignment).

On the CPU the kernels run through Triton's interpreter, where the launcher keeps no compiled kernel; the tests
that count compiled launches give the launcher a recording stand-in for the kernel, whose launches go through the
launcher's own cache as on a GPU.
"""

from __future__ import annotations

import copy
import sys
import warnings
from types import SimpleNamespace

import pytest
import torch

import mabn.norm.mabn as mabn_module
from helpers.kernels import kernels, take
from helpers.marks import slow_where_interpreted
from helpers.stream_runs import FLOAT64, check_step, inputs, pair
from mabn.norm import MABN2d, fused, row_kernels

pytestmark = pytest.mark.gpu

CFG = dict(
    buffer_size=4, momentum=0.9, eps=1e-5, renorm_clip=1.5, norm_batch_size=2, warmup_iters=2, renorm_warmup_iters=3
)


@pytest.fixture
def new_process(monkeypatch):
    """``fused.load`` as in a process that has loaded nothing: its answers, and the probe's, are forgotten before
    the test, and again after it, so that the next test's first load probes without this test's patches."""

    def forget() -> None:
        for value in vars(fused).values():
            if hasattr(value, "cache_clear"):
                value.cache_clear()

    monkeypatch.setattr(fused, "_fell_back", False, raising=False)
    forget()
    yield
    forget()


def _no_cuda_stream(monkeypatch) -> None:
    """Where there is no GPU, the launcher's direct path reads device 0 and a null stream, as the CPU cannot."""
    if not torch.cuda.is_available():
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda: SimpleNamespace(cuda_stream=0))


def _triton_launch_fails(monkeypatch) -> None:
    # Triton's own launch raises at its first call (a driver or toolchain that does not work).
    def run(*args, **kwargs):
        raise RuntimeError("launch failed: no usable driver")

    monkeypatch.setattr(row_kernels.affine_kernel, "run", run)


class _OtherTritonKernel:
    """A kernel whose launches run as Triton's do but return a compiled kernel without ``packed_metadata``: what the
    launcher's direct path meets under a Triton whose private launch API differs."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self.arg_names = kernel.arg_names

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.kernel[grid](*args, **kwargs)
            return SimpleNamespace(run=None, function=None)

        return launch


def _direct_launch_fails(monkeypatch) -> None:
    # The launcher's direct path raises at its first use; the launch before it, through Triton's path, works.
    monkeypatch.setattr(row_kernels._affine, "kernel", _OtherTritonKernel(row_kernels.affine_kernel))
    monkeypatch.setattr(row_kernels._affine, "direct", True)  # off under Triton's interpreter
    monkeypatch.setattr(row_kernels._affine, "compiled", {})
    _no_cuda_stream(monkeypatch)


def _import_fails(monkeypatch) -> None:
    # A Triton without the module the launcher reads its settings from: the kernel module does not import.
    import triton

    monkeypatch.delitem(sys.modules, "mabn.norm.mabn_kernels")
    monkeypatch.delattr(triton, "knobs")


FAILURES = {
    "triton-launch": (_triton_launch_fails, "RuntimeError: launch failed: no usable driver"),
    "direct-launch": (
        _direct_launch_fails,
        "AttributeError: 'types.SimpleNamespace' object has no attribute 'packed_metadata'",
    ),
    "import": (_import_fails, "AttributeError: module 'triton' has no attribute 'knobs'"),
}


def _train(layer: MABN2d, device: torch.device) -> tuple[list, dict]:
    """Four training steps of ``layer``: each step's output and gradients, and the layer's state after them."""
    gen = torch.Generator().manual_seed(9)
    results = []
    for _ in range(4):
        x, grad = inputs(gen, 6, layer.num_features)
        x = x.to(device).requires_grad_()
        layer.weight.grad = layer.bias.grad = None
        out = layer(x)
        out.backward(grad.to(device))
        results.append((out.detach(), x.grad, layer.weight.grad.clone(), layer.bias.grad.clone()))
    return results, layer.state_dict()


@pytest.mark.parametrize("failure", sorted(FAILURES))
def test_a_failing_launch_falls_back_to_torch_ops(failure, device, new_process, monkeypatch, capsys):
    """Triton's launch, the direct launch or the kernel module's import fails at its first use: ``fused.load``
    answers None for every kernel module, after one warning line that names the error, and the layer trains on the
    torch-op path, bit for bit as a layer that takes it from the start."""
    simulate, reason = FAILURES[failure]
    simulate(monkeypatch)
    # Every forward selects its kernels through fused.load, as a CUDA tensor does.
    monkeypatch.setattr(mabn_module, "_fused_kernels", lambda x: fused.load("mabn_kernels"))
    base = MABN2d(5, **CFG).double().to(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results, state = _train(copy.deepcopy(base), device)
        assert fused.load("mabn_kernels") is None and fused.load("cenconv_kernels") is None
    take(monkeypatch, None)
    expected_results, expected_state = _train(copy.deepcopy(base), device)
    for step, (got, want) in enumerate(zip(results, expected_results, strict=True)):
        for name, a, b in zip(("output", "grad x", "grad weight", "grad bias"), got, want, strict=True):
            assert torch.equal(a, b), f"{name} at step {step}"
    for key, value in state.items():
        assert torch.equal(value, expected_state[key]), key
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1, messages
    assert reason in messages[0] and "torch-op path" in messages[0], messages[0]
    assert "\n" not in messages[0] and "Traceback" not in messages[0] + capsys.readouterr().err
    # What the GPU check's report says of the path its steps took.
    assert fused.path().startswith("torch ops (") and reason in fused.path()
    monkeypatch.setenv("MABN_FUSED", "0")
    assert fused.path() == "torch ops (MABN_FUSED=0)"


class _Recorder:
    """A kernel as the launcher sees one, that counts its launches instead of running them: those through Triton's
    path (where Triton specializes, and on a GPU compiles, for the arguments) and those of a compiled kernel that
    the launcher kept from an earlier launch."""

    def __init__(self, kernel) -> None:
        self.arg_names = kernel.arg_names
        self.through_triton = 0
        self.kept = 0

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.through_triton += 1
            return SimpleNamespace(
                run=self.run_kept, function=None, packed_metadata=None, launch_metadata=lambda *args: None
            )

        return launch

    def run_kept(self, *args) -> None:
        self.kept += 1


def _record_forward_launches(monkeypatch) -> _Recorder:
    """The forward statistic kernel replaced by a ``_Recorder``, behind its launcher's direct path (off under
    Triton's interpreter), with no compiled kernel kept yet."""
    launcher = kernels()._forward
    recorder = _Recorder(launcher.kernel)
    monkeypatch.setattr(launcher, "kernel", recorder)
    monkeypatch.setattr(launcher, "direct", True)
    monkeypatch.setattr(launcher, "compiled", {})
    _no_cuda_stream(monkeypatch)
    take(monkeypatch, kernels())
    return recorder


def _statistic_step(layer: MABN2d, x: torch.Tensor) -> None:
    """A training forward's statistic step on the kernels (the one that launches the forward statistic kernel),
    three groups of 2; the passes over x, which would read the recorder's unwritten outputs, are left out."""
    layer._statistics(x, 3, False, kernels())


def test_each_statistics_dtype_has_its_own_compiled_kernel(device, monkeypatch):
    """A float64 layer's statistics follow its input: float32 for a float32 input, float64 for a float64 one. The
    launches of one dtype never run the kernel compiled for the other."""
    recorder = _record_forward_launches(monkeypatch)
    layer = MABN2d(5, **CFG).double().to(device)
    for dtype in (torch.float32, torch.float64, torch.float32, torch.float64):
        _statistic_step(layer, torch.randn(6, 5, 3, 5, dtype=dtype, device=device))
    assert (recorder.through_triton, recorder.kept) == (2, 2), "one dtype's launch ran the other's compiled kernel"


def _misalign(layer: MABN2d) -> None:
    """The layer's two histories replaced by views one element into their storage: not 16-byte aligned."""
    for name in ("buffer_x2", "buffer_gz"):
        buffer = getattr(layer, name)
        view = buffer.new_zeros(buffer.numel() + 1)[1:].view_as(buffer).copy_(buffer)
        assert view.data_ptr() % 16 != 0
        setattr(layer, name, view)


def test_a_misaligned_buffer_has_its_own_compiled_kernel(device, monkeypatch):
    """Triton compiles for each pointer's 16-byte alignment: the launches on a layer's misaligned histories never run
    the kernel compiled for an aligned layer of the same configuration, nor the other way round."""
    recorder = _record_forward_launches(monkeypatch)
    aligned = MABN2d(5, **CFG).double().to(device)
    misaligned = copy.deepcopy(aligned)
    _misalign(misaligned)
    for layer in (aligned, misaligned, aligned, misaligned):
        _statistic_step(layer, torch.randn(6, 5, 3, 5, dtype=torch.float64, device=device))
    assert (recorder.through_triton, recorder.kept) == (2, 2), "one alignment's launch ran the other's kernel"


# float32 statistics: a step's chi^2 and psi are rounded to float32 (2^-24 relative), which the moving averages,
# r and the outputs carry through a few steps.
FLOAT32 = dict(rtol=1e-5, atol=1e-6)


@slow_where_interpreted  # the compiled launches it guards exist on a GPU; the interpreter's take ~3 s
def test_launches_of_both_dtypes_and_alignments_match_reference(device, monkeypatch):
    """The launches above run, step after step in turn on one process's launchers: a float64 layer fed float32 and
    one fed float64, and a layer with misaligned histories, each against the float64 reference."""
    take(monkeypatch, kernels())
    runs = {}
    for name, tol in (("float32 statistics", FLOAT32), ("float64 statistics", FLOAT64), ("misaligned", FLOAT64)):
        runs[name] = (*pair(5, CFG, device), tol)
    _misalign(runs["misaligned"][0])
    gen = torch.Generator().manual_seed(4)
    for step in range(1, 7):
        x, grad = inputs(gen, 6, 5)
        for name, (layer, ref, tol) in runs.items():
            dtype = torch.float32 if name == "float32 statistics" else torch.float64
            check_step(layer, ref, x.to(dtype), grad.to(dtype), f"{name}, step {step}", tol)
