"""``python -m mabn pretrain|cityscapes [...]`` (profiles), ``python -m mabn test|predict CKPT [...]`` (a stage-2
checkpoint scored on a split, or its predictions as Cityscapes PNGs), ``python -m mabn export CKPT [...]``
(folded TorchScript and ONNX), or ``python -m mabn fit|validate --config ...`` (the LightningCLI)."""

import importlib
import sys

from . import cli, launch

# Commands of their own module, imported only when asked for (export needs torch.onnx and the exporters).
COMMANDS = {"export": "export", "test": "evaluate", "predict": "predict"}

if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in launch.PROFILES:
        launch.main(sys.argv[1:])
    elif len(sys.argv) > 1 and sys.argv[1] in COMMANDS:
        importlib.import_module(f"{__package__}.{COMMANDS[sys.argv[1]]}").main(sys.argv[2:])
    else:
        cli.main()
