"""``python -m mabn <command>``: the one entry point of the product; each command lives in ``mabn.commands``,
imported only when it runs (``python -m mabn --help`` lists them)."""

from __future__ import annotations

import difflib
import importlib
import sys

USAGE = """usage: python -m mabn <command> [arguments]   (python -m mabn <command> --help for each)

stages (the recipes of configs/, the demo profile without --data):
  pretrain      stage 1: re-pretrain ResNet-101 on ImageNet and export its backbone
  cityscapes    stage 2: fine-tune PSPNet-101 on Cityscapes from a stage-1 backbone
  segment       stage 2 on a dataset of your own (--data DIR: images/, masks/, classes.yaml)
LightningCLI (--config configs/<stage>.yaml ...):
  fit           train
  validate      score the validation split
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

# Each command's module in mabn.commands.
COMMANDS = {
    "pretrain": "stage",
    "cityscapes": "stage",
    "segment": "stage",
    "fit": "fit",
    "validate": "fit",
    "test": "test",
    "predict": "predict",
    "export": "export",
    "plots": "plots",
    "bench": "bench",
    "ablation": "ablation",
    "demo-data": "demo_data",
}
NAMED = {"stage", "fit"}  # the modules that serve several commands: they get the command's name first


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0 if argv else 2
    module = COMMANDS.get(argv[0])
    if module is None:
        close = difflib.get_close_matches(argv[0], COMMANDS, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        print(f"error: unknown command {argv[0]!r}{hint}; python -m mabn --help lists the commands", file=sys.stderr)
        return 2
    command = importlib.import_module(f"{__package__}.commands.{module}")
    return command.main(argv if module in NAMED else argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
