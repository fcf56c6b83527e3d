"""A generated data set written once, whole, whatever runs at the same time or gets killed.

Concurrent launches on one machine take turns on a lock file beside the set; the first writes the set into
a temporary sibling folder and renames it into place, so the set's folder only ever appears complete, and
a generation killed half-way leaves a temporary folder that the next launch removes (holding the lock, it
knows nobody else is writing there).
"""

from __future__ import annotations

import fcntl
import json
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from .errors import DatasetError

PARTIAL = ".partial-"
MARKER = ".complete"  # the parameters of a whole generated set, written last
IN_PROGRESS = ".generating"  # the parameters of a generation under way, written first


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


def _read_marker(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def write_marked(
    root: str | Path,
    params: dict[str, Any],
    own_files: Callable[[Path], Iterable[Path]],
    write: Callable[[Path], None],
    what: str,
) -> Path:
    """``write(root)`` under markers: ``params`` (with its ``generator``) in ``root/.generating`` first and in
    ``root/.complete`` last, so a second call with the same parameters returns at once, and an interrupted
    generation or one with other parameters is rewritten after deleting ``own_files(root)`` alone. A non-empty
    ``root`` without a marker of this generator is refused with a ``DatasetError``: it is someone's data."""
    root = Path(root)
    done, busy = root / MARKER, root / IN_PROGRESS
    previous = _read_marker(done) if done.is_file() else _read_marker(busy) if busy.is_file() else None
    if previous == params and done.is_file():
        print(f"{what} already complete at {root}")
        return root
    if root.exists() and not root.is_dir():
        raise DatasetError(f"{what}: {root} exists and is not a folder")
    if root.is_dir() and any(root.iterdir()) and (previous is None or previous.get("generator") != params["generator"]):
        raise DatasetError(
            f"{root} is not empty and holds no marker of this generator ({MARKER} or {IN_PROGRESS}); refusing to "
            "write into it: pick an empty or new folder"
        )
    root.mkdir(parents=True, exist_ok=True)
    busy.write_text(json.dumps(params))  # before removing .complete, so a crash always leaves a marker
    done.unlink(missing_ok=True)
    for path in list(own_files(root)):
        path.unlink()
    write(root)
    done.write_text(json.dumps(params))
    busy.unlink()
    return root
