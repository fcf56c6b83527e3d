"""A generated data set written once, whole, whatever runs at the same time or gets killed.

Concurrent launches on one machine take turns on a lock file beside the set; the first writes the set into
a temporary sibling folder and renames it into place, so the set's folder only ever appears complete, and
a generation killed half-way leaves a temporary folder that the next launch removes (holding the lock, it
knows nobody else is writing there).
"""

from __future__ import annotations

import fcntl
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

PARTIAL = ".partial-"


def generate_once(root: Path, generate: Callable[[Path], Path], say: Callable[[str], None] = print) -> Path:
    """``generate(root)`` once: into a temporary folder renamed to ``root`` when ``root`` does not exist yet,
    else in place (a complete set returns at once; the generator refuses a folder it did not write)."""
    root = Path(root)
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f".{root.name}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"Waiting for another process to finish writing {root} ...")
            fcntl.flock(lock, fcntl.LOCK_EX)
        for stale in root.parent.glob(f".{root.name}{PARTIAL}*"):
            say(f"Removing {stale}, left by a generation that did not finish")
            shutil.rmtree(stale)
        if root.exists():
            return generate(root)
        scratch = Path(tempfile.mkdtemp(prefix=f".{root.name}{PARTIAL}", dir=root.parent))
        try:
            generate(scratch)
            scratch.rename(root)
            say(f"Data set complete: {root}")
        except BaseException:
            shutil.rmtree(scratch, ignore_errors=True)
            raise
    return root
