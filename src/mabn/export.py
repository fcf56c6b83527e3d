"""``python -m mabn export CKPT``: a trained checkpoint -> the folded inference model, as TorchScript and ONNX.

Every norm that is linear at inference (BN, BRN, MABN) is folded into the conv before it (``fold_norms``),
so the exported network costs what a BN network costs; GroupNorm stays. Each output is checked before it
is written: the folded model against the unfolded one, the TorchScript module against the folded model,
and the ONNX file (when onnxruntime is installed) against the folded model. A file that does not reproduce
the trained network is never left behind.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from .files import first_line, write_atomic
from .norm import fold_norms
from .tasks.restore import load_task

# Largest accepted max|a - b| / max|reference| for the folding; float32 outputs may also deviate by
# twice the unfolded model's own float32 rounding error, whichever is larger.
TOLERANCE = 1e-4

# The input size checked and exported when none is given, per task: a Cityscapes frame at half resolution, and
# ImageNet's evaluation crop.
INPUT_SIZES: dict[str, tuple[int, int]] = {"SegmentationTask": (512, 1024), "ClassificationTask": (224, 224)}


class ExportError(ValueError):
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
    torchscript: Path
    onnx: Path | None  # None: the ONNX exporter's dependencies are missing (the reason is printed)
    folded: Difference  # folded vs unfolded model, both in float64
    onnxruntime: Difference | None  # ONNX file vs folded model; None without onnxruntime


def load_model(path: str | Path) -> tuple[str, nn.Module]:
    """The network of a Lightning checkpoint with its weights (``mabn.tasks.restore``); returns (task, eval model)."""
    restored = load_task(path, ExportError)
    model, hp = restored.task.model, restored.task.hparams
    print(
        f"Loaded {restored.name} from {path} (norm {hp.get('norm')}, {hp.get('num_classes')} classes, "
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters)"
    )
    return restored.name, model


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


def _export_onnx(folded: nn.Module, sample: Tensor, path: Path) -> None:
    """Write ``folded`` as one ONNX file (weights inside: under the 2 GB protobuf limit) for ``sample``'s shape."""
    program = torch.onnx.export(
        folded, (sample,), dynamo=True, verbose=False, input_names=["image"], output_names=["logits"]
    )
    program.save(str(path), external_data=False)


def _run_onnxruntime(path: Path, sample: Tensor) -> Tensor | None:
    """The ONNX file's output for ``sample`` on onnxruntime's CPU provider; None when it is not installed."""
    try:
        import onnxruntime
    except ImportError:
        return None
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (out,) = session.run(None, {session.get_inputs()[0].name: sample.numpy()})
    return torch.from_numpy(out)


def export(
    checkpoint: str | Path, out_dir: str | Path | None = None, input_size: tuple[int, int] | None = None
) -> Exported:
    """Fold the checkpoint's model and write ``<stem>.folded.pt`` (TorchScript) and ``<stem>.onnx`` to ``out_dir``.

    ``out_dir`` defaults to the checkpoint's folder, ``input_size`` (H, W) to the task's usual size. The ONNX
    graph has that fixed input shape (1, 3, H, W); the traced TorchScript module accepts other sizes too.
    """
    checkpoint = Path(checkpoint)
    name, model = load_model(checkpoint)
    height, width = input_size or INPUT_SIZES[name]
    out_dir = Path(out_dir) if out_dir is not None else checkpoint.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = checkpoint.stem
    ts_path, onnx_path = out_dir / f"{stem}.folded.pt", out_dir / f"{stem}.onnx"
    sample = torch.randn(1, 3, height, width, generator=torch.Generator().manual_seed(0))

    with torch.no_grad():
        # The folding is exact algebra, so check it in float64, where rounding cannot hide or fake an error.
        # The float32 outputs (eager, TorchScript, onnxruntime) are then held to the exact result within
        # twice the float32 rounding error of the unfolded model itself: a deep random-init network turns
        # float32 rounding into ~1e-4 of its output, folded or not (see tests/test_convert_fold.py).
        model64 = copy.deepcopy(model).double()
        exact = model64(sample.double())
        folded_diff = Difference.between(fold_norms(model64)(sample.double()), exact)
        del model64
        print(f"folded vs unfolded model on 1x3x{height}x{width}, float64 (the folding itself): {folded_diff}")
        _check("the folded model", folded_diff, TOLERANCE, checkpoint, "nothing written")

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

        traced = _trace(folded, sample)
        ts_out = traced(sample)
        _check("the TorchScript module", Difference.between(ts_out, exact), limit, ts_path, "nothing written")
        ts_diff = Difference.between(ts_out, out)
        write_atomic(ts_path, lambda tmp: traced.save(str(tmp)))
        print(f"TorchScript: wrote {ts_path} ({ts_diff} to the folded model)")

        onnx_written, ort_diff = None, None
        # Written in a scratch folder first and moved into place only once checked.
        with tempfile.TemporaryDirectory(dir=out_dir) as scratch:
            scratch_path = Path(scratch) / onnx_path.name
            try:
                _export_onnx(folded, sample, scratch_path)
            except ImportError as err:  # torch.onnx's dynamo exporter needs the onnx and onnxscript packages
                print(f"ONNX: not written, the exporter needs `pip install onnx onnxscript`: {first_line(err)}")
            except Exception as err:  # an operator the exporter cannot translate, or a failed graph capture
                reason = f"{type(err).__name__}: {first_line(err)}"
                raise ExportError(f"{onnx_path}: ONNX export failed ({reason}); only {ts_path} written") from err
            else:
                ort_out = _run_onnxruntime(scratch_path, sample)
                if ort_out is None:
                    print("onnxruntime is not installed: the ONNX file was not run (`pip install onnxruntime`)")
                else:
                    diff = Difference.between(ort_out, exact)
                    _check("the ONNX model under onnxruntime", diff, limit, onnx_path, f"only {ts_path} written")
                    ort_diff = Difference.between(ort_out, out)
                os.replace(scratch_path, onnx_path)
                onnx_written = onnx_path
                shown = f" (onnxruntime: {ort_diff} to the folded model)" if ort_diff is not None else ""
                print(f"ONNX: wrote {onnx_path}{shown}")
    return Exported(name, ts_path, onnx_written, folded_diff, ort_diff)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m mabn export", description=__doc__)
    parser.add_argument(
        "checkpoint", type=Path, help="a Lightning checkpoint of SegmentationTask or ClassificationTask"
    )
    parser.add_argument("--out", type=Path, help="output folder (default: the checkpoint's folder)")
    parser.add_argument(
        "--input-size",
        type=int,
        nargs=2,
        metavar=("H", "W"),
        help="sample input size, also the ONNX input shape (default: 512 1024 for PSPNet, 224 224 for ResNet)",
    )
    args = parser.parse_args(argv)
    if args.input_size is not None and min(args.input_size) < 1:
        parser.error(f"--input-size must be positive, got {args.input_size}")
    try:
        export(args.checkpoint, args.out, tuple(args.input_size) if args.input_size else None)
    except ExportError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
