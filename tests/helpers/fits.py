"""The tests' short stage-2 fits, through the entry point a user runs (``python -m mabn cityscapes|segment``),
and the runs that a whole test session shares (the ``stage2_run`` and ``segment_run`` fixtures of conftest.py)."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock
from PIL import Image

from helpers.trainer import STAGE2_FIT, fit_flags

CROP = 32
# 2 steps of 4 images (1 per epoch) of PSPNet on ResNet-18 at crop ``CROP``, one validation at the end, the norms'
# statistics logged at every step (for ``python -m mabn plots``).
TINY = [
    *fit_flags(2, check_val_every_n_epoch=2, num_sanity_val_steps=0),
    "--data.init_args.global_batch_size", "4", "--data.init_args.num_workers", "0",
    "--data.init_args.crop_size", str(CROP),
    "--model.init_args.arch", "resnet18", "--model.init_args.log_predictions_every_n_epochs", "0",
    "--model.init_args.norm_policy.log_every_n_steps", "1",
]  # fmt: skip


def stage2_args(data: Path, norm: str, *extra: str) -> list[str]:
    """The arguments after ``python -m mabn`` (``fit`` first) of a stage-2 launch on ``data`` from random weights
    (``extra`` may name a backbone, ``--model.init_args.backbone``): 2 steps, one validation at the end
    (``helpers.trainer.STAGE2_FIT``), then ``extra``."""
    from mabn.cli import launch

    return launch.build_args("cityscapes", data, norm, gpus=0, nodes=1, extra=[*STAGE2_FIT, *extra], backbone="none")


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def stage_fit(stage: str, data: Path, folder: Path, norm: str = "mabn", *extra: str) -> str:
    """What ``python -m mabn <stage> --data data --norm norm --backbone none --run-dir folder -- TINY extra``
    printed and logged: a ``TINY`` fit from random weights into ``folder``."""
    from mabn.cli.commands import stage as stage_command

    logged, printed = _Lines(), io.StringIO()
    logger = logging.getLogger("pytorch_lightning")
    logger.addHandler(logged)
    argv = [stage, "--data", str(data), "--norm", norm, "--backbone", "none", "--run-dir", str(folder)]
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(printed):
            warnings.simplefilter("ignore")
            stage_command.main([*argv, "--", *TINY, *extra])
    finally:
        logger.removeHandler(logged)
    return printed.getvalue() + "\n".join(logged.lines)


def shared(tmp_path_factory, name: str, build: Callable[[Path], object]) -> Path:
    """The folder ``name`` that ``build`` fills once for the whole test run: pytest-xdist's workers share the
    session's base folder, and the first worker to ask builds it under a file lock while the others wait, then
    read it. A consumer that writes into it works on a ``copy_run``."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the folder all workers' base folders are in
    folder = root / name
    done = root / f"{name}.done"
    with FileLock(str(root / f"{name}.lock")):
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            build(folder)
            done.touch()
    return folder


def copy_run(folder: Path, target: Path) -> Path:
    """``folder`` at ``target``, its files hard links: a consumer's own folder to write into, in no time. Every file
    the product writes it writes to a temporary name and renames, so the shared file is never changed."""
    shutil.copytree(folder, target, copy_function=os.link)
    return target


@dataclass(frozen=True)
class Run:
    """A shared short fit: its data root, its run folder and what the fit printed and logged."""

    data: Path
    folder: Path
    output: str

    @property
    def checkpoint(self) -> Path:
        return self.folder / "checkpoints" / "last.ckpt"


def shrink(data: Path, name: str, size: tuple[int, int]) -> None:
    """Make the training pair ``name`` of a dataset of one's own ``size`` (width, height): the image resized, the
    mask by nearest neighbour (its values stay the mask values)."""
    for path, resample in (
        (data / "images" / "train" / f"{name}.jpg", Image.Resampling.BILINEAR),
        (data / "masks" / "train" / f"{name}.png", Image.Resampling.NEAREST),
    ):
        with Image.open(path) as image:
            small = image.resize(size, resample)
        small.save(path)


def shared_fit(tmp_path_factory, stage: str) -> Run:
    """The session's ``TINY`` MABN fit of ``stage``, built once for the whole test run (``shared``): cityscapes on a
    generated Cityscapes of 4 training and 3 validation scenes of 32x64; segment on the generated dataset of one's
    own (4 training and 3 validation images of 40x64), its training image scene003 shrunk to 32x20, below the crop."""
    from mabn.data.synthetic import cityscapes as demo_cityscapes
    from mabn.data.synthetic import segment as demo_segment

    def build(root: Path) -> None:
        if stage == "segment":
            data = demo_segment.generate(root / "data", n_train=4, n_val=3, size=(40, 64), seed=5)
            shrink(data, "scene003", (32, 20))
        else:
            data = demo_cityscapes.generate(root / "data", n_train=4, n_val=3, size=(32, 64), seed=5)
        (root / "output.txt").write_text(stage_fit(stage, data, root / "run"))

    root = shared(tmp_path_factory, f"{stage}-run", build)
    return Run(root / "data", root / "run", (root / "output.txt").read_text())
