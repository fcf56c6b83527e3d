"""``python -m mabn pretrain|cityscapes [...]`` (profiles), ``python -m mabn export CKPT [...]`` (folded
TorchScript and ONNX), or ``python -m mabn fit|validate|... --config`` (the LightningCLI)."""

import sys

from . import cli, launch

if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in launch.PROFILES:
        launch.main(sys.argv[1:])
    elif len(sys.argv) > 1 and sys.argv[1] == "export":
        from . import export  # only this subcommand needs torch.onnx and the exporters

        export.main(sys.argv[2:])
    else:
        cli.main()
