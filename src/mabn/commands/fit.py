"""``python -m mabn fit|validate --config configs/<stage>.yaml ...``: the LightningCLI (``mabn.cli``) as is."""

from __future__ import annotations

from .. import cli
from ..process import end_process_group_at_exit


def main(argv: list[str]) -> int:
    """``argv`` starts with the subcommand, ``fit`` or ``validate``."""
    end_process_group_at_exit()  # every run, whatever its norm: a DDP worker must exit cleanly
    try:
        cli.run_cli(argv)
    except Exception as err:
        cli.exit_on_user_error(err)
    return 0
