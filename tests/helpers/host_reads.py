"""Host reads counted on the CPU, where every tensor is a host tensor: ``HostReads`` records each read of a tensor by
the host that would wait for a GPU, by training batch and by the code that made it, whichever code that is (the
project's, Lightning's loop, torchmetrics, torch): the reads through ``torch.Tensor`` methods (``item``, ``bool``,
``tolist``, ``cpu``...) and the operators whose output's size a GPU reads from the device (``bincount``,
``nonzero``, ``unique``, boolean-mask indexing)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import mabn
from helpers.graphs import reads_the_host

SRC = Path(mabn.__file__).resolve().parent
TORCH = Path(torch.__file__).resolve().parent
HERE = Path(__file__).resolve()
# The reading methods that dispatch no operator on a CPU tensor; the others (``item``, ``bool``, ``float``, ``int``)
# reach ``aten._local_scalar_dense``, which ``reads_the_host``.
UNDISPATCHED = ("tolist", "cpu", "numpy")


def _where(frame) -> tuple[str, str, int]:
    """(file, function, line) of the first frame outside torch and this file: under ``src/mabn`` the path inside
    the package, elsewhere the path from the library's folder (``pytorch_lightning/loops/...``)."""
    while frame is not None:
        path = Path(frame.f_code.co_filename).resolve()
        if path != HERE and not path.is_relative_to(TORCH):
            break
        frame = frame.f_back
    if frame is None:
        return ("torch", "?", 0)
    code = frame.f_code
    if path.is_relative_to(SRC):
        name = path.relative_to(SRC).as_posix()
    else:
        parts = path.parts
        at = parts.index("site-packages") + 1 if "site-packages" in parts else len(parts) - 1
        name = "/".join(parts[at:])
    return (name, code.co_qualname, frame.f_lineno)


class _Waits(TorchDispatchMode):
    """Records the operators that read the device from the host (``helpers.graphs.reads_the_host``)."""

    def __init__(self, record) -> None:
        super().__init__()
        self.record = record

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if reads_the_host(func, args):
            tensor = next(t for t in torch.utils._pytree.tree_leaves(args) if isinstance(t, torch.Tensor))
            self.record(sys._getframe(1), func.overloadpacket.__name__, tensor)
        return func(*args, **(kwargs or {}))


class HostReads(pl.Callback):
    """Records host reads as (batch, file, function, line, operation, address of the tensor's storage), each at the
    first frame outside torch; the batch is the training batch under way (None outside one). First among the
    callbacks, so that every other callback's hooks of a batch count for that batch. ``install`` patches the methods,
    and the operators are recorded inside ``recording()``."""

    def __init__(self) -> None:
        self.batch: int | None = None
        self.reads: list[tuple[int | None, str, str, int, str, int]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.batch = batch_idx

    def on_train_end(self, trainer, pl_module) -> None:
        self.batch = None

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        for op in UNDISPATCHED:
            monkeypatch.setattr(torch.Tensor, op, self._recording(op, getattr(torch.Tensor, op)))

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        with _Waits(self._record):
            yield

    def _record(self, frame, op: str, tensor: torch.Tensor) -> None:
        self.reads.append((self.batch, *_where(frame), op, tensor.untyped_storage().data_ptr()))

    def _recording(self, op, read):
        def recorded(tensor, *args, **kwargs):
            self._record(sys._getframe(1), op, tensor)
            return read(tensor, *args, **kwargs)

        return recorded
