"""``python -m mabn demo-data [STAGE ...]``: generate the demo data sets the stages use without --data."""

from __future__ import annotations

from .. import launch
from ..help import command_parser


def main(argv: list[str]) -> int:
    parser = command_parser("demo-data", __doc__)
    names = sorted(launch.PROFILES)
    parser.add_argument("stages", nargs="*", help=f"any of {', '.join(names)} (default: all)")
    stages = parser.parse_args(argv).stages or names
    for stage in stages:
        if stage not in launch.PROFILES:
            parser.error(f"unknown stage {stage!r}: choose from {', '.join(names)}")
    for stage in stages:
        profile = launch.PROFILES[stage]
        profile.generate_demo(launch.DEMO_DATA / profile.demo)
    return 0
