"""``python -m mabn test CKPT``: a stage-2 checkpoint scored on a split of its dataset, read in the layout of the data
module it was trained with.

The split is read in full images and predicted by the sliding-window code path of validation (crop, flip and
scales as options, the checkpoint's own by default), on one device (a GPU when there is one). The per-class table
of IoU and accuracy, with mIoU and mAcc, is printed as validation prints it, then the pixel accuracy.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from ...data.loading import make_loader
from ...inference.stage2 import configure, data_root, inference_trainer, load_stage2
from ...tasks.metrics import format_iou_table
from ..help import command_parser


def checkpoint_parser(command: str, description: str | None) -> argparse.ArgumentParser:
    """The parser of a command on a stage-2 checkpoint (``test``, ``predict``) with what they share: the
    checkpoint, the sliding-window options, the DataLoader workers and the dataset root."""
    parser = command_parser(command, description)
    parser.add_argument(
        "checkpoint", type=Path, help="a stage-2 checkpoint (runs/cityscapes|segment/<norm>/checkpoints/...)"
    )
    parser.add_argument("--crop", type=int, help="window size (default: the checkpoint's eval_crop or crop_size)")
    parser.add_argument(
        "--flip",
        action=argparse.BooleanOptionalAction,
        help="average each window's probabilities with its mirror's (default: the checkpoint's eval_flip)",
    )
    parser.add_argument("--scales", type=float, nargs="+", help="image scales to average (default: the checkpoint's)")
    parser.add_argument("--num-workers", type=int, default=4, help="DataLoader workers")
    parser.add_argument("--data", type=Path, help="the dataset's root (default: the checkpoint's data_dir)")
    return parser


def run_test(ns: argparse.Namespace) -> dict[str, torch.Tensor]:
    checkpoint = load_stage2(ns.checkpoint)
    configure(checkpoint, ns.crop, ns.flip, ns.scales)
    root = data_root(checkpoint, ns.data)
    split = ns.split or checkpoint.data.get("val_split") or "val"
    dataset = checkpoint.dataset(root, split)
    hp = checkpoint.task.hparams
    print(
        f"Testing {ns.checkpoint} on {root} split {split} ({len(dataset)} images): crop {hp.eval_crop}, "
        f"flip {hp.eval_flip}, scales {list(hp.eval_scales)}"
    )
    inference_trainer().test(checkpoint.task, make_loader(dataset, 1, False, ns.num_workers), verbose=False)
    result = checkpoint.task.test_result
    print(format_iou_table(result["per_class_iou"], checkpoint.classes.names, result["per_class_accuracy"]))
    print(f"pixel accuracy {100 * result['pixel_accuracy'].item():.2f}")
    return result


def parser() -> argparse.ArgumentParser:
    parser = checkpoint_parser("test", __doc__)
    parser.add_argument("--split", help="a split of --data, in the dataset's layout (default: the checkpoint's)")
    return parser


def main(argv: list[str]) -> int:
    run_test(parser().parse_args(argv))
    return 0
