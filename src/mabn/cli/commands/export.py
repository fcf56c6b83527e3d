"""``python -m mabn export CKPT``: a trained checkpoint -> the folded inference model, as TorchScript (.pt), a
torch.export ExportedProgram (.pt2) and ONNX.

Every norm that is linear at inference (BN, BRN, MABN) is folded into the conv before it, so the exported network
costs what a BN network costs; GroupNorm stays. Each output is checked before it is written
(``mabn.inference.export``): a file that does not reproduce the trained network is never left behind. The .pt2
program and the ONNX model take any batch, height and width. Every file carries its metadata (input normalisation,
channel order, classes; ``mabn.inference.export.metadata``): in the ONNX file's metadata_props and in the
TorchScript and torch.export archives' metadata.json.
"""

from __future__ import annotations

from pathlib import Path

from ...inference import FORMATS
from ..help import command_parser, positive


def main(argv: list[str]) -> int:
    parser = command_parser("export", __doc__)
    parser.add_argument(
        "checkpoint", type=Path, help="a Lightning checkpoint of SegmentationTask or ClassificationTask"
    )
    parser.add_argument("--out", type=Path, help="output folder (default: the checkpoint's folder)")
    parser.add_argument(
        "--input-size",
        type=positive,
        nargs=2,
        metavar=("H", "W"),
        help="sample input size the outputs are checked at (default: 512 1024 for PSPNet, 224 224 for ResNet); "
        "the .pt2 program and the ONNX model take any size",
    )
    parser.add_argument(
        "--formats",
        nargs="+",
        choices=FORMATS,
        metavar="FORMAT",
        default=list(FORMATS),
        help="the files to write: torchscript (.folded.pt), pt2 (.folded.pt2), onnx (.onnx); default: all three",
    )
    args = parser.parse_args(argv)
    from ...inference.export import export  # the ONNX exporters and the models: imported once the arguments parse

    export(args.checkpoint, args.out, tuple(args.input_size) if args.input_size else None, args.formats)
    return 0
