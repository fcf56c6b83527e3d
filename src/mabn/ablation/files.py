"""Atomic output files: written to a temporary name in their folder, then renamed over the target, so an
interrupted run never leaves a truncated table, JSON or figure behind."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def write_atomic(path: Path, write: Callable[[Path], None]) -> Path:
    """Call ``write`` on a scratch file beside ``path`` (same folder, so the rename is atomic), then
    rename it to ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, scratch = tempfile.mkstemp(prefix=f".{path.name}-", suffix=path.suffix, dir=path.parent)
    os.close(fd)
    os.chmod(scratch, 0o644)  # mkstemp makes the file private; the outputs are for everyone to read
    try:
        write(Path(scratch))
        os.replace(scratch, path)
    except BaseException:
        Path(scratch).unlink(missing_ok=True)
        raise
    return path


def write_text(path: Path, text: str) -> Path:
    """``text`` to ``path``, atomically."""
    return write_atomic(path, lambda p: p.write_text(text))
