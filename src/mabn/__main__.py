"""``python -m mabn <command>``: the one entry point of the product; each command lives in ``mabn.cli.commands``
or ``mabn.tools``, imported only when it runs (``python -m mabn --help`` lists them)."""

from __future__ import annotations

import contextlib
import difflib
import importlib
import logging
import sys
import warnings
from collections.abc import Iterator

from .errors import exit_on_user_error

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
  export        a checkpoint -> folded TorchScript, torch.export and ONNX models, checked before they are written
  plots         a run's norm statistics and training curves as PNG files
  bench         the cost of each norm against BN: training step, memory, inference
  ablation      the paper's ImageNet ablation (Tables 2 and 6) at small scale
  demo-data     generate the demo data sets the stages use without --data (pretrain, cityscapes, segment)
"""

# Each command's module: the stages' and checkpoints' in mabn.cli.commands, the tools' in mabn.tools.
COMMANDS = {
    "pretrain": "cli.commands.stage",
    "cityscapes": "cli.commands.stage",
    "segment": "cli.commands.stage",
    "fit": "cli.commands.fit",
    "validate": "cli.commands.fit",
    "test": "cli.commands.test",
    "predict": "cli.commands.predict",
    "export": "cli.commands.export",
    "plots": "tools.plots.command",
    "bench": "tools.bench.command",
    "ablation": "tools.ablation.command",
    "demo-data": "cli.commands.demo_data",
}
NAMED = {"cli.commands.stage", "cli.commands.fit"}  # the modules that serve several commands: the name comes first


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
    command = importlib.import_module(f"{__package__}.{module}")
    try:
        with third_party_quiet():
            return command.main(argv if module in NAMED else argv[1:])
    except Exception as err:  # the one way a command fails: a user's mistake is one line, anything else a traceback
        exit_on_user_error(err)


# Notices of the libraries underneath that a user of this product cannot act on: an internal deprecation inside
# Lightning (its own pytree helper on torch's), and Lightning's advertisement printed at every Trainer.
QUIET_WARNINGS = (r"`isinstance\(treespec, LeafSpec\)` is deprecated",)
QUIET_LOG_PREFIXES = ("💡 Tip:",)
QUIET_LOGGERS = ("pytorch_lightning.utilities.rank_zero", "lightning_fabric.utilities.rank_zero")


class _Quiet(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(QUIET_LOG_PREFIXES)


@contextlib.contextmanager
def third_party_quiet() -> Iterator[None]:
    """Within a command, ``QUIET_WARNINGS`` and ``QUIET_LOG_PREFIXES`` are not shown; the filters end with it."""
    quiet = _Quiet()
    loggers = [logging.getLogger(name) for name in QUIET_LOGGERS]
    with warnings.catch_warnings():
        for message in QUIET_WARNINGS:
            warnings.filterwarnings("ignore", message=message)
        for logger in loggers:
            logger.addFilter(quiet)
        try:
            yield
        finally:
            for logger in loggers:
                logger.removeFilter(quiet)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
