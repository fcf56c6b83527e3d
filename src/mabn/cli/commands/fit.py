"""``python -m mabn fit|validate --config configs/<stage>.yaml ...``: the LightningCLI (``mabn.cli.lightning``) as
is."""

from __future__ import annotations

from ...distributed import end_process_group_at_exit
from .. import lightning as cli


def main(argv: list[str]) -> int:
    """``argv`` starts with the subcommand, ``fit`` or ``validate``."""
    end_process_group_at_exit()  # every run, whatever its norm: a DDP worker must exit cleanly
    cli.run_cli(argv)
    return 0
