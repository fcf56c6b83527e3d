"""``python -m mabn <command>``: the one entry point of the product (``python -m mabn --help`` lists them)."""

from __future__ import annotations

import sys
from collections.abc import Callable

USAGE = """usage: python -m mabn <command> [arguments]   (python -m mabn <command> --help for each)

stages (the recipes of configs/, the demo profile without --data):
  pretrain      stage 1: re-pretrain ResNet-101 on ImageNet and export its backbone
  cityscapes    stage 2: fine-tune PSPNet-101 on Cityscapes from a stage-1 backbone
  segment       stage 2 on a dataset of your own (--data DIR: images/, masks/, classes.yaml)
LightningCLI (--config configs/<stage>.yaml ...):
  fit, validate
stage-2 checkpoints:
  test          score a checkpoint on a split (sliding windows, flip and scales as options): per-class IoU
  predict       a checkpoint's predictions of a split, a folder, an image or a glob: mask PNGs, colour masks
results:
  export        a checkpoint -> folded TorchScript and ONNX models, checked before they are written
  plots         a run's norm statistics and training curves as PNG files
  bench         the cost of each norm against BN: training step, memory, inference
  ablation      the paper's ImageNet ablation (Tables 2 and 6) at small scale
  demo-data     generate the demo data sets the stages use without --data (pretrain, cityscapes, segment)
"""


def _stage(name: str) -> Callable[[list[str]], object]:
    def run(argv: list[str]) -> object:
        from . import launch

        return launch.main([name, *argv])

    return run


def _lightning(argv: list[str]) -> object:
    from . import cli

    return cli.main(argv)


def _module(module: str) -> Callable[[list[str]], object]:
    """A command whose code lives in ``mabn.<module>``, imported only when it runs (export pulls in the ONNX
    exporters, bench and ablation their own models)."""

    def run(argv: list[str]) -> object:
        import importlib

        return importlib.import_module(f"{__package__}.{module}").main(argv)

    return run


def _demo_data(argv: list[str]) -> object:
    import argparse

    from . import launch

    parser = argparse.ArgumentParser(
        prog="python -m mabn demo-data", description="Generate the demo data sets the stages use without --data."
    )
    parser.add_argument("stages", nargs="*", help=f"any of {', '.join(sorted(launch.PROFILES))} (default: all)")
    stages = parser.parse_args(argv).stages or sorted(launch.PROFILES)
    for stage in stages:
        if stage not in launch.PROFILES:
            parser.error(f"unknown stage {stage!r}: choose from {', '.join(sorted(launch.PROFILES))}")
    for stage in stages:
        profile = launch.PROFILES[stage]
        profile.generate_demo(launch.DEMO_DATA / profile.demo.replace("_", "-"))
    return 0


COMMANDS: dict[str, Callable[[list[str]], object]] = {
    "pretrain": _stage("pretrain"),
    "cityscapes": _stage("cityscapes"),
    "segment": _stage("segment"),
    **{name: _lightning for name in ("fit", "validate")},
    "test": _module("evaluate"),
    "predict": _module("predict"),
    "export": _module("export"),
    "plots": _module("plots.__main__"),
    "bench": _module("bench.__main__"),
    "ablation": _module("ablation.__main__"),
    "demo-data": _demo_data,
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0 if argv else 2
    command = COMMANDS.get(argv[0])
    if command is None:
        print(f"error: unknown command {argv[0]!r}\n{USAGE}", file=sys.stderr, end="")
        return 2
    result = command(argv if argv[0] in ("fit", "validate") else argv[1:])
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
