"""The GPU check's modules for its tests: ``scripts/gpu/`` (a tool of the checkout, not of the package), put on the
path as ``python scripts/gpu/check.py`` has it, so that its step process imports them by the same names."""

import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts" / "gpu"
if str(SCRIPTS) not in sys.path:
    sys.path.insert(0, str(SCRIPTS))

import chain  # noqa: E402
import check  # noqa: E402
import devicetests  # noqa: E402

__all__ = ["SCRIPTS", "chain", "check", "devicetests"]
