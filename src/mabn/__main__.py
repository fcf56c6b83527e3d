"""``python -m mabn pretrain|cityscapes [...]`` (profiles) or ``python -m mabn fit|validate|... --config``."""

import sys

from . import cli, launch

if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in launch.PROFILES:
        launch.main(sys.argv[1:])
    else:
        cli.main()
