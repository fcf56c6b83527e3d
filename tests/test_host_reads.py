"""A steady-state training step never waits for the device in the project's own code.

On a GPU every host read of a device tensor (``item``, ``bool``, ``float``, ``tolist``, ``cpu``...) waits until
the device has run everything queued before it: the host stops issuing kernels, the GPU then runs dry, and an eager
step at MABN's small per-device batches is bound by the host issuing kernels. So nothing the project runs in a
training step may read the device; the one verdict it needs on the host, whether a MABN2d or BatchRenorm2d layer met
a non-finite statistic, MABNCallback reads one optimizer step late from a copy in pinned host memory, which the GPU
finished long before.

The count runs on the CPU, where every tensor is a host tensor, so a read cannot be told from a device read by its
tensor: each read the project's own code makes is recorded as (file, function, operation) and the test holds the
exact set, with the late flag read as its one member. ``reads_at_once`` is patched so the CPU layers keep their
verdicts in device flags as CUDA layers do, instead of reading them at once.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch

import mabn
import mabn.norm.managed
from helpers.trainer import QUIET, flags
from mabn.callbacks import MABNCallback
from mabn.cli import launch
from mabn.cli import lightning as cli
from mabn.data.synthetic import imagenet as demo_imagenet
from mabn.norm import MABN2d
from mabn.norm.managed import managed_norms

SRC = Path(mabn.__file__).resolve().parent
READS = ("item", "__bool__", "__float__", "__int__", "__index__", "tolist", "cpu", "numpy")
STEADY = range(4, 24)  # the counted training batches: 20 steps, past the first ones and before the fit's end
STEPS = STEADY.stop + 2  # one epoch holds them all (60 images, 2 a batch): no epoch end among them
# The one read allowed: MABNCallback's look, one step late, at the copy of every layer's flags in host memory.
LATE_FLAG_READ = ("norm/managed.py", "LateNonfiniteCheck.check", "tolist")


class HostReads(pl.Callback):
    """Records each host read that code under ``src/mabn`` makes, as (batch, file, function, line, operation,
    address of the tensor's storage); the batch is the training batch under way (None outside one). First among
    the callbacks, so that every other callback's hooks of a batch count for that batch."""

    def __init__(self) -> None:
        self.batch: int | None = None
        self.reads: list[tuple[int | None, str, str, int, str, int]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.batch = batch_idx

    def on_train_end(self, trainer, pl_module) -> None:
        self.batch = None

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        for op in READS:
            monkeypatch.setattr(torch.Tensor, op, self._recording(op, getattr(torch.Tensor, op)))

    def _recording(self, op, read):
        def recorded(tensor, *args, **kwargs):
            caller = sys._getframe(1)
            code, line = caller.f_code, caller.f_lineno
            path = Path(code.co_filename).resolve()
            if path.is_relative_to(SRC):
                where = (path.relative_to(SRC).as_posix(), code.co_qualname, line, op)
                self.reads.append((self.batch, *where, tensor.untyped_storage().data_ptr()))
            return read(tensor, *args, **kwargs)

        return recorded


@pytest.fixture(scope="module")
def imagenet_30_steps(tmp_path_factory) -> Path:
    """The generated ImageNet layout with 60 training images (6 per class): 30 batches of 2 in one epoch."""
    return demo_imagenet.generate(tmp_path_factory.mktemp("data") / "cls", n_train=6, n_val=1, size=32)


@pytest.mark.slow  # traces every operator of several fit steps
def test_steady_state_steps_read_only_the_late_flag_copy(imagenet_30_steps, tmp_path, monkeypatch):
    """A stage-1 fit as ``python -m mabn pretrain`` builds it (ClassificationTask, ResNet-18 with MABN2d, the CLI's
    guards, MABNCallback), statistics logging off: in 20 steady-state steps the project reads the host once a step,
    the late flag copy, and nothing else."""
    monkeypatch.chdir(tmp_path)
    # The CPU layers act as CUDA ones: their verdicts go to the device flags, not to an immediate read.
    monkeypatch.setattr(mabn.norm.managed, "reads_at_once", lambda device: False)
    extra = [
        *flags("trainer", max_steps=STEPS, limit_val_batches=0, num_sanity_val_steps=0, **QUIET),
        *flags("data.init_args", batch_size=2, num_workers=0, image_size=32, val_resize=36),
        *flags("model.init_args", arch="resnet18"),
        *flags("model.init_args.norm_policy", log_every_n_steps=0),
    ]
    args = launch.build_args("pretrain", imagenet_30_steps, "mabn", gpus=0, nodes=1, extra=extra)
    built = cli.run_cli(args[1:], run=False)  # without "fit": the CLI's task, data and trainer, fitted below
    recorder = HostReads()
    built.trainer.callbacks.insert(0, recorder)
    recorder.install(monkeypatch)
    built.trainer.fit(built.model, built.datamodule)
    monkeypatch.undo()

    assert built.trainer.global_step == STEPS
    assert any(isinstance(c, MABNCallback) for c in built.trainer.callbacks)
    assert any(isinstance(m, MABN2d) for m in built.model.modules())
    steady = [r for r in recorder.reads if r[0] in STEADY]
    found = Counter(r[1:5] for r in steady)
    listing = "\n".join(f"  {n:4d} x {file}:{line} {function} {op}" for (file, function, line, op), n in found.items())
    print(f"host reads from src/mabn in {len(STEADY)} steady-state steps: {len(steady)}\n{listing}")
    assert Counter((file, function, op) for _, file, function, _, op, _ in steady) == {LATE_FLAG_READ: len(STEADY)}, (
        f"host reads in {len(STEADY)} steady-state steps:\n{listing}"
    )
    # What it reads is the copy, never a layer's flags themselves (on CUDA: pinned host memory, not the device).
    cpu = torch.device("cpu")
    layer_flags = {m.nonfinite_flags(cpu).untyped_storage().data_ptr() for m in managed_norms(built.model).values()}
    assert not layer_flags & {storage for *_, storage in steady}
