"""``python -m mabn pretrain|cityscapes``: pick the real or demo profile, then run the LightningCLI.

The Makefile's ``make pretrain`` and ``make cityscapes`` call this. With the dataset at ``--data`` it runs
the paper's recipe from ``configs/``; without it, it says so, generates a small set in the same on-disk
layout (once) and runs the demo profile, which trains for a few minutes on a CPU.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import cli

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
DEMO_DATA = Path("data")


def _pretrain_profile(data: Path | None) -> tuple[list[str], Path]:
    from .data import demo_imagenet

    if data is not None and (data / "train").is_dir() and (data / "val").is_dir():
        return ["pretrain.yaml"], data
    where = f"at {data}" if data is not None else "given (DATA=...)"
    print(f"No ImageNet {where}: expected train/<wnid>/*.JPEG and val/<wnid>/*.JPEG.")
    print("Running the demo profile on generated data (configs/demo/pretrain.yaml).")
    return ["pretrain.yaml", "demo/pretrain.yaml"], demo_imagenet.generate(DEMO_DATA / "demo-imagenet")


def _cityscapes_profile(data: Path | None) -> tuple[list[str], Path]:
    from .data import demo_cityscapes

    if data is not None and (data / "leftImg8bit").is_dir() and (data / "gtFine").is_dir():
        return ["cityscapes.yaml"], data
    where = f"at {data}" if data is not None else "given (DATA=...)"
    print(f"No Cityscapes {where}: expected leftImg8bit/<split>/<city>/*_leftImg8bit.png and")
    print("gtFine/<split>/<city>/*_gtFine_labelIds.png. Running the demo profile on generated street scenes")
    print("(configs/demo/cityscapes.yaml).")
    return ["cityscapes.yaml", "demo/cityscapes.yaml"], demo_cityscapes.generate(DEMO_DATA / "demo-cityscapes")


PROFILES = {"pretrain": _pretrain_profile, "cityscapes": _cityscapes_profile}


def trainer_args(gpus: int, nodes: int) -> list[str]:
    """Trainer flags for a device count: CPU with 0 GPUs, DDP from 2 devices or 2 nodes on."""
    if gpus == 0:
        return ["--trainer.accelerator", "cpu", "--trainer.devices", "1"]
    args = ["--trainer.accelerator", "gpu", "--trainer.devices", str(gpus), "--trainer.num_nodes", str(nodes)]
    if gpus * nodes > 1:
        args += ["--trainer.strategy", "ddp"]
    return args


def default_backbone(norm: str, backbone: Path | None) -> list[str]:
    """Stage 2 reads ``backbone``, else stage 1's export for the same norm when there is one."""
    if backbone is None:
        candidate = Path("pretrain") / f"resnet101-{norm}.pt"
        if not candidate.is_file():
            return []
        print(f"Using the stage-1 backbone {candidate} (BACKBONE=... picks another).")
        backbone = candidate
    return ["--model.init_args.backbone", str(backbone)]


def build_args(
    stage: str,
    data: Path | None,
    norm: str,
    gpus: int,
    nodes: int,
    extra: list[str],
    backbone: Path | None = None,
) -> list[str]:
    configs, data_dir = PROFILES[stage](data)
    args = ["fit"]
    for name in configs:
        args += ["--config", str(CONFIGS / name)]
    args += ["--data.init_args.data_dir", str(data_dir), "--model.init_args.norm", norm]
    if stage == "cityscapes":
        args += default_backbone(norm, backbone)
    return args + trainer_args(gpus, nodes) + extra


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m mabn", description=__doc__)
    parser.add_argument("stage", choices=sorted(PROFILES))
    parser.add_argument("--data", type=Path, help="dataset root; the demo profile runs when it is absent")
    parser.add_argument("--norm", default="mabn", help="bn, syncbn, gn, brn, mabn or an ablation preset")
    parser.add_argument("--gpus", type=int, default=0, help="GPUs per node (0: CPU)")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--backbone", type=Path, help="stage 2: a stage-1 backbone file (default: pretrain/...)")
    parser.epilog = "Arguments after -- (and any this parser does not know) go to the LightningCLI unchanged."
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    ns, unknown = parser.parse_known_args(argv[:cut])
    cli.main(build_args(ns.stage, ns.data, ns.norm, ns.gpus, ns.nodes, unknown + argv[cut + 1 :], ns.backbone))
