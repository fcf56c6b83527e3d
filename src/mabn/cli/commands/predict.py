"""``python -m mabn predict CKPT``: a stage-2 checkpoint's predictions as PNG files (``mabn.inference.predict``).

For every image of ``--images`` (folders, searched recursively, image files, or glob patterns) or of a split of
the checkpoint's dataset (``--data``, ``--split``: the split's folder of images in the dataset's layout) it writes,
named after the frame the image holds as the checkpoint's dataset names frames (``FolderDataset.frame_name``), into
the output folder:

- the mask in the dataset's own values (each class's first value in its class table), named as the dataset names
  its masks (``FolderDataset.mask_file``: ``masks/<frame>.png`` for a dataset of the user's own, what the dataset's
  scorer reads for one that names it, e.g. Cityscapes' labelIds files);
- ``color/<frame>_color.png``: the classes in the dataset's colours;
- ``overlay/<frame>_overlay.png`` with ``--overlay``: the colours blended over the image.

The output folder defaults to ``<run>/predictions/<checkpoint name>-<split, folder or image name>``. It records
its run in ``predict.json``; a folder holding any other files (another checkpoint, images or options, or files of
unknown origin) is refused unless ``--overwrite`` is given. Every file is written atomically.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ...data.loading import make_loader
from ...errors import ConfigError
from ...inference.predict import FrameImages, PredictionWriter, claim_folder, image_files, images_name
from ...inference.stage2 import Stage2Checkpoint, configure, data_root, inference_trainer, load_stage2
from .test import checkpoint_parser


def image_specs(checkpoint: Stage2Checkpoint, ns: argparse.Namespace) -> list[str | Path]:
    """``--images``, else the split's image folder under ``--data`` (the checkpoint's root by default)."""
    if ns.images:
        if ns.data is not None or ns.split is not None:
            raise ConfigError("give either --images or --data/--split, not both")
        return list(ns.images)
    split = ns.split or checkpoint.data.get("val_split") or "val"
    return list(checkpoint.split_images(data_root(checkpoint, ns.data), split))


def run_predict(ns: argparse.Namespace) -> Path:
    checkpoint = load_stage2(ns.checkpoint)
    classes = checkpoint.classes
    configure(checkpoint, ns.crop, ns.flip, ns.scales)
    specs = image_specs(checkpoint, ns)
    images = FrameImages(image_files(specs), checkpoint.data_module.dataset_class)
    name = images_name(specs)
    out = ns.out or checkpoint.run_folder / "predictions" / f"{ns.checkpoint.stem}-{name}"
    hp = checkpoint.task.hparams
    manifest = {
        "checkpoint": str(ns.checkpoint.resolve()),
        "images": " ".join(str(Path(spec).resolve()) for spec in specs),
        "crop": hp.eval_crop,
        "flip": hp.eval_flip,
        "scales": list(hp.eval_scales),
        "overlay": ns.overlay,
    }
    claim_folder(out, manifest, ns.overwrite)
    writer = PredictionWriter(out, images, ns.overlay, classes)
    loader = make_loader(images, 1, False, ns.num_workers)
    inference_trainer(callbacks=[writer]).predict(checkpoint.task, loader, return_predictions=False)
    layout = images.layout
    parts = f"{layout.prediction_masks}/, color/" + (" and overlay/" if ns.overlay else "")
    what = ", ".join(map(str, specs))
    evaluate = f"; evaluate {out / layout.prediction_masks}" if layout.prediction_scorer else ""
    plural = "" if writer.written == 1 else "s"
    print(f"Wrote {writer.written} prediction{plural} of {what} to {out} ({parts}){evaluate}")
    return out


def parser() -> argparse.ArgumentParser:
    parser = checkpoint_parser("predict", __doc__)
    parser.add_argument(
        "--images",
        nargs="+",
        metavar="PATH",
        help="folders (searched recursively), image files or quoted glob patterns ('photos/*.jpg') to predict",
    )
    parser.add_argument(
        "--split", help="a split of --data, in the dataset's layout (default: the checkpoint's val split)"
    )
    parser.add_argument("--out", type=Path, help="output folder (default: <run>/predictions/<ckpt>-<images>)")
    parser.add_argument("--overlay", action="store_true", help="also write the colours blended over each image")
    parser.add_argument("--overwrite", action="store_true", help="write into a folder holding another run's files")
    return parser


def main(argv: list[str]) -> int:
    run_predict(parser().parse_args(argv))
    return 0
