"""A trained checkpoint -> the folded inference model, as TorchScript, a torch.export program and ONNX
(``python -m mabn export CKPT``), each of the three unless ``--formats`` names fewer.

Every norm that is linear at inference (BN, BRN, MABN) is folded into the conv before it (``fold_norms``),
so the exported network costs what a BN network costs; GroupNorm stays. Each output is checked before it
is written: the folded model against the unfolded one, the TorchScript module against the folded model, and the
ExportedProgram (``.pt2``) and the ONNX file (when onnxruntime is installed) against the folded model, at the sample
size and at a second, non-square one with two images: their batch, height and width are symbolic. A file that does
not reproduce the trained network is never left behind.

Every file says how to use it (``metadata``): the input's channel order, layout and normalisation, the output, the
number of classes and, where the checkpoint records them, the class names and colours; in the ONNX file's
``metadata_props`` and in the TorchScript and torch.export archives' ``metadata.json`` (``METADATA_FILE``), every
value as JSON.
"""

from __future__ import annotations

import copy
import io
import json
import os
import tempfile
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..data.images import IMAGENET_MEAN, IMAGENET_STD, MAX_PIXEL_VALUE
from ..errors import UserError, WriteError
from ..norm import fold_norms
from ..run import first_line, write_atomic, write_faults
from . import FORMATS
from .checkpoint import Restored, load_task
from .stage2 import recorded_classes

# Largest accepted max|a - b| / max|reference| for the folding; float32 outputs may also deviate by
# twice the unfolded model's own float32 rounding error, whichever is larger.
TOLERANCE = 1e-4

# The input size checked and exported when none is given, per task: a Cityscapes frame at half resolution, and
# ImageNet's evaluation crop.
INPUT_SIZES: dict[str, tuple[int, int]] = {"SegmentationTask": (512, 1024), "ClassificationTask": (224, 224)}
# The smallest side the symbolic-shape graphs are traced at (``_dynamic_input``): a ResNet's stride-32 features are
# 4 px here.
TRACE_SIDE = 128
# The TorchScript and torch.export archives' extra file that holds ``metadata`` (read back with torch.jit.load's
# ``_extra_files`` and torch.export.load's ``extra_files``).
METADATA_FILE = "metadata.json"


class ExportError(UserError):
    """A checkpoint that cannot be exported, or an export that does not reproduce the model; names the file."""


@dataclass(frozen=True)
class Difference:
    """How far an output is from its reference: max absolute difference, and that over max |reference|."""

    max_abs: float
    relative: float

    @classmethod
    def between(cls, out: Tensor, ref: Tensor) -> Difference:
        max_abs = (out.double() - ref.double()).abs().max().item()
        return cls(max_abs, max_abs / max(ref.double().abs().max().item(), 1e-30))

    def __str__(self) -> str:
        return f"max abs diff {self.max_abs:.3g}, relative {self.relative:.3g}"


@dataclass(frozen=True)
class Exported:
    """What ``export`` wrote and measured."""

    task: str
    metadata: dict[str, Any]  # what every file carries (``metadata``)
    torchscript: Path | None  # None: not among the formats asked for
    # The torch.export ExportedProgram (.pt2); None: not asked for, or it cannot take the checked sizes (printed).
    program: Path | None
    onnx: Path | None  # None: not asked for, or the ONNX exporter's dependencies are missing (the reason is printed)
    folded: Difference  # folded vs unfolded model, both in float64
    program_diff: Difference | None  # the ExportedProgram vs the folded model at the sample size
    program_other: Difference | None  # the same at ``other_shape``
    onnxruntime: Difference | None  # ONNX file vs folded model at the sample size; None without onnxruntime
    # The same at ``other_shape`` (two images of another size: the graph's batch, height and width are dynamic).
    onnxruntime_other: Difference | None = None
    other_shape: tuple[int, int, int, int] | None = None


def load_model(path: str | Path) -> Restored:
    """The task of a Lightning checkpoint with its weights in eval mode, and its data module's arguments
    (``mabn.inference.checkpoint``)."""
    restored = load_task(path, ExportError)
    model, hp = restored.task.model, restored.task.hparams
    print(
        f"Loaded {restored.name} from {path} (norm {hp.get('norm')}, {hp.get('num_classes')} classes, "
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters)"
    )
    return restored


def metadata(restored: Restored) -> dict[str, Any]:
    """What a consumer of the exported files needs beside the graph: the input is RGB, NCHW, float32, made from
    8-bit pixels (``value_range``) as ``(pixels / 255 - mean) / std`` per channel (ImageNet's statistics, those
    every stage trains with); the output is logits over ``num_classes``. A segmentation checkpoint adds its classes'
    names and [R, G, B] colours in class-index order when its data module declares them (``recorded_classes``: fixed
    by the dataset, or its folder's ``classes.yaml``); a classification checkpoint records none."""
    num_classes = int(restored.task.hparams.num_classes)
    segmentation = restored.name == "SegmentationTask"
    meta: dict[str, Any] = {
        "task": restored.name,
        "input_layout": "NCHW",
        "channel_order": "RGB",
        "value_range": [0, int(MAX_PIXEL_VALUE)],
        "mean": list(IMAGENET_MEAN),
        "std": list(IMAGENET_STD),
        "normalization": f"(pixels / {MAX_PIXEL_VALUE:g} - mean) / std, per channel",
        "output": f"logits {'(N, num_classes, H, W)' if segmentation else '(N, num_classes)'}: softmax over "
        "dim 1 gives the class probabilities, argmax the class" + (" map" if segmentation else ""),
        "num_classes": num_classes,
    }
    classes = recorded_classes(num_classes, restored.data) if segmentation else None
    if classes is not None:
        meta["class_names"] = list(classes.names)
        meta["class_colors"] = [list(color) for color in classes.colors]
    return meta


def _check(what: str, diff: Difference, limit: float, path: Path, outcome: str) -> None:
    if diff.relative > limit:
        raise ExportError(
            f"{path}: {what} differs from the reference ({diff}, allowed relative {limit:.3g}); {outcome}"
        )


def _trace(folded: nn.Module, sample: Tensor) -> torch.jit.ScriptModule:
    """TorchScript by tracing: scripting fails on smp's encoder, and eval mode has no data-dependent branch."""
    with warnings.catch_warnings():
        # torch.jit is deprecated in favour of torch.export, but TorchScript is still the format a plain
        # libtorch / torch.jit.load deployment reads; the deprecation notice would only add noise here.
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.jit")
        return torch.jit.trace(folded, sample, check_trace=False)


def other_size(height: int, width: int) -> tuple[int, int]:
    """The second size the ONNX file is checked at: about half the height and five quarters of the width (one side
    shorter than traced, one longer), both odd (no multiple of the network's stride 8, so the pyramid pooling's bins
    split the features unevenly), and never square."""
    h, w = (height // 2) | 1, (width * 5 // 4) | 1
    return h, w + 2 if w == h else w


def _averaging(n: int | torch.SymInt, bins: int, like: Tensor) -> Tensor:
    """The (bins, n) matrix of adaptive average pooling along one axis of length ``n``: row i averages
    [floor(i n / bins), ceil((i + 1) n / bins)), as ``nn.AdaptiveAvgPool2d`` does; ``n`` may be symbolic."""
    i = torch.arange(bins, device=like.device)
    start = torch.div(i * n, bins, rounding_mode="floor")
    end = torch.div((i + 1) * n + bins - 1, bins, rounding_mode="floor")
    j = torch.arange(n, device=like.device)
    inside = (j >= start[:, None]) & (j < end[:, None])
    return inside.to(like.dtype) / (end - start).to(like.dtype)[:, None]


class AveragingPool2d(nn.Module):
    """``nn.AdaptiveAvgPool2d(bins)`` as two averaging matrices, ``A_h @ x @ A_w^T``, for the ONNX export.

    ONNX has no adaptive pooling, and the exporter's decomposition of it unrolls the sum over each bin's window
    for the traced size: the graph then accepts other sizes and is wrong at some of them (PSPNet's 3- and 6-bin
    pooling, relative error ~0.2), or fails in onnxruntime at others. Built from ``arange`` and comparisons on the
    symbolic height and width, the matrices are right at every size.
    """

    def __init__(self, bins: tuple[int, int]) -> None:
        super().__init__()
        self.bins = bins

    def forward(self, x: Tensor) -> Tensor:
        h, w = x.shape[-2:]
        return _averaging(h, self.bins[0], x) @ x @ _averaging(w, self.bins[1], x).transpose(0, 1)


def _for_onnx(folded: nn.Module) -> nn.Module:
    """A copy of ``folded`` whose adaptive average poolings to fixed bins are ``AveragingPool2d``."""
    model = copy.deepcopy(folded)
    for parent in model.modules():
        for name, child in parent.named_children():
            if isinstance(child, nn.AdaptiveAvgPool2d):
                size = child.output_size
                bins = (size, size) if isinstance(size, int) else tuple(size)
                if all(isinstance(b, int) for b in bins):  # None (keep that axis) stays as it is
                    setattr(parent, name, AveragingPool2d(bins))
    return model


def _dynamic_input(sample: Tensor) -> Tensor:
    """The input torch.export traces a graph of symbolic batch, height and width on: two images (a batch of one would
    be fixed at one) of ``sample``'s size but at least ``TRACE_SIDE`` px a side. torch.export fixes any size that is 1
    in the trace (a ResNet's last features at 32 px), and then the whole input shape, silently: the second-size
    checks refuse such a graph."""
    height, width = (max(side, TRACE_SIDE) for side in sample.shape[-2:])
    return torch.randn(2, 3, height, width, generator=torch.Generator().manual_seed(1))


def _export_onnx(folded: nn.Module, sample: Tensor, path: Path, meta: dict[str, Any]) -> None:
    """Write ``folded`` as one ONNX file (weights inside: under the 2 GB protobuf limit) whose input "image" has
    dynamic batch, height and width (traced on ``_dynamic_input``), with ``meta`` in its ``metadata_props`` (each
    value as JSON). A graph with a fixed dimension is refused here."""
    dims = {0: torch.export.Dim("batch"), 2: torch.export.Dim("height"), 3: torch.export.Dim("width")}
    program = torch.onnx.export(
        _for_onnx(folded),
        (_dynamic_input(sample),),
        dynamo=True,
        verbose=False,
        input_names=["image"],
        output_names=["logits"],
        dynamic_shapes=(dims,),
    )
    shape = list(program.model.graph.inputs[0].shape)
    if any(isinstance(shape[axis], int) for axis in (0, 2, 3)):
        raise RuntimeError(f"the exporter fixed the input shape to {shape}, which no other size would fit")
    program.model.metadata_props.update({key: json.dumps(value) for key, value in meta.items()})
    program.save(str(path), external_data=False)


def _run_onnxruntime(path: Path, *inputs: Tensor) -> list[Tensor] | None:
    """The ONNX file's output for each input on onnxruntime's CPU provider; None when it is not installed. A run
    that fails raises RuntimeError naming the input's shape."""
    try:
        import onnxruntime
    except ImportError:
        return None
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    name, outs = session.get_inputs()[0].name, []
    for x in inputs:
        try:
            outs.append(torch.from_numpy(session.run(None, {name: x.numpy()})[0]))
        except Exception as err:  # onnxruntime's own error types: an index out of range, a shape mismatch
            raise RuntimeError(f"at {'x'.join(map(str, x.shape))}: {first_line(err)}") from err
    return outs


@dataclass
class _Folded:
    """The folded float32 model with what its outputs are held to: the exact (float64, unfolded) output at the
    sample, the folded model's own output there, the allowance, and the folding's float64 difference."""

    model: nn.Module
    exact: Tensor
    out: Tensor
    limit: float
    folding: Difference


def _fold(model: nn.Module, sample: Tensor, checkpoint: Path) -> _Folded:
    """Step 1: fold the norms, checked in float64 (the folding itself) and in float32 (as exported)."""
    # The folding is exact algebra, so check it in float64, where rounding cannot hide or fake an error.
    # The float32 outputs (eager, TorchScript, onnxruntime) are then held to the exact result within
    # twice the float32 rounding error of the unfolded model itself: a deep random-init network turns
    # float32 rounding into ~1e-4 of its output, folded or not (see tests/test_convert_fold.py).
    model64 = copy.deepcopy(model).double()
    exact = model64(sample.double())
    folding = Difference.between(fold_norms(model64)(sample.double()), exact)
    del model64
    shape = "x".join(map(str, sample.shape))
    print(f"folded vs unfolded model on {shape}, float64 (the folding itself): {folding}")
    _check("the folded model", folding, TOLERANCE, checkpoint, "nothing written")

    reference = model(sample)
    folded = fold_norms(model)
    out = folded(sample)
    rounding = Difference.between(reference, exact).relative
    limit = max(TOLERANCE, 2 * rounding)
    print(
        f"folded vs unfolded model, float32 (as exported): {Difference.between(out, reference)} "
        f"(float32 rounding alone puts the unfolded model {rounding:.3g} from exact)"
    )
    _check("the float32 folded model", Difference.between(out, exact), limit, checkpoint, "nothing written")
    return _Folded(folded, exact, out, limit, folding)


def _write_archive(path: Path, archive: bytes | memoryview) -> None:
    """An archive torch serialised in memory, written to ``path`` (``write_atomic``). Writing into a file itself,
    torch's zip writer aborts the process where the disk fills under it (its destructor throws while finishing the
    archive: a C++ dump, exit 134, and the temporary file left); Python's write raises the OSError that
    ``write_atomic`` turns into one line, and the temporary file goes."""
    write_atomic(path, lambda tmp: tmp.write_bytes(archive))


def _written(paths: list[Path]) -> str:
    """What a refusal says was written before it."""
    return f"only {' and '.join(map(str, paths))} written" if paths else "nothing written"


def _write_torchscript(folded: _Folded, sample: Tensor, path: Path, outcome: str, meta: dict[str, Any]) -> Path:
    """Step 2: the traced folded model, checked, written with its metadata."""
    traced = _trace(folded.model, sample)
    ts_out = traced(sample)
    _check("the TorchScript module", Difference.between(ts_out, folded.exact), folded.limit, path, outcome)
    extra = {METADATA_FILE: json.dumps(meta, indent=2)}
    _write_archive(path, traced.save_to_buffer(_extra_files=extra))
    print(f"TorchScript: wrote {path} ({Difference.between(ts_out, folded.out)} to the folded model)")
    return path


def _write_program(
    folded: _Folded, sample: Tensor, other: Tensor, path: Path, outcome: str, meta: dict[str, Any]
) -> tuple[Path | None, Difference | None, Difference | None]:
    """Step 3: the folded model as a torch.export ExportedProgram of symbolic batch, height and width, run at the
    sample and at ``other``'s size, written with its metadata once checked; (its path, its difference at each).

    A program that fails a guard on its input's size at either is not written, in one line, and the export goes on:
    a limit of torch.export's capture, not a wrong file. torch.export keeps a size-dependent decision of the trace as
    such a guard: an smp decoder's crop of the padded logits (``DecoderNet``) is a view that is contiguous at
    multiples of the output stride only, and a feature map of 1 px specialises too (below).
    """
    shown, shown_other = ("x".join(map(str, x.shape)) for x in (sample, other))
    # Dim.DYNAMIC, not a named Dim: torch.export leaves out the sizes at which a feature map would be 1 px (under
    # 9 px for PSPNet's stride-8 features, 33 px for a ResNet's stride-32 ones), which a named Dim's range refuses.
    dims = dict.fromkeys((0, 2, 3), torch.export.Dim.DYNAMIC)
    try:
        program = torch.export.export(folded.model, (_dynamic_input(sample),), dynamic_shapes=(dims,))
    except Exception as err:  # an operator or a Python branch on a size that torch.export cannot capture
        raise ExportError(f"{path}: torch.export failed ({type(err).__name__}: {first_line(err)}); {outcome}") from err
    runnable, outs = program.module(), []
    for x, size in ((sample, shown), (other, shown_other)):
        try:
            outs.append(runnable(x))
        except AssertionError as err:  # "Guard failed: <a condition on the input's size>"
            print(f"ExportedProgram: not written, torch.export's program of this network cannot run at {size} "
                  f"({first_line(err)}); the other files take any size")  # fmt: skip
            return None, None, None
    out, out_other = outs
    _check("the ExportedProgram", Difference.between(out, folded.exact), folded.limit, path, outcome)
    # At the second size the float32 folded model is the reference, as for the ONNX file (``_write_onnx``).
    other_diff = Difference.between(out_other, folded.model(other))
    _check(f"the ExportedProgram at {shown_other}", other_diff, folded.limit, path, outcome)
    diff = Difference.between(out, folded.out)
    extra = {METADATA_FILE: json.dumps(meta, indent=2)}

    buffer = io.BytesIO()
    torch.export.save(program, buffer, extra_files=extra)
    _write_archive(path, buffer.getbuffer())
    print(f"ExportedProgram vs the folded model: {diff} at {shown}, {other_diff} at {shown_other}")
    print(f"ExportedProgram: wrote {path} (input x: any batch, height and width)")
    return path, diff, other_diff


def _write_onnx(
    folded: _Folded, sample: Tensor, other: Tensor, path: Path, outcome: str, meta: dict[str, Any]
) -> tuple[Path | None, Difference | None, Difference | None]:
    """Step 4: the ONNX model, run by onnxruntime at the sample and at ``other``'s size where it is installed, moved
    into place once checked; (its path or None, its difference at the sample and at ``other``)."""
    shown_other = "x".join(map(str, other.shape))
    ort_diff, other_diff = None, None
    # Written in a scratch folder first and moved into place only once checked.
    with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
        scratch_path = Path(scratch) / path.name
        try:
            with write_faults(path):  # a full disk in the scratch folder is one at ``path``
                _export_onnx(folded.model, sample, scratch_path, meta)
        except WriteError:
            raise
        except ImportError as err:  # torch.onnx's dynamo exporter needs the onnx and onnxscript packages
            print(f"ONNX: not written, the exporter needs `pip install onnx onnxscript`: {first_line(err)}")
            return None, None, None
        except Exception as err:  # an operator the exporter cannot translate, or a failed graph capture
            reason = f"{type(err).__name__}: {first_line(err)}"
            raise ExportError(f"{path}: ONNX export failed ({reason}); {outcome}") from err
        try:
            ort_outs = _run_onnxruntime(scratch_path, sample, other)
        except RuntimeError as err:
            raise ExportError(f"{path}: onnxruntime cannot run the ONNX model {err}; {outcome}") from err
        if ort_outs is None:
            print("onnxruntime is not installed: the ONNX file was not run (`pip install onnxruntime`)")
        else:
            _check("the ONNX model under onnxruntime", Difference.between(ort_outs[0], folded.exact), folded.limit,
                   path, outcome)  # fmt: skip
            ort_diff = Difference.between(ort_outs[0], folded.out)
            # At the second size the float32 folded model is the reference: as far from exact as at the sample,
            # so the same allowance holds; a graph fixed to the sample's size is off by O(1).
            other_diff = Difference.between(ort_outs[1], folded.model(other))
            _check(f"the ONNX model under onnxruntime at {shown_other}", other_diff, folded.limit, path, outcome)
            shape = "x".join(map(str, sample.shape))
            print(f"ONNX under onnxruntime vs the folded model: {ort_diff} at {shape}, {other_diff} at {shown_other}")
        os.replace(scratch_path, path)
    print(f"ONNX: wrote {path} (input image: any batch, height and width)")
    return path, ort_diff, other_diff


def export(
    checkpoint: str | Path,
    out_dir: str | Path | None = None,
    input_size: tuple[int, int] | None = None,
    formats: Sequence[str] = FORMATS,
) -> Exported:
    """Fold the checkpoint's model and write, of ``formats``, ``<stem>.folded.pt`` (``torchscript``),
    ``<stem>.folded.pt2`` (``pt2``, torch.export) and ``<stem>.onnx`` (``onnx``) to ``out_dir``.

    ``out_dir`` defaults to the checkpoint's folder, ``input_size`` (H, W) to the task's usual size: the sample
    every output is checked at, in float64 for the folding. The ExportedProgram's and the ONNX graph's inputs have
    symbolic batch, height and width, and each is also held to the float32 folded model on two images of
    ``other_size(H, W)``; the traced TorchScript module accepts other sizes too. Every file carries ``metadata`` of
    the checkpoint.
    """
    unknown = [f for f in formats if f not in FORMATS]
    if unknown or not formats:
        given = ", ".join(map(str, unknown)) or "none"
        raise ExportError(f"export formats: {given}; choose one or more of {', '.join(FORMATS)}")
    checkpoint = Path(checkpoint)
    restored = load_model(checkpoint)
    name, model, meta = restored.name, restored.task.model, metadata(restored)
    named = "with names and colours" if "class_names" in meta else "the checkpoint records no class names"
    print(
        f"metadata: {meta['num_classes']} classes ({named}), input {meta['channel_order']} {meta['input_layout']} "
        f"as {meta['normalization']}"
    )
    height, width = input_size or INPUT_SIZES[name]
    out_dir = Path(out_dir) if out_dir is not None else checkpoint.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = checkpoint.stem
    ts_path, pt2_path, onnx_path = (out_dir / f"{stem}{suffix}" for suffix in (".folded.pt", ".folded.pt2", ".onnx"))
    gen = torch.Generator().manual_seed(0)
    sample = torch.randn(1, 3, height, width, generator=gen)
    other = torch.randn(2, 3, *other_size(height, width), generator=gen)
    other_shape = (2, 3, *other.shape[-2:])

    written: list[Path] = []
    ts_written, pt2_written, onnx_written = None, None, None
    program_diffs: list[Difference | None] = [None, None]
    ort_diff, other_diff = None, None
    with torch.no_grad():
        checked = _fold(model, sample, checkpoint)
        if "torchscript" in formats:
            ts_written = _write_torchscript(checked, sample, ts_path, _written(written), meta)
            written.append(ts_written)
        if "pt2" in formats:
            pt2_written, *program_diffs = _write_program(checked, sample, other, pt2_path, _written(written), meta)
            written += [pt2_written] if pt2_written else []
        if "onnx" in formats:
            onnx_written, ort_diff, other_diff = _write_onnx(checked, sample, other, onnx_path, _written(written), meta)
    return Exported(
        name,
        meta,
        ts_written,
        pt2_written,
        onnx_written,
        checked.folding,
        *program_diffs,
        ort_diff,
        other_diff,
        other_shape,
    )
